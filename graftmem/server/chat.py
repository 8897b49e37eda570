"""OpenAI ``messages`` as a chat request holds them, made ready for the segment rule of
`graftmem.core.segments`.

What lives here is the request's side: bounds checked before anything renders (`bound_messages`),
``chat_template_kwargs`` checked (`template_kwargs`), each message's role and content checked with 400s
that name it (`message_text`, `template_messages`), tools put where the template wants them, the ids of
segments agents keep re-sending (`TokenCache`), a raw completion prompt cut into chunks (`chunk_prompt`),
and a stored conversation's continuation (`continuation_segments`). Where a conversation is cut into
segments, and why there, is `graftmem.core.segments` (`turn_cut`, `cut_template`, `cut_turns`): the SDK's
chat blocks are cut by the same rule.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Collection, Optional, Sequence

from ..core.prompt import ChatFormat, tokenize_literal
from ..core.segments import NothingRendered, Spans, conversation_day, cut_template, cut_turns, literal_spans
from ..core.template import ChatTemplate, TemplateError, reserved_kwargs
from .http import HTTPError
from .tools import ToolSpec, call_parts, render_calls, render_tool_result, tools_prompt

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.renderpool import RenderPool

__all__ = ["answer_text", "continuation_segments", "message_text", "render_segments", "template_messages",
           "template_segments", "chunk_prompt", "CHUNK_TOKENS", "TokenCache", "bound_messages", "template_kwargs", "MAX_TEMPLATE_KWARGS",
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
    """The request's messages, checked (`message_text`: 400s naming the message), cut into segments by a
    hand-written format (`graftmem.core.segments.cut_turns`). ``tools`` are appended to the first message
    when it is a system one, else put in a system message of their own before it (`graftmem.server.tools`).

    ``untrusted``, ``ends`` and ``joined``, when given, receive `Segmented.spans`, `Segmented.ends` and
    `Segmented.joined` (`graftmem.core.segments.Segmented`)."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", param="messages")
    rendered = [message_text(msg, i) for i, msg in enumerate(messages)]
    if tools is not None:
        if rendered[0][0] in ("system", "developer"):
            rendered[0] = (rendered[0][0], f"{rendered[0][1]}\n\n{tools_prompt(tools)}")
        else:
            rendered.insert(0, ("system", tools_prompt(tools)))
    seg = cut_turns(fmt, rendered, marks, shift=len(rendered) - len(messages), engine=engine)
    if joined is not None:
        joined.append(seg.joined)
    if untrusted is not None:
        untrusted.extend(seg.spans)
    if ends is not None:
        ends.extend(seg.ends)
    return seg.texts


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


def template_segments(engine: "Engine", tpl: ChatTemplate, messages: Any, tools: Optional[ToolSpec] = None,
                      kwargs: Optional[dict[str, Any]] = None, ends: Optional[list[int]] = None,
                      marks: Collection[int] = (), joined: Optional[list[bool]] = None,
                      pool: Optional["RenderPool"] = None) -> tuple[list[str], list[str], list[Spans]]:
    """A request's messages, checked (`template_messages`: 400s naming the message), rendered by the
    model's own template and cut into segments by `graftmem.core.segments.cut_template` (where, and why
    there, is said there); the texts, the notes on cuts not made (and on substitutions), and per segment
    the spans of untrusted text to tokenize as text. A template that refuses the messages is a 400.

    ``ends``, when given, receives per message of ``messages`` how many characters of the prompt its
    render up to that message accounts for (where ``render(messages[:k])`` stops agreeing with the
    whole): an Anthropic ``cache_control`` breakpoint on message k is the last cut at or before it.
    ``joined``, when given, receives whether the generation header joined the last turn (`_header_cuts`:
    the last segment is then its last token) rather than being a segment of its own. ``pool``: where the
    template runs (the server's render processes, `graftmem.core.renderpool`; None: this thread).
    """
    msgs = template_messages(messages)
    now = conversation_day(tpl, msgs)
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
        seg = cut_template(engine, tpl, msgs, tool_list, kwargs, marks, shift=len(msgs) - len(messages), now=now,
                           pool=pool)
    except NothingRendered:
        raise HTTPError(400, "the model's chat template rendered these messages as nothing", param="messages") from None
    except TemplateError as exc:
        raise HTTPError(400, f"the model's chat template refused these messages: {exc}", param="messages",
                        code="template_error") from exc
    notes = seg.notes
    if tools is not None and not tpl.uses_tools:  # a substitution is said where it happens (docs/models.md)
        notes.insert(0, "tools: the model's template renders no tools; graftmem's Hermes tool text is in the system message")
    if ends is not None:
        ends.extend(seg.ends)
    if joined is not None:
        joined.append(seg.joined)
    return seg.texts, notes, seg.spans


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
