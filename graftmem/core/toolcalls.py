"""Tool calls and reasoning parsed out of a model's answer, per model family.

Why per family: every family was tuned to write its calls its own way, and its chat template renders
earlier calls back in that same way; an answer is only understood with the family's grammar. The
family is read from the template's source (the markers it writes), as llama.cpp's ``common/chat.cpp``
does. Formats:

========== ===================================================================================
hermes     ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5 / 3, SmolLM3)
qwen-xml   ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`` (Qwen3-Coder, 3.5)
llama3     a bare JSON object ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``)
mistral    ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]NAME[ARGS]{...}``;
           ids of 9 letters and digits, which Mistral's templates demand
harmony    GPT-OSS: ``to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>``; the
           ``analysis`` channel is the reasoning, ``final`` the content
deepseek   ``<｜tool▁call▁begin｜>[function<｜tool▁sep｜>]NAME[\\n```json\\n]{...}[```]<｜tool▁call▁end｜>``
gemma4     ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>``
========== ===================================================================================

Reasoning (``<think>...</think>``, DeepSeek R1 / Qwen3 / GLM, and harmony's analysis channel) becomes
``reasoning_content``. Only calls naming a tool of the request are kept; a span that does not parse
stays text, so a model's malformed call is shown, never dropped.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

__all__ = ["ToolCallFormat", "Parsed", "FORMATS", "tool_format", "parse", "call_id", "split_reasoning"]


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's grammar: its name and the markers that start a call (what a stream holds back)."""

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


@dataclass
class Parsed:
    """An answer split into content, tool calls (OpenAI shape) and reasoning."""

    content: Optional[str]
    calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: Optional[str] = None


HERMES = ToolCallFormat("hermes", ("<tool_call>",))
QWEN_XML = ToolCallFormat("qwen-xml", ("<tool_call>", "<function="))
LLAMA3 = ToolCallFormat("llama3", ("<|python_tag|>",), bare_json=True)
MISTRAL = ToolCallFormat("mistral", ("[TOOL_CALLS]",), id_style="mistral")
HARMONY = ToolCallFormat("harmony", ("to=functions.", "<|channel|>", "<|start|>"))
DEEPSEEK = ToolCallFormat("deepseek", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"))
GEMMA4 = ToolCallFormat("gemma4", ("<|tool_call>",))
GLM = ToolCallFormat("glm", ("<tool_call",))
INVOKE_XML = ToolCallFormat("invoke-xml", ("invoke name=",))
KIMI = ToolCallFormat("kimi", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"))
SOLAR = ToolCallFormat("solar", ("<|tool_call:begin|>",))
MINICPM = ToolCallFormat("minicpm", ('<function name="',))
COHERE = ToolCallFormat("cohere", ("<|START_ACTION|>",), open="<|START_ACTION|>", close="<|END_ACTION|>")
COMMAND_R = ToolCallFormat("command-r", ("Action:",), open="Action:", close="")
APERTUS = ToolCallFormat("apertus", ("<|tools_prefix|>",), open="<|tools_prefix|>", close="<|tools_suffix|>")
NEMOTRON = ToolCallFormat("nemotron", ("<TOOLCALL>",), open="<TOOLCALL>", close="</TOOLCALL>")
TOOL_CALLS_JSON = ToolCallFormat("tool-calls-json", ("<tool_calls>",), open="<tool_calls>", close="</tool_calls>")
GIGACHAT = ToolCallFormat("gigachat", ("function call",), open="function call<|role_sep|>", close="<|message_sep|>")
GIGACHAT31 = ToolCallFormat("gigachat31", ("<|function_call|>",), open="<|function_call|>", close="<|message_sep|>")
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    HERMES, QWEN_XML, LLAMA3, MISTRAL, HARMONY, DEEPSEEK, GEMMA4, GLM, INVOKE_XML, KIMI, SOLAR, MINICPM,
    COHERE, COMMAND_R, APERTUS, NEMOTRON, TOOL_CALLS_JSON, GIGACHAT, GIGACHAT31)}


def tool_format(template_source: Optional[str]) -> ToolCallFormat:
    """The family whose markers the template writes (Hermes when it writes none of them: the format
    graftmem's hand-written tool prompt asks for)."""
    src = template_source or ""
    for marker, fmt in (("<|tool_calls_section_begin|>", KIMI), ("<|tool_call:begin|>", SOLAR), ("<arg_key", GLM),
                        ("invoke name=", INVOKE_XML), ('<function name="', MINICPM), ("<|START_ACTION|>", COHERE),
                        ("<|tools_prefix|>", APERTUS), ("<TOOLCALL>", NEMOTRON), ("<tool_calls>", TOOL_CALLS_JSON),
                        ("<|function_call|>", GIGACHAT31)):
        if marker in src:
            return fmt
    if "Action:" in src and "tool_name" in src:
        return COMMAND_R
    if "function call" in src and "<|role_sep|>" in src:
        return GIGACHAT
    if "<function=" in src:
        return QWEN_XML
    if "<tool_call>" in src:
        return HERMES
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "to=functions." in src or ("<|channel|>" in src and "<|call|>" in src):
        return HARMONY
    if "tool▁call▁begin" in src:
        return DEEPSEEK
    if "<|tool_call>" in src:
        return GEMMA4
    if "<|start_header_id|>" in src and ("parameters" in src or "<|python_tag|>" in src):
        return LLAMA3
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
    """The JSON value at the start of ``text`` (after whitespace) and where it ends."""
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    return dec.raw_decode(text, i)


_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.S)


def _split_think(text: str) -> tuple[Optional[str], str]:
    # reasoning models may start inside the think block (the template opened it): "... </think> answer"
    m = _THINK.match(text)
    if m and ("<think>" in text[:m.end()] or "</think>" in text):
        return m.group(1).strip() or None, text[m.end():]
    return None, text


def split_reasoning(text: str) -> tuple[Optional[str], str]:
    """``(reasoning, rest)`` of an answer that thinks first (``<think>...</think>``, or an answer that
    starts inside a think block its template opened); ``(None, text)`` when it does not."""
    if "</think>" not in text:
        return None, text
    return _split_think(text)


def parse(text: str, fmt: ToolCallFormat, names: Optional[Iterable[str]] = None, *,
          reasoning: bool = True) -> Parsed:
    """Content, calls and reasoning of ``text`` in ``fmt``; ``names`` keeps only calls of those tools
    (None: any name). ``reasoning=False`` leaves think blocks in the content (``--reasoning-format none``)."""
    allowed = set(names) if names is not None else None
    think = None
    if reasoning and fmt is not HARMONY and "</think>" in text:
        think, text = _split_think(text)
    parser = _PARSERS[fmt.name]
    content, calls, extra_think = parser(text, fmt)
    kept = [c for c in calls if allowed is None or c["function"]["name"] in allowed]
    if len(kept) != len(calls):
        content, kept = text, []  # a call of a tool not offered is text, as the model wrote it
    if content is not None:
        content = content.strip() or None
    return Parsed(content=content, calls=kept, reasoning=extra_think or think)


# ------------------------------------------------------------------------------------ families
_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _hermes(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    calls = []
    for m in _HERMES_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, [], None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, [], None
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), fmt.id_style))
    return (_HERMES_RE.sub("", text) if calls else text), calls, None


_XML_CALL = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>(?:\s*</tool_call>)?", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _qwen_xml(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
    calls = []
    for m in _XML_CALL.finditer(text):
        args: Any = {}
        body = m.group(2).strip()
        if body.startswith("{"):  # Functionary v3.1: <function=NAME>{json}</function>
            try:
                args = json.loads(body)
            except ValueError:
                return text, [], None
        for p in _XML_PARAM.finditer(m.group(2)):
            raw = p.group(2)
            try:
                args[p.group(1).strip()] = json.loads(raw)
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


_HARMONY_MSG = re.compile(
    r"(?:<\|start\|>assistant)?\s*(?:to=functions\.([A-Za-z0-9_.\-]+)\s*)?<\|channel\|>(\w+)"
    r"(?:\s+to=functions\.([A-Za-z0-9_.\-]+))?[^<]*?(?:<\|constrain\|>\w+)?<\|message\|>(.*?)"
    r"(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)


def _harmony(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, Optional[str]]:
    if "<|channel|>" not in text and "<|message|>" not in text:
        return text, [], None
    calls, thoughts, finals = [], [], []
    for m in _HARMONY_MSG.finditer(text):
        name = m.group(1) or m.group(3)
        channel, body = m.group(2), m.group(4)
        if name:
            try:
                args = json.loads(body)
            except ValueError:
                return text, [], None
            calls.append(_call(name, args, fmt.id_style))
        elif channel == "analysis":
            thoughts.append(body.strip())
        else:
            finals.append(body)
    if not calls and not thoughts and not finals:
        return text, [], None
    return "".join(finals), calls, "\n".join(t for t in thoughts if t) or None


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```"
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
            args = json.loads(raw)
        except ValueError:
            return text, [], None
        calls.append(_call(name.strip(), args, fmt.id_style))
    if not calls:
        return text, [], None
    return text[:j], calls, None


_G4_CALL = re.compile(r"<\|tool_call>call:([A-Za-z0-9_.\-]+)\{")


def _gemma_value(s: str, i: int) -> tuple[Any, int]:
    """One value of Gemma 4's call syntax at ``s[i]``: ``<|"|>text<|"|>``, ``{k:v,...}``, ``[v,...]``,
    or a bare number / true / false / null."""
    q = '<|"|>'
    if s.startswith(q, i):
        end = s.index(q, i + len(q))
        return s[i + len(q):end], end + len(q)
    if s[i] == "{":
        obj: dict[str, Any] = {}
        i += 1
        while s[i] != "}":
            if s.startswith(q, i):
                key, i = _gemma_value(s, i)
            else:
                j = s.index(":", i)
                key, i = s[i:j], j
            if s[i] != ":":
                raise ValueError("expected ':'")
            obj[str(key)], i = _gemma_value(s, i + 1)
            if s[i] == ",":
                i += 1
        return obj, i + 1
    if s[i] == "[":
        arr = []
        i += 1
        while s[i] != "]":
            v, i = _gemma_value(s, i)
            arr.append(v)
            if s[i] == ",":
                i += 1
        return arr, i + 1
    m = re.compile(r"[^,}\]]+").match(s, i)
    if not m:
        raise ValueError("empty value")
    raw = m.group(0).strip()
    return json.loads(raw) if raw in ("true", "false", "null") or re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", raw) \
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
        return json.loads(raw)
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
    rest = re.sub(r"</?[^<>\s]*?(?:function_calls|tool_call)>", "", _spans_out(text, spans))
    return rest, calls, None


_KIMI = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)
_SOLAR = re.compile(r"<\|tool_call:begin\|>[^<]*<\|tool_call:name\|>([^<]+)<\|tool_call:args\|>(.*?)<\|tool_call:end\|>", re.S)
_MINICPM = re.compile(r'<function name="([^"]+)">(.*?)</function>', re.S)
_MINICPM_P = re.compile(r'<param name="([^"]+)">(.*?)</param>', re.S)


def _regex_calls(rx: "re.Pattern[str]", json_args: bool, strip: str):
    def parser(text: str, fmt: ToolCallFormat) -> tuple[Optional[str], list, None]:
        calls, spans = [], []
        for m in rx.finditer(text):
            if json_args:
                try:
                    args = json.loads(m.group(2))
                except ValueError:
                    return text, [], None
            else:
                args = {k: _value(v) for k, v in _MINICPM_P.findall(m.group(2))}
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


_PARSERS = {"glm": _glm, "invoke-xml": _invoke_xml,
            "kimi": _regex_calls(_KIMI, True, r"<\|tool_calls_section_(?:begin|end)\|>"),
            "solar": _regex_calls(_SOLAR, True, r"<\|tool_calls\|>|<\|calls\|>"),
            "minicpm": _regex_calls(_MINICPM, False, ""),
            "cohere": _json_calls, "command-r": _json_calls, "apertus": _json_calls, "nemotron": _json_calls,
            "tool-calls-json": _json_calls, "gigachat": _json_calls, "gigachat31": _json_calls,
            "hermes": _hermes, "qwen-xml": _qwen_xml, "llama3": _llama3, "mistral": _mistral,
            "harmony": _harmony, "deepseek": _deepseek, "gemma4": _gemma4}
