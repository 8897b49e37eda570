"""Tool calls parsed out of a model's answer, per model family: one record per family.

Why per family: every family was tuned to write its calls its own way, and its chat template renders
earlier calls back in that same way; an answer is only understood with the family's grammar. The
family is read from the template's source (the markers it writes), as llama.cpp's ``common/chat.cpp``
does. Each family is ONE `ToolCallFormat` record in `FAMILIES` (in the order templates are matched):
the markers that pick it (``detect``), where a call starts (``openers``: what a stream holds back),
its markers that may be control tokens (``specials``: written out as text for the parser), wrappers
that are not content (``strip``), its whole-text ``parser``, how a forced call is written (``forced``,
`call_grammar`) and its docs/models.md row (``example``, ``models``; `families_table`). Adding a family
is adding a record.

How an answer is split into reasoning, content and calls, streamed or not, is
`graftmem.core.answers` (one state machine); `parse` here reads the calls of a whole text. Only calls
naming a tool of the request are kept; a span that does not parse stays text, so a model's malformed
call is shown, never dropped. Every parser reads JSON through `_loads` / `_json_prefix`
(`graftmem.core.jsontext`: nested deeper than 64 levels is not JSON), so an answer of 100,000 nested
brackets is text, never a ``RecursionError``, and a call's arguments can always be encoded again; a
family whose argument values fall back to text (the XML ones) keeps such a value as its text.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

if TYPE_CHECKING:
    from .grammar_limits import GrammarLimits

from . import jsontext

__all__ = ["ToolCallFormat", "Parsed", "FAMILIES", "FORMATS", "FORCEABLE", "tool_format", "parse", "call_id",
           "call_grammar", "harmony_split", "held_suffix", "families_table"]


@dataclass(frozen=True)
class ToolCallFormat:
    """One family, in one record: how its template is recognised, where a call starts (what a stream
    holds back), the markers that may be control tokens (written out for the parser), its parser, its
    forced-call grammar and its row in docs/models.md (`families_table`)."""

    name: str
    openers: tuple[str, ...]
    #: a call may be the whole answer with no marker (Llama 3.x's bare JSON): hold an answer that
    #: starts with ``{`` until it is complete
    bare_json: bool = False
    #: the id shape the family's template demands
    id_style: str = "openai"
    #: for JSON calls between markers: the markers (an empty close: up to the end of the answer)
    open: str = ""
    close: str = ""
    #: the template markers that pick this family: any group whose markers all appear
    detect: tuple[tuple[str, ...], ...] = ()
    #: marker texts that may be control tokens (the answer shows them, as llama-server's preserved tokens)
    specials: tuple[str, ...] = ()
    #: wrappers the family writes around its content (Command R7B's ``<|START_RESPONSE|>``): not content
    strip: tuple[str, ...] = ()
    #: how a forced call is written (`call_grammar`): ("json" | "named" | "xml", the parts) or ("gemma4", ());
    #: None: not forceable
    forced: Optional[tuple[str, tuple[Any, ...]]] = None
    #: docs/models.md: the call as the family writes it, and its models
    example: str = ""
    models: str = ""

    #: the whole-answer parser: ``(content, calls, reasoning)`` of a text
    parser: Optional[Callable[[str, "ToolCallFormat"], tuple[Optional[str], list, Optional[str]]]] = \
        field(default=None, compare=False, repr=False)


@dataclass
class Parsed:
    """An answer split into content, tool calls (OpenAI shape) and reasoning."""

    content: Optional[str]
    calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: Optional[str] = None


def tool_format(template_source: Optional[str]) -> ToolCallFormat:
    """The family whose markers the template writes (`ToolCallFormat.detect`, in `FAMILIES` order;
    Hermes when it writes none of them: the format graftmem's hand-written tool prompt asks for)."""
    src = template_source or ""
    for fmt in FAMILIES:
        if any(all(m in src for m in group) for group in fmt.detect):
            return fmt
    return HERMES


def call_id(style: str = "openai") -> str:
    """A fresh call id: ``call_`` + 24 hex for OpenAI, 9 letters and digits for Mistral."""
    if style == "mistral":
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def _call(name: str, args: Any, style: str) -> dict[str, Any]:
    return {"id": call_id(style), "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def _json_prefix(text: str) -> tuple[Any, int]:
    """The JSON value at the start of ``text`` (after whitespace) and where it ends; a ``ValueError`` when
    there is none (or it nests too deep: `graftmem.core.jsontext`)."""
    return jsontext.load_prefix(text)


def _loads(text: str) -> Any:
    """``text`` as JSON, or a ``ValueError`` (not JSON, or nested too deep: `graftmem.core.jsontext`): how
    every parser here reads a call's JSON."""
    return jsontext.loads(text)


def parse(text: str, fmt: ToolCallFormat, names: Optional[Iterable[str]] = None) -> Parsed:
    """Content and calls of a whole ``text`` in ``fmt`` (and harmony's analysis channel as reasoning);
    ``names`` keeps only calls of those tools (None: any name). Think blocks are not split here: an
    answer is split by `graftmem.core.answers`, the one parser of the stream and the whole answer."""
    allowed = set(names) if names is not None else None
    assert fmt.parser is not None
    content, calls, extra_think = fmt.parser(text, fmt)
    kept = [c for c in calls if allowed is None or c["function"]["name"] in allowed]
    if len(kept) != len(calls):
        content, kept = text, []  # a call of a tool not offered is text, as the model wrote it
    if content is not None:
        content = content.strip() or None
    return Parsed(content=content, calls=kept, reasoning=extra_think)


# ------------------------------------------------------------------------------------ families
_HERMES_OPEN = re.compile(r"<tool_call>\s*")
_HERMES_CLOSE = re.compile(r"\s*</tool_call>")


def _hermes(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    """``<tool_call>{json}</tool_call>`` spans; the JSON is read as JSON (a string argument may hold
    ``</tool_call>``), the closer may be missing at the end of the answer (an end-of-turn token ended it)."""
    calls: list[dict[str, Any]] = []
    spans: list[tuple[int, int]] = []
    for m in _HERMES_OPEN.finditer(text):
        if spans and m.start() < spans[-1][1]:
            continue  # inside the previous call's JSON
        try:
            obj, end = _json_prefix(text[m.end():])
        except ValueError:
            return text, [], None
        stop = m.end() + end
        close = _HERMES_CLOSE.match(text, stop)
        if close:
            stop = close.end()
        elif text[stop:].strip():
            return text, [], None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, [], None
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), fmt.id_style))
        spans.append((m.start(), stop))
    return (_spans_out(text, spans) if calls else text), calls, None


_XML_CALL = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>(?:\s*</tool_call>)?", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _qwen_xml(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    calls = []
    for m in _XML_CALL.finditer(text):
        args: Any = {}
        body = m.group(2).strip()
        if body.startswith("{"):  # Functionary v3.1: <function=NAME>{json}</function>
            try:
                args = _loads(body)
            except ValueError:
                return text, [], None
        for p in _XML_PARAM.finditer(m.group(2)):
            raw = p.group(2)
            if raw.startswith("\n"):  # Qwen3-Coder's layout: <parameter=K>\nV\n</parameter>
                raw = raw[1:-1] if raw.endswith("\n") else raw[1:]
            try:
                args[p.group(1).strip()] = _loads(raw)
            except ValueError:
                args[p.group(1).strip()] = raw
        calls.append(_call(m.group(1).strip(), args, fmt.id_style))
    if not calls:
        return _hermes(text, fmt)
    return _XML_CALL.sub("", text), calls, None


def _llama3(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    calls = []
    rest = body
    while rest.startswith("{"):
        try:
            obj, end = _json_prefix(rest)
        except ValueError:
            return text, [], None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                not isinstance(obj.get("parameters", obj.get("arguments")), (dict, str)):
            return text, [], None
        calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments")), fmt.id_style))
        rest = rest[end:].lstrip().lstrip(";").lstrip()
    if not calls or rest:
        return text, [], None
    return None, calls, None


_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")


def _mistral(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    i = text.find("[TOOL_CALLS]")
    if i < 0:
        return text, [], None
    content, rest = text[:i], text[i:]
    calls = []
    if _MISTRAL_NAMED.match(rest):  # Mistral Small 3.2 / Devstral: [TOOL_CALLS]name[ARGS]{...} repeated
        while rest:
            m = _MISTRAL_NAMED.match(rest)
            if not m:
                return text, [], None
            try:
                args, end = _json_prefix(rest[m.end():])
            except ValueError:
                return text, [], None
            calls.append(_call(m.group(1), args, fmt.id_style))
            rest = rest[m.end() + end:].strip()
        return content, calls, None
    try:
        arr, end = _json_prefix(rest[len("[TOOL_CALLS]"):])
    except ValueError:
        return text, [], None
    if isinstance(arr, dict):
        arr = [arr]
    if not isinstance(arr, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in arr):
        return text, [], None
    for c in arr:
        calls.append(_call(c["name"], c.get("arguments", c.get("parameters", {})), fmt.id_style))
    return content + rest[len("[TOOL_CALLS]") + end:], calls, None


_HARMONY_CHANNEL = re.compile(r"<\|channel\|>(\w+)")
_HARMONY_TO = re.compile(r"to=([A-Za-z0-9_.\-]+)")
_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HARMONY_MARKS = ("<|start|>", "<|channel|>", "<|message|>", *_HARMONY_ENDS)


def harmony_split(text: str, names: Optional[Iterable[str]], *, final: bool = True, reasoning: bool = True
                  ) -> tuple[str, list[dict[str, Any]], str]:
    """GPT-OSS's answer as ``(content, calls, reasoning)``: messages one after another, each a header up to
    ``<|message|>`` (its last ``<|channel|>NAME``, a recipient ``to=R``) and a body up to ``<|end|>`` /
    ``<|call|>`` / ``<|return|>`` / the next ``<|start|>``. ``analysis`` is reasoning (``reasoning=False``:
    its message stays in the content as written), ``final`` and ``commentary`` are content, a message to
    ``functions.F`` of ``names`` (None: any) is a call (a function not offered, or arguments that are not
    JSON: its body is content), a message to another recipient (``python``, ``container.exec``: the
    model's built-in tools) is left out, as llama.cpp leaves it. ``final=False``: the partial view of a
    stream (`graftmem.core.answers`): no held marker shows, a call is not read yet. An answer without
    any header is content."""
    allowed = set(names) if names is not None else None
    finals: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    if "<|channel|>" not in text and "<|message|>" not in text:
        head = text.lstrip()
        if not final and (head.startswith(("to=", "<|")) or "to=".startswith(head) or "<|".startswith(head)):
            return "", [], ""  # a header may be arriving (`` to=functions.F<|channel|>...``)
        return (text if final else text[:len(text) - held_suffix(text, _HARMONY_MARKS)]), [], ""
    pos = 0
    while pos < len(text):
        k = text.find("<|message|>", pos)
        if k < 0:
            break  # a header still arriving, or a header without a message (nothing to show)
        head = text[pos:k]
        channels = _HARMONY_CHANNEL.findall(head)
        recipients = [r for r in _HARMONY_TO.findall(head) if r != "assistant"]
        start = head.find("<|channel|>")
        body_at = k + len("<|message|>")
        ends = [(i, e) for e in _HARMONY_ENDS if (i := text.find(e, body_at)) >= 0]
        nxt = text.find("<|start|>", body_at)
        if nxt >= 0:
            ends.append((nxt, ""))
        stop, end_mark = min(ends) if ends else (len(text), "")
        body = text[body_at:stop]
        complete = bool(ends) or final
        if not complete:
            body = body[:len(body) - held_suffix(body, _HARMONY_MARKS)]
        if start < 0 and not channels:
            finals.append(head + "<|message|>" + body)  # no header: text as written
        elif recipients:
            name = recipients[-1]
            if name.startswith("functions.") and complete:
                name = name[len("functions."):]
                try:
                    args = _loads(body) if allowed is None or name in allowed else None
                except ValueError:
                    args = None
                if args is not None:
                    calls.append(_call(name, args, "openai"))
                else:  # a call that does not parse, or of a tool not offered: shown as the model wrote it
                    finals.append(text[pos:stop + len(end_mark)])
        elif channels and channels[-1] == "analysis":
            if reasoning:
                thoughts.append(body.strip() if complete else body.lstrip())
            else:
                finals.append(text[pos + start:stop + len(end_mark)] if complete else text[pos + start:body_at] + body)
        else:
            finals.append(body)
        pos = stop + len(end_mark)
    return "".join(finals), calls, "\n".join(t for t in thoughts if t)


def held_suffix(text: str, markers: Iterable[str]) -> int:
    """How many trailing characters of ``text`` may be the start of one of ``markers``."""
    best = 0
    for mk in markers:
        for n in range(min(len(mk) - 1, len(text)), best, -1):
            if text.endswith(mk[:n]):
                best = n
                break
    return best


def _harmony(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, Optional[str]]:
    if "<|channel|>" not in text and "<|message|>" not in text:
        return text, [], None
    content, calls, thought = harmony_split(text, None, final=True)
    return content, calls, thought or None


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\s*```\s*"
                      r"|([^<]+?)<｜tool▁sep｜>(.*?))<｜tool▁call▁end｜>", re.S)


def _deepseek(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    i = text.find("<｜tool▁calls▁begin｜>")
    j = i if i >= 0 else text.find("<｜tool▁call▁begin｜>")
    if j < 0:
        return text, [], None
    calls = []
    for m in _DS_CALL.finditer(text, j):
        name, raw = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        try:
            args = _loads(raw)
        except ValueError:
            return text, [], None
        calls.append(_call(name.strip(), args, fmt.id_style))
    if not calls:
        return text, [], None
    return text[:j], calls, None


_G4_CALL = re.compile(r"<\|tool_call>call:([A-Za-z0-9_.\-]+)\{")


def _gemma_value(s: str, i: int, depth: int = 0) -> tuple[Any, int]:
    """One value of Gemma 4's call syntax at ``s[i]``: ``<|"|>text<|"|>``, ``{k:v,...}``, ``[v,...]``,
    or a bare number / true / false / null; nested deeper than JSON may be (`jsontext.MAX_DEPTH`), a
    ``ValueError``, as `_loads` refuses such JSON."""
    q = '<|"|>'
    if s.startswith(q, i):
        end = s.index(q, i + len(q))
        return s[i + len(q):end], end + len(q)
    if s[i] in "{[" and depth >= jsontext.MAX_DEPTH:
        raise jsontext.TooDeep(f"a value nested more than {jsontext.MAX_DEPTH} levels deep")
    if s[i] == "{":
        obj: dict[str, Any] = {}
        i += 1
        while s[i] != "}":
            if s.startswith(q, i):
                key, i = _gemma_value(s, i, depth + 1)
            else:
                j = s.index(":", i)
                key, i = s[i:j], j
            if s[i] != ":":
                raise ValueError("expected ':'")
            obj[str(key)], i = _gemma_value(s, i + 1, depth + 1)
            if s[i] == ",":
                i += 1
        return obj, i + 1
    if s[i] == "[":
        arr = []
        i += 1
        while s[i] != "]":
            v, i = _gemma_value(s, i, depth + 1)
            arr.append(v)
            if s[i] == ",":
                i += 1
        return arr, i + 1
    m = re.compile(r"[^,}\]]+").match(s, i)
    if not m:
        raise ValueError("empty value")
    raw = m.group(0).strip()
    return _loads(raw) if raw in ("true", "false", "null") or re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", raw) \
        else raw, m.end()


def _gemma4(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    calls, spans = [], []
    for m in _G4_CALL.finditer(text):
        try:
            args, end = _gemma_value(text, m.end() - 1)
        except (ValueError, IndexError):
            return text, [], None
        close = "<tool_call|>"
        stop = end + len(close) if text.startswith(close, end) else end
        calls.append(_call(m.group(1), args, fmt.id_style))
        spans.append((m.start(), stop))
    if not calls:
        return text, [], None
    out, last = [], 0
    for a, b in spans:
        out.append(text[last:a])
        last = b
    out.append(text[last:])
    return "".join(out), calls, None


def _value(raw: str) -> Any:
    try:
        return _loads(raw)
    except ValueError:
        return raw


def _spans_out(text: str, spans: list[tuple[int, int]]) -> str:
    out, last = [], 0
    for a, b in spans:
        out.append(text[last:a])
        last = b
    out.append(text[last:])
    return "".join(out)


_GLM_CALL = re.compile(r"<tool_call(?::\w+)?>\s*([^<\n]+?)\s*(?:<tool_sep(?::\w+)?>)?\s*((?:<arg_key.*?)?)</tool_call(?::\w+)?>", re.S)
_GLM_ARG = re.compile(r"<arg_key(?::\w+)?>(.*?)</arg_key(?::\w+)?>\s*<arg_value(?::\w+)?>(.*?)</arg_value(?::\w+)?>", re.S)


def _glm(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    calls, spans = [], []
    for m in _GLM_CALL.finditer(text):
        args = {k.strip(): _value(v) for k, v in _GLM_ARG.findall(m.group(2))}
        calls.append(_call(m.group(1).strip(), args, fmt.id_style))
        spans.append(m.span())
    if not calls:
        return text, [], None
    rest = re.sub(r"</?tool_calls(?::\w+)?>", "", _spans_out(text, spans))
    return rest, calls, None


_INVOKE = re.compile(r'<([^<>\s]*?)invoke name="([^"]+)">(.*?)</\1invoke>', re.S)


def _invoke_xml(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    calls, spans = [], []
    for m in _INVOKE.finditer(text):
        prefix = re.escape(m.group(1))
        params = re.finditer(rf'<{prefix}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{prefix}parameter>',
                             m.group(3), re.S)
        args = {p.group(1): (p.group(3) if p.group(2) == "true" else _value(p.group(3))) for p in params}
        calls.append(_call(m.group(2), args, fmt.id_style))
        spans.append(m.span())
    if not calls:
        return text, [], None
    rest = re.sub(r"</?[^<>\s]*?(?:function_calls|tool_calls?)>", "", _spans_out(text, spans))
    return rest, calls, None


_KIMI = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>")


def _kimi(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    """Kimi K2: ``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{json}<|tool_call_end|>``,
    in a ``<|tool_calls_section_begin|>`` section; the arguments are read as JSON, the end marker may be
    missing (the next call or the end of the answer ends it)."""
    calls, spans = [], []
    for m in _KIMI.finditer(text):
        try:
            args, end = _json_prefix(text[m.end():])
        except ValueError:
            return text, [], None
        stop = m.end() + end
        close = re.compile(r"\s*<\|tool_call_end\|>").match(text, stop)
        calls.append(_call(m.group(1), args, fmt.id_style))
        spans.append((m.start(), close.end() if close else stop))
    if not calls:
        return text, [], None
    return re.sub(r"<\|tool_calls_section_(?:begin|end)\|>", "", _spans_out(text, spans)), calls, None


_M3 = "]<]minimax[>["
_M3_BLOCK = re.compile(re.escape(_M3) + r"<tool_call>(.*?)(?:" + re.escape(_M3) + r"</tool_call>|$)", re.S)
_M3_INVOKE = re.compile(re.escape(_M3) + r'<invoke name="([^"]+)">(.*?)' + re.escape(_M3) + r"</invoke>", re.S)
_M3_PARAM = re.compile(re.escape(_M3) + r"<([A-Za-z0-9_.\-]+)>(.*?)" + re.escape(_M3) + r"</\1>", re.S)


def _m3_value(raw: str, depth: int = 0) -> Any:
    """An argument of MiniMax M3: nested tags are an array (all ``<item>``) or an object, else a value."""
    kids = _M3_PARAM.findall(raw) if depth < jsontext.MAX_DEPTH else []
    if not kids or _M3_PARAM.sub("", raw).strip():
        return _value(raw)
    if all(k == "item" for k, _ in kids):
        return [_m3_value(v, depth + 1) for _, v in kids]
    return {k: _m3_value(v, depth + 1) for k, v in kids}


def _minimax3(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    """MiniMax M3: every tag behind ``]<]minimax[>[``: ``<tool_call>``, ``<invoke name="N">``, then one
    ``<KEY>VALUE</KEY>`` per argument (a value is JSON where it reads as JSON, else its text)."""
    calls, spans = [], []
    for block in _M3_BLOCK.finditer(text):
        for m in _M3_INVOKE.finditer(block.group(1)):
            calls.append(_call(m.group(1), {k: _m3_value(v) for k, v in _M3_PARAM.findall(m.group(2))}, fmt.id_style))
        spans.append(block.span())
    if not calls:
        return text, [], None
    return _spans_out(text, spans), calls, None


_PY_CALLS = re.compile(r"<\|tool_call_start\|>\s*(\[.*?\])\s*(?:<\|tool_call_end\|>|$)", re.S)


class _JsonNames:
    """``true`` / ``false`` / ``null`` in a pythonic call's value read as JSON's (a forced call writes JSON values)."""

    VALUES = {"true": True, "false": False, "null": None}

    def visit(self, node: Any) -> Any:
        import ast

        class T(ast.NodeTransformer):
            def visit_Name(self, n: ast.Name) -> Any:
                return ast.Constant(_JsonNames.VALUES[n.id]) if n.id in _JsonNames.VALUES else n
        return T().visit(node)


def _pythonic(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    """LFM2: ``<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>``, Python call syntax with
    literal values (read with ``ast.literal_eval``: nothing is evaluated)."""
    import ast

    calls, spans = [], []
    for m in _PY_CALLS.finditer(text):
        try:
            tree = ast.parse(m.group(1), mode="eval").body
            if not isinstance(tree, ast.List):
                return text, [], None
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)) or node.args:
                    return text, [], None
                args = {kw.arg: ast.literal_eval(_JsonNames().visit(kw.value)) for kw in node.keywords}
                calls.append(_call(ast.unparse(node.func), args, fmt.id_style))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, [], None
        spans.append(m.span())
    if not calls:
        return text, [], None
    return _spans_out(text, spans), calls, None
_SOLAR = re.compile(r"<\|tool_call:begin\|>[^<]*<\|tool_call:name\|>([^<]+)<\|tool_call:args\|>(.*?)<\|tool_call:end\|>", re.S)
_MINICPM = re.compile(r'<function name="([^"]+)">(.*?)</function>', re.S)
_MINICPM_P = re.compile(r'<param name="([^"]+)">(?:<!\[CDATA\[(.*?)\]\]>|(.*?))</param>', re.S)


def _regex_calls(rx: "re.Pattern[str]", json_args: bool, strip: str):
    def parser(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
        calls, spans = [], []
        for m in rx.finditer(text):
            if json_args:
                try:
                    args = _loads(m.group(2))
                except ValueError:
                    return text, [], None
            else:
                args = {k: (cdata if cdata or not v else _value(v)) for k, cdata, v in _MINICPM_P.findall(m.group(2))}
            calls.append(_call(m.group(1).strip(), args, fmt.id_style))
            spans.append(m.span())
        if not calls:
            return text, [], None
        return re.sub(strip, "", _spans_out(text, spans)) if strip else _spans_out(text, spans), calls, None
    return parser


def _json_calls(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    """JSON call objects between two markers: ``{"name", "arguments"}``, Cohere's ``{"tool_name",
    "parameters"}``, Apertus' ``{"NAME": {args}}``; a list, or objects one after another."""
    i = text.find(fmt.open)
    if i < 0:
        return text, [], None
    j = text.find(fmt.close, i + len(fmt.open)) if fmt.close else -1
    body = text[i + len(fmt.open):j if j >= 0 else len(text)].strip()
    if body.startswith("```"):  # Command R+: Action:\n```json\n[...]```
        fence = body.find("```", 3)
        if fence < 0:
            return text, [], None
        j = i + len(fmt.open) + (len(text[i + len(fmt.open):]) - len(text[i + len(fmt.open):].lstrip())) + fence
        body = body[3:fence].strip()
        body = body[4:] if body.startswith("json") else body
    values, rest = [], body
    try:
        while rest.strip():
            v, end = _json_prefix(rest)
            values.extend(v if isinstance(v, list) else [v])
            rest = rest[end:].lstrip().lstrip(",")
    except ValueError:
        return text, [], None
    calls = []
    for v in values:
        if not isinstance(v, dict):
            return text, [], None
        name = v.get("name", v.get("tool_name"))
        args = v.get("arguments", v.get("parameters"))
        if name is None and len(v) == 1:  # Apertus: {"NAME": {args}}
            name, args = next(iter(v.items()))
        if not isinstance(name, str):
            return text, [], None
        calls.append(_call(name, args if args is not None else {}, fmt.id_style))
    end = (j + (3 if fmt.close == "" else len(fmt.close))) if j >= 0 else len(text)
    return text[:i] + text[end:], calls, None


_solar = _regex_calls(_SOLAR, True, r"<\|tool_calls\|>|<\|calls\|>")
_minicpm = _regex_calls(_MINICPM, False, "")
F = ToolCallFormat

#: Every family, in the order a template is matched against their markers (the more specific first).
FAMILIES: tuple[ToolCallFormat, ...] = (
    F("kimi", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), parser=_kimi,
      detect=(("<|tool_calls_section_begin|>",),),
      specials=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
      forced=("named", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>functions.", ":0<|tool_call_argument_begin|>",
                        "<|tool_call_end|>", "<|tool_calls_section_end|>")),
      example="<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>", models="Kimi K2"),
    F("solar", ("<|tool_call:begin|>",), parser=_solar, detect=(("<|tool_call:begin|>",),),
      specials=("<|tool_call:begin|>", "<|tool_call:name|>", "<|tool_call:args|>", "<|tool_call:end|>", "<|tool_calls|>"),
      forced=("named", ("", "<|tool_call:begin|><|tool_call:name|>", "<|tool_call:args|>", "<|tool_call:end|>", "")),
      example="<|tool_call:begin|><|tool_call:name|>NAME<|tool_call:args|>{...}<|tool_call:end|>", models="Solar Open"),
    F("glm", ("<tool_call",), parser=_glm, detect=(("<arg_key",),), strip=("<|role_end|>",),
      forced=("xml", ("<tool_call>", "\n", "<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n", "</tool_call>")),
      example="<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>",
      models="GLM-4.x, Ling, Laguna, Hy3"),
    F("minimax3", (_M3 + "<tool_call>",), parser=_minimax3, detect=((_M3,),),
      forced=("xml", (_M3 + "<tool_call>\n" + _M3 + '<invoke name="', '">', _M3 + "<", ">", _M3 + "</{key}>",
                      _M3 + "</invoke>\n" + _M3 + "</tool_call>")),
      example=_M3 + '<tool_call>' + _M3 + '<invoke name="NAME">' + _M3 + '<K>V' + _M3 + '</K>...', models="MiniMax M3"),
    F("invoke-xml", ("<minimax:tool_call>", "<｜DSML｜", "<function_calls>", "<invoke name="), parser=_invoke_xml,
      detect=(("invoke name=",),),
      forced=("xml", ('<invoke name="', '">\n', '<parameter name="', '">', "</parameter>\n", "</invoke>")),
      example='<invoke name="NAME"><parameter name="K">V</parameter></invoke>',
      models="MiniMax M2, DeepSeek V3.2 / V4 (DSML), muse"),
    F("minicpm", ('<function name="',), parser=_minicpm, detect=(('<function name="',),),
      forced=("xml", ('<function name="', '">', '<param name="', '">', "</param>", "</function>")),
      example='<function name="NAME"><param name="K">V</param></function>', models="MiniCPM5"),
    F("cohere", ("<|START_ACTION|>",), open="<|START_ACTION|>", close="<|END_ACTION|>", parser=_json_calls,
      detect=(("<|START_ACTION|>",),), specials=("<|START_ACTION|>", "<|END_ACTION|>"),
      forced=("json", ("<|START_ACTION|>", "<|END_ACTION|>", "tool_name", "parameters", True, True)),
      strip=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>"),
      example='<|START_ACTION|>[{"tool_name": NAME, "parameters": {...}}]<|END_ACTION|>',
      models="Command R7B, Command A (Cohere2)"),
    F("apertus", ("<|tools_prefix|>",), open="<|tools_prefix|>", close="<|tools_suffix|>", parser=_json_calls,
      detect=(("<|tools_prefix|>",),), specials=("<|tools_prefix|>", "<|tools_suffix|>"),
      forced=("json", ("<|tools_prefix|>", "<|tools_suffix|>", "", "", True, True)),
      example='<|tools_prefix|>[{"NAME": {...}}]<|tools_suffix|>', models="Apertus"),
    F("nemotron", ("<TOOLCALL>",), open="<TOOLCALL>", close="</TOOLCALL>", parser=_json_calls,
      detect=(("<TOOLCALL>",),),
      forced=("json", ("<TOOLCALL>", "</TOOLCALL>", "name", "arguments", True, True)),
      example='<TOOLCALL>[{"name": NAME, "arguments": {...}}]</TOOLCALL>', models="Nemotron Nano v2"),
    F("tool-calls-json", ("<tool_calls>",), open="<tool_calls>", close="</tool_calls>", parser=_json_calls,
      detect=(("<tool_calls>",),),
      forced=("json", ("<tool_calls>", "</tool_calls>", "name", "arguments", True, True)),
      example='<tool_calls>[{"name": NAME, "arguments": {...}}]</tool_calls>', models="Apriel, MiniMax M1"),
    F("gigachat31", ("<|function_call|>",), open="<|function_call|>", close="<|message_sep|>", parser=_json_calls,
      detect=(("<|function_call|>",),), specials=("<|function_call|>",), strip=("<|message_sep|>",),
      forced=("json", ("<|function_call|>", "<|message_sep|>", "name", "arguments", False, True)),
      example='<|function_call|>{"name": NAME, "arguments": {...}}', models="GigaChat 3.1"),
    F("command-r", ("Action:",), open="Action:", close="", parser=_json_calls,
      detect=(("Action:", "tool_name"),), strip=("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
      forced=("json", ("Action: ```json\n", "\n```", "tool_name", "parameters", True, False)),
      example='Action: ```json [{"tool_name": NAME, "parameters": {...}}]```', models="Command R+"),
    F("gigachat", ("function call",), open="function call<|role_sep|>", close="<|message_sep|>", parser=_json_calls,
      detect=(("function call", "<|role_sep|>"),), specials=("<|role_sep|>",), strip=("<|message_sep|>",),
      forced=("json", ("function call<|role_sep|>\n", "<|message_sep|>", "name", "arguments", False, True)),
      example='function call<|role_sep|>{"name": NAME, "arguments": {...}}', models="GigaChat 3"),
    F("qwen-xml", ("<tool_call>", "<function=", "<seed:tool_call>"), parser=_qwen_xml, detect=(("<function=",),),
      strip=("<seed:tool_call>", "</seed:tool_call>"),
      forced=("xml", ("<tool_call>\n<function=", ">\n", "<parameter=", ">\n", "\n</parameter>\n",
                      "</function>\n</tool_call>")),
      example="<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>",
      models="Qwen3-Coder, Qwen3.5, Functionary v3.1, Seed-OSS"),
    F("pythonic", ("<|tool_call_start|>",), parser=_pythonic, detect=(("<|tool_call_start|>",),),
      specials=("<|tool_call_start|>", "<|tool_call_end|>"), forced=("pythonic", ()),
      example="<|tool_call_start|>[NAME(key=value)]<|tool_call_end|>", models="LFM2 / LFM2.5"),
    F("firefunction", ("functools[",), open="functools", close="", parser=_json_calls, detect=(("functools[",),),
      forced=("json", ("functools", "", "name", "arguments", True, False)),
      example='functools[{"name": NAME, "arguments": {...}}]', models="FireFunction v2"),
    F("hermes", ("<tool_call>",), parser=_hermes, detect=(("<tool_call>",),), specials=("<tool_call>", "</tool_call>"),
      forced=("json", ("<tool_call>\n", "\n</tool_call>", "name", "arguments", False, False)),
      example='<tool_call>{"name": NAME, "arguments": {...}}</tool_call>',
      models="Hermes, Qwen 2.5 / 3, SmolLM3, Granite 4; graftmem's tool prompt for templates without tools"),
    F("mistral", ("[TOOL_CALLS]",), id_style="mistral", parser=_mistral, detect=(("[TOOL_CALLS]",),),
      specials=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
      forced=("json", ("[TOOL_CALLS]", "", "name", "arguments", True, False)),
      example='[TOOL_CALLS][{"name": NAME, "arguments": {...}}] or [TOOL_CALLS]NAME[ARGS]{...}',
      models="Mistral Nemo / Small 3.2, Devstral, Magistral (ids of 9 letters and digits)"),
    F("harmony", ("to=functions.", "<|channel|>", "<|start|>"), parser=_harmony,
      detect=(("to=functions.",), ("<|channel|>", "<|call|>")),
      specials=("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>", "<|call|>"),
      forced=("named", ("", "<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", "", "")),
      example="<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>",
      models="GPT-OSS (analysis channel = reasoning, final = content)"),
    F("deepseek", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"), parser=_deepseek,
      detect=(("tool▁call▁begin",),),
      specials=("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                "<｜tool▁calls▁end｜>"),
      forced=("named", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "\n```json\n",
                        "\n```<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")),
      example="<｜tool▁call▁begin｜>[function<｜tool▁sep｜>]NAME[```json]{...}[```]<｜tool▁call▁end｜>",
      models="DeepSeek R1 (and its distills), V3, V3.1"),
    F("gemma4", ("<|tool_call>",), parser=_gemma4, detect=(("<|tool_call>",),),
      strip=("<|channel>thought", "<channel|>", "<|channel>"),
      specials=("<|tool_call>", "<tool_call|>", '<|"|>'), forced=("gemma4", ()),
      example='<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>', models="Gemma 4"),
    F("llama3", ("<|python_tag|>",), bare_json=True, parser=_llama3,
      detect=(("<|start_header_id|>", "parameters"), ("<|start_header_id|>", "<|python_tag|>")),
      specials=("<|python_tag|>",), forced=("json", ("", "", "name", "parameters", False, False)),
      example='{"name": NAME, "parameters": {...}} (optionally after <|python_tag|>)', models="Llama 3.1 / 3.2 / 3.3"),
)
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in FAMILIES}
HERMES, QWEN_XML, LLAMA3, MISTRAL, HARMONY, DEEPSEEK, GEMMA4 = (
    FORMATS[n] for n in ("hermes", "qwen-xml", "llama3", "mistral", "harmony", "deepseek", "gemma4"))
GLM, INVOKE_XML, KIMI, SOLAR, MINICPM, COHERE, COMMAND_R, APERTUS, NEMOTRON, TOOL_CALLS_JSON, GIGACHAT, GIGACHAT31 = (
    FORMATS[n] for n in ("glm", "invoke-xml", "kimi", "solar", "minicpm", "cohere", "command-r", "apertus",
                         "nemotron", "tool-calls-json", "gigachat", "gigachat31"))
del F


def families_table() -> str:
    """docs/models.md's table of families, made from `FAMILIES` (tests/test_answer_parity.py checks the
    page holds it: ``python -m graftmem.core.toolcalls`` prints it)."""
    rows = ["| family | a call as the model writes it | models | forced call |", "| --- | --- | --- | --- |"]
    for f in FAMILIES:
        ex = f.example.replace("|", "\\|")
        rows.append(f"| {f.name} | `{ex}` | {f.models} | {'grammar' if f.forced else 'no'} |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------ forced calls
def _lit(text: str) -> str:
    """A GBNF literal (UTF-8 as is: the markers of DeepSeek and Gemma are not ASCII)."""
    return json.dumps(text, ensure_ascii=False)


#: The forced-call shapes, read from the records (`ToolCallFormat.forced`).
#: "json": JSON objects (``{"name": ..., "arguments": ...}`` or the family's keys) between markers:
#: (opener, closer, name key, arguments key, list of calls, closer optional). An optional closer: the
#: family may end its turn there with an end-of-generation token, which a grammar cannot ask for as text
#: (llama.cpp never lets an end-of-generation token match a literal), and the parser reads the call to
#: the end of the answer without it.
#: "named": the function named in markers, its arguments one JSON object: (the calls' section opener,
#: before the name, between the name and the arguments, after the arguments, the section's closer).
#: "xml": each argument in its own markup: (call head before the name, after the name, one argument's
#: head before the key, after the key, its tail, the call's tail); the value is JSON.
_JSON_CALLS: dict[str, tuple[Any, ...]] = {f.name: f.forced[1] for f in FAMILIES if f.forced and f.forced[0] == "json"}
_NAMED_CALLS: dict[str, tuple[Any, ...]] = {f.name: f.forced[1] for f in FAMILIES if f.forced and f.forced[0] == "named"}
_XML_CALLS: dict[str, tuple[Any, ...]] = {f.name: f.forced[1] for f in FAMILIES if f.forced and f.forced[0] == "xml"}


def _seq(*parts: str) -> str:
    """GBNF parts in sequence (empty ones left out)."""
    return " ".join(p for p in parts if p)


#: Gemma 4's own value syntax (``<|"|>`` quotes strings, keys are bare): the generic value.
_GEMMA_RULES = r'''g-value ::= g-string | g-object | g-array | g-number | "true" | "false" | "null"
g-string ::= "<|\"|>" [^<]* "<|\"|>"
g-object ::= "{" ( g-key ":" g-value ( "," g-key ":" g-value )* )? "}"
g-array ::= "[" ( g-value ( "," g-value )* )? "]"
g-key ::= [a-zA-Z_] [a-zA-Z0-9_]*
g-integer ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} )
g-number ::= g-integer ( "." [0-9]{1,15} )? ( [eE] [-+]? [0-9]{1,4} )?'''

#: The families whose call a grammar can force (`call_grammar`).
FORCEABLE = frozenset(f.name for f in FAMILIES if f.forced)


def _gemma(schema: Any, rules: dict[str, str], name: str) -> str:
    """A rule for Gemma 4's value syntax that follows ``schema`` where it is simple (objects with
    properties, strings, enums of strings, integers, numbers, booleans, arrays), the generic value
    where it is not."""
    if not isinstance(schema, Mapping):
        return "g-value"
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        rules[name] = " | ".join(_lit(f'<|"|>{v}<|"|>') for v in schema["enum"]) or '"null"'
        return name
    if kind == "string":
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if isinstance(lo, int) or isinstance(hi, int):
            rules[name] = f'"<|\\"|>" [^<]{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ""}}} "<|\\"|>"'
            return name
        return "g-string"
    if kind in ("integer", "number"):
        return f"g-{kind}"
    if kind == "boolean":
        return '( "true" | "false" )'
    if kind == "array":
        item = _gemma(schema.get("items"), rules, f"{name}-item")
        rules[name] = f'"[" ( {item} ( "," {item} )* )? "]"'
        return name
    props = schema.get("properties")
    if kind in (None, "object") and isinstance(props, Mapping) and props:
        required = [k for k in props if k in set(schema.get("required") or [])]
        optional = [k for k in props if k not in required]
        if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in props):
            return "g-object"
        kv = {k: f"{_lit(k + ':')} {_gemma(v, rules, f'{name}-{i}')}" for i, (k, v) in enumerate(props.items())}
        parts = [kv[k] for k in required]
        body = ' "," '.join(parts)
        for k in optional:  # optional properties in their order, each may be left out
            body += f' ( "," {kv[k]} )?' if body else f" ( {kv[k]} )?"
        if not required and optional:  # no leading comma before the first one written
            body = " | ".join(f"{kv[k]}" + "".join(f' ( "," {kv[o]} )?' for o in optional[i + 1:])
                              for i, k in enumerate(optional))
            body = f"( {body} )?"
        rules[name] = f'"{{" {body} "}}"'
        return name
    if kind == "object":
        return "g-object"
    return "g-value"


def call_grammar(fmt: ToolCallFormat, functions: Iterable[Mapping[str, Any]], *, parallel: bool = False,
                 think_open: bool = False, limits: Optional["GrammarLimits"] = None) -> str:
    """GBNF for an answer that is a call of one of ``functions`` (``{"name", "parameters"}``) in
    ``fmt``'s own syntax and nothing else: what ``tool_choice: "required"`` (all tools) or a named
    function (that one) asks for, as llama.cpp's ``common/chat.cpp`` builds it per family (not lazy:
    the answer starts with the call). The arguments follow the function's JSON schema (llama.cpp's
    converter, `graftmem.core.engine.json_rules`); the answer parses with `parse` into calls every
    time. ``parallel``: one or more calls, else exactly one. ``think_open``: the prompt opened a
    ``<think>`` block, closed first (the forced answer does not think, as llama-server's).

    A family not in `FORCEABLE` is a `ConfigError` (its call syntax has no grammar here). Every
    function's schema is checked against ``limits`` first (`graftmem.core.grammar_limits`), whatever
    the family writes its arguments with."""
    from .engine import json_rules  # llama.cpp's schema converter: only the engine module imports llama_cpp
    from .errors import ConfigError
    from .grammar_limits import DEFAULT_GRAMMAR_LIMITS, check_schema

    limits = limits or DEFAULT_GRAMMAR_LIMITS
    fns = list(functions)
    if not fns:
        raise ConfigError("a forced tool call needs at least one function")
    for fn in fns:
        check_schema(fn.get("parameters"), f"tools.{fn['name']}.parameters", limits)
    if fmt.name not in FORCEABLE:
        raise ConfigError(f"tool calls of the {fmt.name!r} format cannot be forced by a grammar on this server "
                          f"(forceable: {', '.join(sorted(FORCEABLE))}); use tool_choice \"auto\"")
    rules: list[str] = []
    calls: list[str] = []
    gemma: dict[str, str] = {}
    for i, fn in enumerate(fns):
        name, params = fn["name"], fn.get("parameters") or {"type": "object"}
        if fmt.name in _XML_CALLS:
            head, after_name, k_head, k_after, k_tail, tail = _XML_CALLS[fmt.name]
            props = params.get("properties") if isinstance(params, Mapping) else None
            required = set(params.get("required") or []) if isinstance(params, Mapping) else set()
            parts = []
            for j, (key, sub) in enumerate((props or {}).items()):
                rules.append(json_rules(sub if isinstance(sub, Mapping) else {}, f"fn{i}-p{j}",
                                        f"tools.{name}.parameters.properties.{key}", limits))
                one = f"{_lit(k_head + key + k_after)} fn{i}-p{j} {_lit(k_tail.replace('{key}', key))}"
                parts.append(one if key in required else f"( {one} )?")
            if props is None and fmt.name == "qwen-xml":  # no properties: Functionary's JSON body
                rules.append(json_rules(params, f"fn{i}-args", f"tools.{name}.parameters", limits))
                parts.append(f"fn{i}-args")
            calls.append(_seq(_lit(head + name + after_name), *parts, _lit(tail)))
            continue
        if fmt.name == "pythonic":  # name(key=value, ...): the values JSON (true / false / null read as such)
            props = params.get("properties") if isinstance(params, Mapping) else None
            required = set(params.get("required") or []) if isinstance(params, Mapping) else set()
            kv: dict[str, str] = {}
            for j, (key, sub) in enumerate((props or {}).items()):
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                    raise ConfigError(f"tools.{name}.parameters.properties: {key!r} is not a Python keyword argument "
                                      "name, which this family's call syntax needs")
                rules.append(json_rules(sub if isinstance(sub, Mapping) else {}, f"fn{i}-p{j}",
                                        f"tools.{name}.parameters.properties.{key}", limits))
                kv[key] = f"{_lit(key + '=')} fn{i}-p{j}"
            req = [kv[k] for k in kv if k in required]
            opt = [k for k in kv if k not in required]
            body = ' ", " '.join(req)
            for k in opt:
                body += f' ( ", " {kv[k]} )?' if body else ""
            if not req and opt:
                body = "( " + " | ".join(kv[k] + "".join(f' ( ", " {kv[o]} )?' for o in opt[n + 1:])
                                         for n, k in enumerate(opt)) + " )?"
            calls.append(_seq(_lit("<|tool_call_start|>[" + name + "("), body, _lit(")]<|tool_call_end|>")))
            continue
        if fmt.name == "gemma4":
            calls.append(f"{_lit('<|tool_call>call:' + name)} {_gemma(params, gemma, f'fn{i}-args')} "
                         f"{_lit('<tool_call|>')}?")
            continue
        rules.append(json_rules(params, f"fn{i}-args", f"tools.{name}.parameters", limits))
        if fmt.name in _NAMED_CALLS:
            _, before, between, after, _ = _NAMED_CALLS[fmt.name]
            calls.append(_seq(_lit(before + name + between), f"fn{i}-args", _lit(after) if after else ""))
            continue
        _, _, key_name, key_args, _, _ = _JSON_CALLS[fmt.name]
        head = f"{{{json.dumps(name)}: " if not key_name else \
            f"{{{json.dumps(key_name)}: {json.dumps(name)}, {json.dumps(key_args)}: "
        calls.append(f"{_lit(head)} fn{i}-args {_lit('}')}")
    call = " | ".join(f"( {c} )" for c in calls)
    if fmt.name in _JSON_CALLS:
        opener, closer, _, _, listed, optional = _JSON_CALLS[fmt.name]
        # several calls: in the list, or one after another where a closer ends them (Hermes); a family
        # whose closer may end the generation writes one
        sep = '", "' if listed else {"llama3": '"; "', "hermes": _lit(closer + "\n" + opener)}.get(fmt.name)
        body = f"call ( {sep} call )*" if parallel and sep else "call"
        root = _seq(_lit(opener) if opener else "", f'"[" {body} "]"' if listed else body,
                    (_lit(closer) + ("?" if optional else "")) if closer else "")
    elif fmt.name in _NAMED_CALLS:
        opener, _, _, _, closer = _NAMED_CALLS[fmt.name]
        many = parallel and fmt.name != "harmony"  # a harmony call ends its message (<|call|> ends generation)
        root = _seq(_lit(opener) if opener else "", "call ( call )*" if many else "call",
                    f"{_lit(closer)}?" if closer else "")
    else:
        root = 'call ( "\\n" call )*' if parallel else "call"
    if think_open:
        root = f'"</think>" "\\n"{{0,2}} {root}'
    return "\n".join([f"root ::= {root}", f"call ::= {call}", *rules,
                      *(f"{k} ::= {v}" for k, v in gemma.items()), *( [_GEMMA_RULES] if fmt.name == "gemma4" else [])])


if __name__ == "__main__":  # pragma: no cover - prints docs/models.md's table of families
    import sys

    sys.stdout.write(families_table() + "\n")
