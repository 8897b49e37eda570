"""OpenAI ``messages`` rendered with the model's chat template, as *segments* of token ids.

A segment is what a turn adds (``<|im_start|>role\\n...<|im_end|>\\n`` in ChatML per message: the system prompt, then
each assistant message with the tool results and user message after it, `turn_cut`); the header of the
assistant's turn ends the last turn but for its last token (a one-token segment) where the template renders
a past assistant turn with it verbatim (`_header_cuts`), else it is a segment of its own. A cut falls before
a special token (the seam argument of `graftmem.core.prompt`) or, after a header, where the ids of the text
on both sides were compared with those of the text whole, so tokenizing the segments one by one gives the
ids of tokenizing the whole prompt.

Why segments and not one token list: the server prefills a prompt one segment per ``prefill`` call,
cache or no cache. The K/V bytes of a token depend on how the prompt was cut into prefill calls (a
token's row position inside a micro-batch changes the kernels' rounding; ``graftmem.store.chain``
has the measurement), so byte-exactness holds between two computations that cut the prompt at the
same places. A conversation prefix is learned as a chain of one block per segment, whose state is
exactly the state of prefilling those segments call by call; a request that grafts it and prefills
its remaining segments computes the same bytes as a request served cold.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Collection, Optional, Sequence

from ..core.prompt import ChatFormat, has_special_text, seam_before, tokenize_literal
from ..core.template import ChatTemplate, TemplateError, reserved_kwargs, today
from .http import HTTPError
from .tools import ToolSpec, call_parts, render_calls, render_tool_result, tools_prompt

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.renderpool import RenderPool

__all__ = ["turn_cut", "answer_text", "continuation_segments", "literal_spans", "message_text", "render_segments", "template_messages", "template_segments", "tokenize_segments",
           "chunk_prompt", "CHUNK_TOKENS", "TokenCache", "bound_messages", "template_kwargs", "MAX_TEMPLATE_KWARGS",
           "MAX_TEMPLATE_KWARGS_BYTES"]

#: A raw prompt (``/v1/completions``) is cut into segments of about this many tokens.
CHUNK_TOKENS = 256


def bound_messages(messages: Any, max_messages: int, max_parts: int, *, param: str = "messages",
                   why: str = "") -> None:
    """A 400 naming ``param`` and the limit when a request holds more than ``max_messages`` messages (or
    input items), or one of them more than ``max_parts`` content parts or tool calls: checked first, in
    time linear in the number of messages, before anything renders or tokenizes them. Why first: the cuts
    between turns are found by rendering each prefix of the conversation (`template_segments`: quadratic in
    the messages), so 4,000 messages saying "hi" took 34 s to reach the context's 400, and 100,000 had no
    answer after 600 s. ``why`` says where the limit comes from. What is not a list is left to the renderer's checks."""
    if not isinstance(messages, list):
        return
    if len(messages) > max_messages:
        raise HTTPError(400, f"{param} holds {len(messages)} messages, over this server's limit of {max_messages}"
                        f"{why}", param=param, code="too_many_messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        for key in ("content", "tool_calls", "output"):
            parts = m.get(key)
            if isinstance(parts, list) and len(parts) > max_parts:
                raise HTTPError(400, f"{param}[{i}].{key} holds {len(parts)} entries, over this server's limit of "
                                f"{max_parts} per message", param=f"{param}[{i}].{key}", code="too_many_parts")


#: ``chat_template_kwargs`` may hold at most this many names...
MAX_TEMPLATE_KWARGS = 32
#: ...and this many bytes of JSON in all (``enable_thinking``, ``reasoning_effort``: a few bytes each).
MAX_TEMPLATE_KWARGS_BYTES = 64 << 10

_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def template_kwargs(raw: Any, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's ``chat_template_kwargs``, checked before the render sees them (400 naming
    ``chat_template_kwargs.<key>``): an object of at most `MAX_TEMPLATE_KWARGS` names, each an identifier the
    template can read and none the render sets itself (`graftmem.core.template.reserved_kwargs`:
    ``messages`` replaced the conversation, ``tools`` / ``add_generation_prompt`` collided with the
    render's arguments, a 500), each value JSON (strings, numbers, booleans, null, lists, objects), at most
    `MAX_TEMPLATE_KWARGS_BYTES` in all."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise HTTPError(400, f"{param} must be an object such as {{\"enable_thinking\": false}}", param=param,
                        code="invalid_value")
    if len(raw) > MAX_TEMPLATE_KWARGS:
        raise HTTPError(400, f"{param} holds {len(raw)} names, over the limit of {MAX_TEMPLATE_KWARGS}", param=param,
                        code="invalid_value")
    reserved = reserved_kwargs()
    size = 0
    for key, value in raw.items():
        at = f"{param}.{str(key)[:64]}"
        if not isinstance(key, str) or not _KWARG_NAME.fullmatch(key):
            raise HTTPError(400, f"{at}: a template variable's name is letters, digits and _ (up to 64, not "
                            "starting with a digit)", param=at, code="invalid_value")
        if key in reserved:
            raise HTTPError(400, f"{at}: {key!r} is set by the render itself (it may not be one of "
                            f"{', '.join(sorted(reserved))})", param=at, code="invalid_value")
        try:
            size += len(json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8"))
        except (TypeError, ValueError, RecursionError) as exc:
            raise HTTPError(400, f"{at} must be JSON (strings, numbers, booleans, null, lists, objects; no NaN, "
                            f"no lone surrogates): {exc}", param=at, code="invalid_value") from None
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise HTTPError(400, f"{param} is over {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON", param=param,
                            code="invalid_value")
    return dict(raw)


def turn_cut(roles: Sequence[Any], k: int, marks: Collection[int] = ()) -> bool:
    """Whether a chat prompt is cut into a new segment after its first ``k`` messages (``roles``: each
    message's role). Cuts fall where a later request can resume: after the leading system / developer
    messages (the prompt every conversation of an agent shares), before each assistant message (where
    the previous request's prompt ended: the cells it left are this request's start), after the last
    message (before the generation header), and after each prefix the client marked (``marks``:
    Anthropic's ``cache_control``). A user or tool message followed by another user or tool message,
    and an assistant message with the results that follow it, are one segment: one prefill call instead
    of one per message. Why that matters: a few tokens in a call of their own cost almost what a call
    of many does on a CPU (bench/call_split.py, in docs/benchmarks.md: after 2,500 cached SmolLM2
    tokens, one thread, 124 new ones in one call took 2.3 s, in four calls 5.3 s), and every cut is a
    call in every request, cold or not, since the cuts are what make a graft's bytes equal to a cold
    prefill's. `_header_cuts` then moves the cuts around the assistant's header."""
    n = len(roles)
    if k >= n or k in marks:
        return True
    system = ("system", "developer")
    if roles[k] == "assistant":
        return True
    return roles[k] not in system and all(r in system for r in roles[:k])


def message_text(msg: Any, i: int) -> tuple[str, str]:
    """The role and the text of message ``i`` (content as a string or a list of text parts)."""
    if not isinstance(msg, dict):
        raise HTTPError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
    role = msg.get("role")
    if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant", "tool"):
        raise HTTPError(400, f"messages[{i}].role must be system, developer, user, assistant or tool, "
                        f"got {role!r}", param=f"messages[{i}].role")
    content = _text_content(msg, i)
    if msg.get("tool_calls"):
        if role != "assistant":
            raise HTTPError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                            param=f"messages[{i}].tool_calls")
        calls = render_calls(msg["tool_calls"], i)
        content = f"{content}\n{calls}" if content else calls
    if role == "tool":
        content = render_tool_result(content)
    return role, content


def render_segments(fmt: ChatFormat, messages: Any, tools: Optional[ToolSpec] = None,
                    untrusted: Optional[list[Spans]] = None, ends: Optional[list[int]] = None,
                    marks: Collection[int] = (), engine: Optional["Engine"] = None,
                    joined: Optional[list[bool]] = None) -> list[str]:
    """The prompt's segments: the messages cut where `turn_cut` says (``marks`` too), then the
    assistant's header. With ``engine``, the header but its last token goes with what precedes it where
    the text after the cut tokenizes apart (as `template_segments` does, `_header_cuts`); ``joined``
    receives whether the generation header joined the last turn. ``tools`` are appended to
    the first message when it is a system one, else put in a system message of their own before it
    (`graftmem.server.tools`).

    ``untrusted``, when given, receives per segment the character span of the message's text if it
    is a user or tool message (what `literal_spans` narrows to those that spell a special token): the
    hand-written formats keep untrusted text as text too, as the model templates do (`template_segments`).
    ``ends``, when given, receives per message the length in characters of the prompt up to its end
    (`template_segments` has the same)."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", param="messages")
    rendered = [message_text(msg, i) for i, msg in enumerate(messages)]
    roles = [msg.get("role") if isinstance(msg, dict) else None for msg in messages]
    if tools is not None:
        if rendered[0][0] in ("system", "developer"):
            rendered[0] = (rendered[0][0], f"{rendered[0][1]}\n\n{tools_prompt(tools)}")
        else:
            rendered.insert(0, ("system", tools_prompt(tools)))
            roles.insert(0, "system")
    parts: list[str] = []
    spans: list[Spans] = []
    for (role, text), sent_as in zip(rendered, roles):
        if fmt.name == "gemma":  # no system role: its own template folds it into a user turn
            role = {"system": "user", "developer": "user", "assistant": "model", "tool": "user"}[role] \
                if role != "user" else role
        elif role == "developer":
            role = "system"
        head = fmt.task_head.replace("user", role, 1)
        parts.append(f"{head}{text}{fmt.block_tail}")
        spans.append([(len(head), len(head) + len(text))] if sent_as in ("user", "tool") and text else [])
    shift = len(parts) - len(messages)  # a system message of tools put before the first one
    if ends is not None:
        ends.extend(sum(map(len, parts[:k + shift])) for k in range(1, len(messages) + 1))
    shifted = {k + shift for k in marks}
    header = fmt.task_tail[len(fmt.block_tail):]  # the assistant's header
    full = "".join(parts) + header
    offs = [0, *itertools.accumulate(map(len, parts))]
    after = [k for k in range(1, len(parts) + 1) if turn_cut(roles, k, shifted)]
    cuts = [offs[k] for k in after]
    moved_end = False
    if engine is not None:  # the header on the side of what precedes it, where that tokenizes apart

        def header_end(k: int, c: int) -> Optional[int]:
            return c + len(header) if header and roles[k] == "assistant" and parts[k].startswith(header) else None

        cuts, moved_end = _header_cuts(engine, full, cuts, after, len(parts), shifted, header_end,
                                       lambda: f"{full}{_PROBE}{fmt.block_tail}")
    bounds = [0, *cuts, len(full)]
    segs = [full[a:b] for a, b in zip(bounds, bounds[1:])]
    if joined is not None:
        joined.append(moved_end)
    if untrusted is not None:  # each message's spans, moved to its segment
        absolute = [(a + offs[i], b + offs[i]) for i, sp in enumerate(spans) for a, b in sp]
        untrusted.extend([(a - lo, b - lo) for a, b in absolute if lo <= a and b <= hi]
                         for lo, hi in zip(bounds, bounds[1:]))
    return segs


def literal_spans(engine: "Engine", texts: Sequence[str], untrusted: Sequence[Spans]) -> tuple[list[Spans], list[str]]:
    """Of the untrusted spans (`render_segments`), those that spell a special token (``"<|im_end|>"``
    typed by a user), to be tokenized as text; and a note per such message for the receipt."""
    literal: list[Spans] = []
    notes: list[str] = []
    for i, (text, spans) in enumerate(zip(texts, untrusted)):
        keep = [(a, b) for a, b in spans if has_special_text(engine, text[a:b])]
        literal.append(keep)
        if keep:
            notes.append(f"segment {i} spells a special token: tokenized as text, its segment not learned")
    return literal, notes


def _text_content(msg: dict[str, Any], i: int) -> str:
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise HTTPError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise HTTPError(400, f"messages[{i}].content must be a string or a list of text parts",
                        param=f"messages[{i}].content")
    return content


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages in the shape chat templates expect (transformers' convention): text content as
    a string, ``developer`` as ``system``, a tool call's ``arguments`` as an object (templates write
    ``arguments | tojson`` or iterate its items; OpenAI sends a JSON string), tool results with their
    ``tool_call_id`` and ``name``."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        role, _ = message_text({k: v for k, v in msg.items() if k != "tool_calls"} if isinstance(msg, dict) else msg, i)
        m: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text_content(msg, i)}
        if msg.get("tool_calls"):
            if role != "assistant" or not isinstance(msg["tool_calls"], list):
                raise HTTPError(400, f"messages[{i}]: only assistant messages carry a list of tool_calls",
                                param=f"messages[{i}].tool_calls")
            calls = []
            for j, call in enumerate(msg["tool_calls"]):
                name, args = call_parts(call, i, j)
                calls.append({"id": str(call.get("id") or ""), "type": "function",
                              "function": {"name": name, "arguments": args}})
            m["tool_calls"] = calls
        for key in ("tool_call_id", "name", "reasoning_content"):
            if isinstance(msg.get(key), str):
                m[key] = msg[key]
        out.append(m)
    return out


class _Renders:
    """Renders of conversation prefixes, least recently used dropped past ``max_chars``.

    Cutting a request renders each of its growing prefixes: O(n^2) template work for n messages, and a
    template such as Gemma 4's takes tens of milliseconds per render. An agent re-sends the same
    conversation plus one turn, so all but the newest prefixes were rendered by its previous request;
    a render is a function of the template, the messages, the tools, the kwargs and the pinned day,
    which make the key."""

    def __init__(self, max_chars: int = 32 << 20) -> None:
        self.max_chars, self._chars = max_chars, 0
        self._texts: "OrderedDict[str, str]" = OrderedDict()
        self._lock = threading.Lock()

    def render(self, tpl: ChatTemplate, msgs: list[dict[str, Any]], tools: Any, kw: dict[str, Any],
               gen: bool, pool: Optional["RenderPool"] = None) -> str:
        """The render, from the cache or made now: in ``pool``'s processes when given (the server's:
        `graftmem.core.renderpool`), else in this thread."""
        key = hashlib.sha256(json.dumps([tpl.digest, tpl.bos_token, tpl.eos_token, tpl.strip_bos, msgs, tools,
                                         kw, gen], sort_keys=True, default=str).encode()).hexdigest()
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
                return text
        if pool is not None:
            text = pool.render(tpl, msgs, add_generation_prompt=gen, tools=tools, **kw)
        else:
            text = tpl.render(msgs, add_generation_prompt=gen, tools=tools, **kw)
        with self._lock:
            if key not in self._texts and len(text) <= self.max_chars:
                self._texts[key] = text
                self._chars += len(text)
            while self._chars > self.max_chars:
                _, old = self._texts.popitem(last=False)
                self._chars -= len(old)
        return text


_RENDERS = _Renders()


class _Days:
    """The day a conversation was first rendered, per template and first message: a template that prints
    today's date (GPT-OSS, Llama 3.2) then renders a conversation's prefix the same way tomorrow, so its
    stored prefix keeps matching (the date the model sees stays the conversation's first day). Kept in
    memory, bounded; after a restart a conversation is pinned anew, which costs a cold prefill, never
    exactness."""

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._days: "OrderedDict[str, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def day(self, tpl: ChatTemplate, msgs: list[dict[str, Any]]) -> Any:
        if "strftime_now" not in tpl.source:
            return today()
        key = hashlib.sha256(json.dumps([tpl.digest, msgs[:1]], sort_keys=True, default=str).encode()).hexdigest()
        with self._lock:
            d = self._days.get(key)
            if d is None:
                d = self._days[key] = today()
                while len(self._days) > self.max_entries:
                    self._days.popitem(last=False)
            else:
                self._days.move_to_end(key)
            return d


_DAYS = _Days()


Spans = list[tuple[int, int]]


def template_segments(engine: "Engine", tpl: ChatTemplate, messages: Any, tools: Optional[ToolSpec] = None,
                      kwargs: Optional[dict[str, Any]] = None, ends: Optional[list[int]] = None,
                      marks: Collection[int] = (), joined: Optional[list[bool]] = None,
                      pool: Optional["RenderPool"] = None) -> tuple[list[str], list[str], list[Spans]]:
    """A request rendered by the model's own template, cut after the messages where `turn_cut` says
    (and after each prefix in ``marks``) where the template allows it, and why it did not where it
    does not.

    The whole prompt is ``render(messages, add_generation_prompt=True)``, always: the cut never changes
    what is prefilled. A cut after message k is placed where ``render(messages[:k])`` stops agreeing
    with the whole prompt (its end, for the 57 of 70 templates that extend cleanly), moved back to the
    last special-token seam that tokenizes apart (`graftmem.core.prompt.clean_seam`). A template that
    re-renders a message once another follows (Phi-3.5's EOS, Qwen3's empty think block, reasoning
    dropped at a new user turn) thus gives a shorter stable prefix, and the note says which message.

    Untrusted text stays text: the third result holds, per segment, the character spans of user and
    tool messages that spell a special token (``"<|eot_id|>"`` typed by a user); `tokenize_segments`
    tokenizes them without special-token parsing (`graftmem.core.prompt.tokenize_literal`), while the
    template's own markers stay special. No cut falls inside such a span.

    ``ends``, when given, receives per message of ``messages`` how many characters of the prompt its
    render up to that message accounts for (where ``render(messages[:k])`` stops agreeing with the
    whole): an Anthropic ``cache_control`` breakpoint on message k is the last cut at or before it.
    ``joined``, when given, receives whether the generation header joined the last turn (`_header_cuts`:
    the last segment is then its last token) rather than being a segment of its own. ``pool``: where the
    template runs (the server's render processes, `graftmem.core.renderpool`; None: this thread).
    """
    msgs = template_messages(messages)
    kw = {**dict(kwargs or {}), "now": _DAYS.day(tpl, msgs)}
    tool_list = None
    if tools is not None:
        if tpl.uses_tools:
            tool_list = [{"type": "function", "function": f} for f in tools.functions]
        else:  # the template renders no tools: graftmem's Hermes tool text in the system message
            if msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{tools_prompt(tools)}"}
            else:
                msgs.insert(0, {"role": "system", "content": tools_prompt(tools)})
    try:
        full = _RENDERS.render(tpl, msgs, tool_list, kw, True, pool)
    except TemplateError as exc:
        raise HTTPError(400, f"the model's chat template refused these messages: {exc}", param="messages",
                        code="template_error") from exc
    if not full:
        raise HTTPError(400, "the model's chat template rendered these messages as nothing", param="messages")
    cuts: list[int] = []
    after: list[int] = []  # per cut: the messages before it
    notes: list[str] = []
    if tools is not None and not tpl.uses_tools:  # a substitution is said where it happens (docs/models.md)
        notes.append("tools: the model's template renders no tools; graftmem's Hermes tool text is in the system message")
    agreed = [0]  # per prefix of msgs: the characters of the whole prompt its render accounts for
    roles = [m.get("role") for m in msgs]
    shifted = {k + len(msgs) - len(messages) for k in marks}  # a system message of tools put first
    for k in range(1, len(msgs) + 1):
        try:
            part = _RENDERS.render(tpl, msgs[:k], tool_list, kw, False, pool)
        except TemplateError as exc:
            notes.append(f"messages[:{k}] do not render on their own ({exc}): no cut after message {k - 1}")
            agreed.append(agreed[-1])
            continue
        agree = len(part) if full.startswith(part) else \
            next(i for i, (a, b) in enumerate(zip(part, full)) if a != b)
        agreed.append(agree)
        if agree < len(part):
            notes.append(f"message {k - 1} renders differently once more follows: cut moved back")
        lo = cuts[-1] + 1 if cuts else 1
        if agree < lo or not turn_cut(roles, k, shifted):
            continue
        c = seam_before(engine, full, agree, lo, check=False)  # the caller checks all cuts' ids at once
        if c is not None and c < len(full):
            cuts.append(c)
            after.append(k)
    def header_end(k: int, c: int) -> Optional[int]:
        if msgs[k].get("role") != "assistant":
            return None
        head = _RENDERS.render(tpl, msgs[:k], tool_list, kw, True, pool)
        return len(head) if full.startswith(head) else None

    def probe() -> str:
        try:
            return _RENDERS.render(tpl, [*msgs, {"role": "assistant", "content": _PROBE}], tool_list, kw, False, pool)
        except TemplateError:
            return ""

    cuts, moved_end = _header_cuts(engine, full, cuts, after, len(msgs), shifted, header_end, probe)
    if joined is not None:
        joined.append(moved_end)
    spans: Spans = []
    at = 0
    for i, m in enumerate(msgs):
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            continue
        j = full.find(content, at)
        if j < 0:  # the template trims content (Llama 3.x): look for the trimmed text
            content = content.strip()
            j = full.find(content, at)
        if m["role"] not in ("user", "tool") or not has_special_text(engine, content):
            at = j + len(content) if j >= 0 else at
            continue
        if j < 0:
            notes.append(f"message {i} spells a special token but is not verbatim in the render: parsed as is")
            continue
        spans.append((j, j + len(content)))
        at = j + len(content)
        notes.append(f"message {i} spells a special token: tokenized as text, its segment not learned")
    cuts = [c for c in cuts if not any(a < c < b for a, b in spans)]
    if ends is not None:
        shift = len(msgs) - len(messages)  # a system message of tools put before the first one
        ends.extend(agreed[k + shift] for k in range(1, len(messages) + 1))
    bounds = [0, *cuts, len(full)]
    literal = [[(max(a, lo) - lo, min(b, hi) - lo) for a, b in spans if a < hi and b > lo]
               for lo, hi in zip(bounds, bounds[1:])]
    return [full[a:b] for a, b in zip(bounds, bounds[1:])], notes, literal


#: The content of the assistant turn a template is asked to render after a prompt (`_header_cuts`).
_PROBE = "OK, here it is."


def _header_cuts(engine: "Engine", full: str, cuts: list[int], after: list[int], n: int, marks: Collection[int],
                 header_end: Callable[[int, int], Optional[int]], probe: Callable[[], str]) -> tuple[list[int], bool]:
    """``cuts`` (after ``after[i]`` of the ``n`` messages) with the assistant's header on the side of what
    precedes it, but for its last token, where the prompt allows it; and whether the cut before the
    generation header moved (the header joined the last turn). A cut before an assistant message moves
    to just before the last token of its header (``header_end(k, cut)``: where that header ends in
    ``full``, None where the assistant message does not start with the generation prompt verbatim); the
    cut before the generation header moves the same way if an assistant turn after the prompt
    (``probe()``: the prompt rendered with one more, short, assistant message) starts with it, so that
    the next request of the conversation can cut there too. Both render paths (`template_segments`,
    `render_segments`) cut through this one function.

    Why: a turn is then one prefill call of its new messages and header plus a one-token call, where it
    was one call per message and one for the header; a later request resumes at the same place (what
    ``render(messages[:k], add_generation_prompt=True)`` gave the earlier request is, verbatim, where its
    assistant message starts); and a prompt replayed after a restart grafts everything but that one
    token (the learned chain ends there), as llama-server's slot re-evaluates one token. The last token
    stays apart because decoding starts from its call's logits, which are not part of llama.cpp's state:
    the last segment of a prompt is never grafted. Where a past assistant turn does not start with the
    generation prompt (a template that opens a think block there), where the header's last token is
    not a plain suffix of its text, or where the text after a cut would tokenize otherwise on its own (a
    SentencePiece vocabulary adds a space before a call's first word: the ids are compared), the cut
    stays before the header and the header is its own segment, as before. Marked cuts stay where they are."""
    out: list[int] = []
    for j, (c, k) in enumerate(zip(cuts, after)):
        nxt = cuts[j + 1] if j + 1 < len(cuts) else len(full)
        h: Optional[int] = None
        if k in marks:
            pass
        elif k < n:
            end = header_end(k, c)
            h = _before_last_token(engine, full[:end], c) if end is not None else None
            if h is not None and not (c < h < nxt and _apart(engine, full, c, h, nxt)):
                h = None
        else:  # the generation header
            h = _before_last_token(engine, full, c)
            after_prompt = probe() if h is not None else ""
            if h is not None and not (after_prompt.startswith(full) and len(after_prompt) > len(full)
                                      and _apart(engine, full, c, h, len(full))
                                      and _apart(engine, after_prompt, c, h, len(after_prompt))):
                h = None
        out.append(c if h is None else h)
    return out, bool(after) and after[-1] == n and out[-1] != cuts[-1]


def _before_last_token(engine: "Engine", text: str, a: int) -> Optional[int]:
    """Where the last token of ``text[a:]`` (a header) starts in ``text``: None if it is the only one, a
    control token (no text) or not a plain suffix of the text."""
    ids = engine.tokenize(text[a:], add_special=False)
    if len(ids) < 2:
        return None
    try:
        piece = engine.piece(ids[-1]).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not piece or not text.endswith(piece) or len(text) - len(piece) <= a:
        return None
    return len(text) - len(piece)


def _apart(engine: "Engine", text: str, a: int, cut: int, b: int) -> bool:
    """Whether ``text[a:b]`` tokenizes as ``text[a:cut]`` and ``text[cut:b]`` do apart (no BOS)."""
    return engine.tokenize(text[a:b], add_special=False) == \
        engine.tokenize(text[a:cut], add_special=False) + engine.tokenize(text[cut:b], add_special=False)


def answer_text(engine: "Engine", tokens: Sequence[int]) -> str:
    """Generated tokens as text, control tokens written out (``engine.piece`` leaves them empty): what
    a family's tool-call parser needs to see its markers."""
    out = bytearray()
    for t in tokens:
        if engine.is_eog(t):
            break
        out += engine.token_text(t).encode() if engine.is_control(t) else engine.piece(t)
    return out.decode("utf-8", "replace")


class TokenCache:
    """Token ids of recently seen segment texts, least recently used dropped past ``max_chars``.

    An agent re-sends its system prompt, tools and conversation on every call; tokenizing those
    ~3,000 tokens again was the event loop's largest cost per request (8 ms of a 15 ms request path,
    measured with py-spy). The ids of a text are a function of the text and the model's vocabulary, so
    a cache per engine's model returns exactly what tokenizing would."""

    def __init__(self, max_chars: int = 32 << 20) -> None:
        self.max_chars = max_chars
        self._ids: "OrderedDict[tuple[str, bool], list[int]]" = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def tokenize(self, engine: "Engine", text: str, add_special: bool) -> list[int]:
        key = (text, add_special)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                return list(ids)
        ids = engine.tokenize(text, add_special=add_special)
        if len(text) <= self.max_chars:
            with self._lock:
                if key not in self._ids:
                    self._ids[key] = list(ids)
                    self._chars += len(text)
                while self._chars > self.max_chars:
                    (old, _), _ = self._ids.popitem(last=False)
                    self._chars -= len(old)
        return ids


def tokenize_segments(engine: "Engine", segs: Sequence[str], cache: Optional[TokenCache] = None,
                      literal: Optional[Sequence[Spans]] = None) -> list[list[int]]:
    """Token ids per segment: the first with the model's BOS, the others without; a segment with
    ``literal`` spans has them tokenized as text (`template_segments`), never from the cache."""
    if literal is not None and any(literal):
        return [tokenize_literal(engine, s, literal[i], add_special=i == 0) if literal[i] else
                (cache.tokenize(engine, s, i == 0) if cache is not None else engine.tokenize(s, add_special=i == 0))
                for i, s in enumerate(segs)]
    if cache is None:
        return [engine.tokenize(s, add_special=i == 0) for i, s in enumerate(segs)]
    return [cache.tokenize(engine, s, i == 0) for i, s in enumerate(segs)]


def chunk_prompt(engine: "Engine", prompt: str, size: int = CHUNK_TOKENS, slack: int = 32) -> tuple[list[list[int]], list[str]]:
    """A raw prompt's token ids cut into segments of ``size`` tokens or a little more, and their texts.

    A completion prompt has no messages to cut at, so it is cut by token count, where the cut is clean:
    the segment's text (its tokens detokenized) tokenizes back to exactly its tokens, so each learned
    block's text and tokens stay bound (what an import checks). A cut is searched in the ``slack``
    tokens after each ``size``; without a clean one, the rest of the prompt is one segment. Every cut
    depends only on the ids before it, so two prompts that share a prefix share its segments, which is
    what the prefix cache matches on; and the prompt is prefilled one segment per call, cached or not
    (the exactness argument of this module)."""
    ids = engine.tokenize(prompt, add_special=True)
    segs: list[list[int]] = []
    texts: list[str] = []
    start = 0
    while len(ids) - start > size:
        cut = None
        for end in range(start + size, min(start + size + slack, len(ids))):
            text = engine.detokenize(ids[start:end])
            if engine.tokenize(text, add_special=start == 0) == ids[start:end]:
                cut = end
                break
        if cut is None:
            break
        segs.append(ids[start:cut])
        texts.append(text)
        start = cut
    segs.append(ids[start:])
    texts.append(engine.detokenize(ids[start:]))
    return segs, texts


#: What stands for an earlier assistant answer when a continuation is rendered (`continuation_segments`).
_SENTINEL = "GRAFTMEMTURNEND7f3a"


def continuation_segments(engine: "Engine", tpl: Optional[ChatTemplate], fmt: Optional[ChatFormat],
                          system: Optional[str], messages: list[dict[str, Any]], tools: Optional[ToolSpec] = None,
                          kwargs: Optional[dict[str, Any]] = None,
                          cache: Optional[TokenCache] = None,
                          pool: Optional["RenderPool"] = None) -> tuple[list[str], list[list[int]]]:
    """What follows an assistant answer whose tokens are already in the cells, up to the next
    assistant header: the end of that turn as the template puts it after an assistant message (its
    end-of-turn token(s)), then ``messages`` (the new turn: user text, tool results) and the
    generation header, as segments of token ids without BOS.

    Why rendered around a stand-in: the answer itself is never rendered again (its generated tokens are
    what the cells hold; a template that drops earlier reasoning or re-renders a message once another
    follows would give other tokens). The conversation ``system``, a user turn, an assistant turn whose
    content is a sentinel, then ``messages`` is rendered by the same code as any chat request
    (`template_segments` / `render_segments`: untrusted text stays text), and everything after the
    sentinel is the continuation, cut where that render cuts it."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}, *messages]
    if tpl is not None:
        texts, _, literal = template_segments(engine, tpl, msgs, tools, kwargs, pool=pool)
    else:
        assert fmt is not None
        untrusted: list[Spans] = []
        texts = render_segments(fmt, msgs, tools, untrusted, engine=engine)
        literal, _ = literal_spans(engine, texts, untrusted)
    full = "".join(texts)
    at = full.find(_SENTINEL)
    if at < 0 or full.find(_SENTINEL, at + 1) >= 0:
        raise HTTPError(400, "the model's chat template does not render an assistant answer verbatim: this "
                        "conversation cannot be continued from its stored state", param="previous_response_id",
                        code="template_error")
    at += len(_SENTINEL)
    out_texts: list[str] = []
    out_spans: list[Spans] = []
    lo = 0
    for text, spans in zip(texts, literal):
        hi = lo + len(text)
        if hi > at:
            cut = max(0, at - lo)
            if text[cut:]:
                out_texts.append(text[cut:])
                out_spans.append([(max(a, cut) - cut, b - cut) for a, b in spans if b > cut])
        lo = hi
    segments = [tokenize_literal(engine, t, s, add_special=False) if s else
                (cache.tokenize(engine, t, False) if cache is not None else engine.tokenize(t, add_special=False))
                for t, s in zip(out_texts, out_spans)]
    keep = [i for i, s in enumerate(segments) if s]
    return [out_texts[i] for i in keep], [segments[i] for i in keep]
