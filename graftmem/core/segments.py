"""Chat messages as *segments*: the one rule, used by the SDK and the server alike.

A segment is a run of a prompt's tokens prefilled in one call; its boundaries are the seams where a
prompt may be cached and resumed. How a list of messages becomes those segments is decided here, once:

* which text renders a conversation (`request_template`: the model's own chat template, unless a
  hand-written format of `graftmem.core.prompt` renders exactly what it renders; `detect_format`: the
  format of the SDK's chat blocks);
* where a conversation is cut (`turn_cut`: after the leading system messages, before each assistant
  message, after the last one; `cut_template` / `cut_turns` then place each cut at a special-token seam
  and move the assistant's header to the side of what precedes it, `_header_cuts`);
* how the segments become ids (`tokenize_segments`: untrusted text spelling a special token stays text,
  `literal_spans`; `tokenize_cut`: a prompt whose cuts do not tokenize apart is one segment).

The SDK's block/task split of a template (`template_format`: the manual is a system turn, the task the
rest) is the cut this rule makes after the system message of ``[system, user]``, so a chat block learned
with the SDK holds exactly the ids the server's first segment of the same conversation holds.

Why segments and not one token list: the K/V bytes of a token depend on how the prompt was cut into
prefill calls (a token's row position inside a micro-batch changes the kernels' rounding;
``graftmem.store.chain`` has the measurement), so byte-exactness holds between two computations that cut
the prompt at the same places. A conversation prefix is learned as a chain of one block per segment,
whose state is exactly the state of prefilling those segments call by call; a request that grafts it
and prefills its remaining segments computes the same bytes as a request served cold.

What a request may hold (sizes, JSON shapes, roles as HTTP errors) is the server's business
(`graftmem.server.chat`); the functions here take messages already checked.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Optional, Protocol, Sequence

from .errors import ConfigError
from .prompt import (FORMATS, ChatFormat, clean_seam, has_special_text, seam_before, tokenize_literal)
from .template import ChatTemplate, TemplateError, load_template, model_template, today

if TYPE_CHECKING:
    from .engine import Engine
    from .renderpool import RenderPool

__all__ = ["Spans", "Segmented", "NothingRendered", "turn_cut", "cut_template", "cut_turns", "conversation_day",
           "literal_spans", "tokenize_segments", "tokenize_cut", "template_format", "chat_block", "detect_format",
           "request_template", "renders_as_template", "no_format_reason"]

log = logging.getLogger("graftmem")

#: Character spans of a segment's text (``[(start, end)]``).
Spans = list[tuple[int, int]]


class NothingRendered(TemplateError):
    """The template rendered a conversation as the empty string."""


@dataclass
class Segmented:
    """A conversation cut into segments (`cut_template`, `cut_turns`).

    ``texts`` joined are the whole prompt, generation header included; ``spans`` per segment are the
    character spans to tokenize as text (`cut_template`: user and tool text spelling a special token) or
    that may need it (`cut_turns`: every user and tool text; `literal_spans` narrows them); ``ends`` per
    message of the caller's how many characters of the prompt its render accounts for; ``joined`` whether
    the generation header joined the last turn (its last token the last segment, `_header_cuts`);
    ``after`` per cut how many messages precede it; ``notes`` why a cut was not made where `turn_cut`
    wanted one."""

    texts: list[str]
    spans: list[Spans]
    ends: list[int] = field(default_factory=list)
    joined: bool = False
    after: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class TokenSource(Protocol):
    """Where segment ids come from: ``tokenize(engine, text, add_special)`` (a cache of them, or the engine)."""

    def tokenize(self, engine: "Engine", text: str, add_special: bool) -> list[int]: ...


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



def conversation_day(tpl: ChatTemplate, msgs: list[dict[str, Any]]) -> Any:
    """The day ``msgs`` render with (`_Days`): today, or the day their first message was first rendered
    by a template that prints the date."""
    return _DAYS.day(tpl, msgs)


def cut_template(engine: "Engine", tpl: ChatTemplate, msgs: list[dict[str, Any]], tools: Optional[list[Any]] = None,
                 kwargs: Optional[dict[str, Any]] = None, marks: Collection[int] = (), *, shift: int = 0,
                 now: Any = None, pool: Optional["RenderPool"] = None) -> Segmented:
    """``msgs`` (in the shape chat templates expect) rendered by the model's own template, cut after the
    messages where `turn_cut` says (and after each prefix in ``marks``) where the template allows it,
    with notes on why it did not where it does not. ``tools``: the tool list the template renders;
    ``shift``: how many messages the caller put before its own (a system message of tools), which
    ``marks`` and `Segmented.ends` do not count; ``now``: the day to render with (`conversation_day`);
    ``pool``: where the template runs (`graftmem.core.renderpool`; None: this thread).

    The whole prompt is ``render(msgs, add_generation_prompt=True)``, always: the cut never changes what
    is prefilled. A cut after message k is placed where ``render(msgs[:k])`` stops agreeing with the
    whole prompt (its end, for the 57 of 70 templates that extend cleanly), moved back to the last
    special-token seam (`graftmem.core.prompt.seam_before`; whether the cuts tokenize apart is checked
    for all of them at once, `tokenize_cut`). A template that re-renders a message once another follows
    (Phi-3.5's EOS, Qwen3's empty think block, reasoning dropped at a new user turn) thus gives a shorter
    stable prefix, and the note says which message.

    Untrusted text stays text: `Segmented.spans` holds, per segment, the character spans of user and tool
    messages that spell a special token (``"<|eot_id|>"`` typed by a user), which `tokenize_segments`
    tokenizes without special-token parsing while the template's own markers stay special. No cut falls
    inside such a span. Raises `TemplateError` when the template refuses ``msgs``, `NothingRendered` when
    it renders them as nothing."""
    kw = {**dict(kwargs or {}), "now": now if now is not None else conversation_day(tpl, msgs)}
    full = _RENDERS.render(tpl, msgs, tools, kw, True, pool)
    if not full:
        raise NothingRendered(f"template {tpl.name!r} rendered these messages as nothing")
    cuts: list[int] = []
    after: list[int] = []  # per cut: the messages before it
    notes: list[str] = []
    agreed = [0]  # per prefix of msgs: the characters of the whole prompt its render accounts for
    roles = [m.get("role") for m in msgs]
    shifted = {k + shift for k in marks}
    for k in range(1, len(msgs) + 1):
        try:
            part = _RENDERS.render(tpl, msgs[:k], tools, kw, False, pool)
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
        c = seam_before(engine, full, agree, lo, check=False)  # tokenize_cut checks all cuts' ids at once
        if c is not None and c < len(full):
            cuts.append(c)
            after.append(k)

    def header_end(k: int, c: int) -> Optional[int]:
        if msgs[k].get("role") != "assistant":
            return None
        head = _RENDERS.render(tpl, msgs[:k], tools, kw, True, pool)
        return len(head) if full.startswith(head) else None

    def probe() -> str:
        try:
            return _RENDERS.render(tpl, [*msgs, {"role": "assistant", "content": _PROBE}], tools, kw, False, pool)
        except TemplateError:
            return ""

    cuts, joined = _header_cuts(engine, full, cuts, after, len(msgs), shifted, header_end, probe)
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
    kept = [(c, k) for c, k in zip(cuts, after) if not any(a < c < b for a, b in spans)]
    cuts, after = [c for c, _ in kept], [k for _, k in kept]
    bounds = [0, *cuts, len(full)]
    literal = [[(max(a, lo) - lo, min(b, hi) - lo) for a, b in spans if a < hi and b > lo]
               for lo, hi in zip(bounds, bounds[1:])]
    return Segmented(texts=[full[a:b] for a, b in zip(bounds, bounds[1:])], spans=literal,
                     ends=[agreed[k + shift] for k in range(1, len(msgs) - shift + 1)], joined=joined,
                     after=[k - shift for k in after], notes=notes)


def cut_turns(fmt: ChatFormat, turns: Sequence[tuple[str, str]], marks: Collection[int] = (), *, shift: int = 0,
              engine: Optional["Engine"] = None) -> Segmented:
    """``turns`` (each an OpenAI role and the text of its turn) rendered by a hand-written format
    (`ChatFormat.turn`), cut where `turn_cut` says (``marks`` too), then the assistant's header. With
    ``engine``, the header but its last token goes with what precedes it where the text after the cut
    tokenizes apart (as `cut_template` does, `_header_cuts`). ``shift``: how many turns the caller put
    before its own (a system message of tools), which ``marks`` and `Segmented.ends` do not count.

    `Segmented.spans` holds per segment the character span of each user or tool text (what
    `literal_spans` narrows to those that spell a special token): the hand-written formats keep untrusted
    text as text too, as the model templates do."""
    roles = [role for role, _ in turns]
    parts: list[str] = []
    spans: list[Spans] = []
    for role, text in turns:
        head = fmt.head("system" if role == "developer" else role)
        parts.append(f"{head}{text}{fmt.turn_close}")
        spans.append([(len(head), len(head) + len(text))] if role in ("user", "tool") and text else [])
    ends = [sum(map(len, parts[:k + shift])) for k in range(1, len(parts) - shift + 1)]
    shifted = {k + shift for k in marks}
    header = fmt.head("assistant")
    full = "".join(parts) + header
    offs = [0, *itertools.accumulate(map(len, parts))]
    after = [k for k in range(1, len(parts) + 1) if turn_cut(roles, k, shifted)]
    cuts = [offs[k] for k in after]
    joined = False
    if engine is not None:  # the header on the side of what precedes it, where that tokenizes apart

        def header_end(k: int, c: int) -> Optional[int]:
            return c + len(header) if header and roles[k] == "assistant" and parts[k].startswith(header) else None

        cuts, joined = _header_cuts(engine, full, cuts, after, len(parts), shifted, header_end,
                                    lambda: f"{full}{_PROBE}{fmt.turn_close}")
    bounds = [0, *cuts, len(full)]
    absolute = [(a + offs[i], b + offs[i]) for i, sp in enumerate(spans) for a, b in sp]
    untrusted = [[(a - lo, b - lo) for a, b in absolute if lo <= a and b <= hi] for lo, hi in zip(bounds, bounds[1:])]
    return Segmented(texts=[full[a:b] for a, b in zip(bounds, bounds[1:])], spans=untrusted, ends=ends,
                     joined=joined, after=[k - shift for k in after])


def tokenize_segments(engine: "Engine", segs: Sequence[str], cache: Optional[TokenSource] = None,
                      literal: Optional[Sequence[Spans]] = None) -> list[list[int]]:
    """Token ids per segment: the first with the model's BOS, the others without; a segment with
    ``literal`` spans has them tokenized as text (`graftmem.core.prompt.tokenize_literal`), never from
    the cache."""
    if literal is not None and any(literal):
        return [tokenize_literal(engine, s, literal[i], add_special=i == 0) if literal[i] else
                (cache.tokenize(engine, s, i == 0) if cache is not None else engine.tokenize(s, add_special=i == 0))
                for i, s in enumerate(segs)]
    if cache is None:
        return [engine.tokenize(s, add_special=i == 0) for i, s in enumerate(segs)]
    return [cache.tokenize(engine, s, i == 0) for i, s in enumerate(segs)]


def tokenize_cut(engine: "Engine", texts: list[str], literal: Optional[Sequence[Spans]],
                 cache: Optional[TokenSource] = None, *,
                 check_apart: bool = True) -> tuple[list[str], list[list[int]], Optional[str]]:
    """The segments' texts and ids (`tokenize_segments`), and a note when the prompt had to become one
    segment: each cut was placed where the text after it starts with a special token, but ids are only
    equal to those of the whole prompt if the segments tokenize apart as it does together, checked here
    for all cuts at once (``check_apart``; a prompt with literal spans is not: its ids are no longer
    ``tokenize(text)``)."""
    segments = tokenize_segments(engine, texts, cache, literal)
    if not check_apart or len(segments) < 2 or any(literal or []):
        return texts, segments, None
    whole = "".join(texts)
    ids = cache.tokenize(engine, whole, True) if cache is not None else engine.tokenize(whole, add_special=True)
    if [t for s in segments for t in s] == ids:
        return texts, segments, None
    return [whole], [ids], "the segments do not tokenize apart as the whole prompt: served as one segment"


def literal_spans(engine: "Engine", texts: Sequence[str], untrusted: Sequence[Spans]) -> tuple[list[Spans], list[str]]:
    """Of the untrusted spans (`cut_turns`), those that spell a special token (``"<|im_end|>"``
    typed by a user), to be tokenized as text; and a note per such message for the receipt."""
    literal: list[Spans] = []
    notes: list[str] = []
    for i, (text, spans) in enumerate(zip(texts, untrusted)):
        keep = [(a, b) for a, b in spans if has_special_text(engine, text[a:b])]
        literal.append(keep)
        if keep:
            notes.append(f"segment {i} spells a special token: tokenized as text, its segment not learned")
    return literal, notes



_MANUAL, _TASK = "GRAFTMEMMANUALQZ", "GRAFTMEMTASKQZ"


def template_format(engine: "Engine", tpl: ChatTemplate) -> ChatFormat:
    """A `ChatFormat` (the SDK's block/task split) cut out of a model's own template by the same rule
    that cuts a served conversation: ``[system: M, user: T]`` cut by `cut_template`; the block is the
    segment up to the cut after the system message (the system turn's end where the template extends
    cleanly; before Phi-3.5's EOS, which it writes only when nothing follows), the task the rest. So
    ``prefix(M)`` is, byte for byte, the first segment the server makes of that conversation, and
    ``prefix(M) + continuation(T)`` its whole prompt. Raises `TemplateError` when the manual cannot be a
    turn of its own (Gemma 2's template refuses a system role; Mistral-Nemo's puts it in the last user
    turn) or the cut does not fall cleanly between the system turn and the user's."""
    msgs = [{"role": "system", "content": _MANUAL}, {"role": "user", "content": _TASK}]
    day = today()
    seg = cut_template(engine, tpl, msgs, now=day)
    full = "".join(seg.texts)
    alone = tpl.render(msgs[:1], now=day)
    i_m, i_t = full.find(_MANUAL), full.find(_TASK)
    if i_m < 0 or i_t < 0 or i_t < i_m or alone.find(_MANUAL) != i_m:
        raise TemplateError(f"template {tpl.name!r} does not render a system message as a turn before the user's")
    end = i_m + len(_MANUAL)
    cut = next((sum(map(len, seg.texts[:i + 1])) for i, k in enumerate(seg.after) if k == 1), None)
    if cut is None or not end <= cut <= i_t or not clean_seam(engine, full, cut):
        raise TemplateError(f"template {tpl.name!r}: no special-token seam between the system turn and the user's")
    fmt = ChatFormat(name=f"template:{tpl.digest[:12]}", block_head=full[:i_m], block_tail=full[end:cut],
                     task_head=full[cut:i_t], task_tail=full[i_t + len(_TASK):], probe="", template=tpl)
    # the derived parts must give what the template renders, with other texts than the placeholders
    check = tpl.render([{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi there"}],
                       add_generation_prompt=True, now=day)
    if fmt.prefix("You help.") + fmt.continuation("Hi there") != check:
        raise TemplateError(f"template {tpl.name!r} renders a text differently from its placeholders")
    return fmt


def chat_block(engine: "Engine", fmt: ChatFormat, manual: str) -> str:
    """The text of a chat block that holds ``manual`` as a system turn (``Memory.learn(text, chat=True)``).

    For a format derived from the model's template, the first segment this module's rule cuts from
    ``[system: manual, user: ...]``: what the server's first segment of a conversation with that system
    prompt is, byte for byte. A template that trims its messages (Llama 3.x writes ``content | trim``)
    thus trims the manual in the block too; ``fmt.prefix(manual)`` kept its edge whitespace, a text the
    template never renders, so the SDK's block and the server's segment differed. A hand-written format's
    block is ``fmt.prefix(manual)`` (its render is that, `cut_turns`)."""
    if fmt.template is None:
        return fmt.prefix(manual)
    msgs = [{"role": "system", "content": manual}, {"role": "user", "content": _TASK}]
    try:
        seg = cut_template(engine, fmt.template, msgs, now=today())
    except TemplateError:
        return fmt.prefix(manual)
    first = seg.texts[0] if seg.after[:1] == [1] and len(seg.texts) > 1 else None
    if first is None or not (first.startswith(fmt.block_head) and first.endswith(fmt.block_tail)) or \
            "".join(seg.texts[1:]) != fmt.continuation(_TASK):
        return fmt.prefix(manual)  # the template renders this manual otherwise than a turn of its own
    return first


#: The conversation a hand-written format must render exactly as the model's template does to stand in
#: for it (`renders_as_template`): a system turn (a chat block's manual), a user turn, an answer, a user turn.
_CONVO = ({"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"})


def renders_as_template(fmt: ChatFormat, tpl: ChatTemplate) -> bool:
    """Whether the hand-written ``fmt`` renders byte for byte what the model's template ``tpl`` renders
    (a conversation with a system turn, each prefix of it, with the generation prompt) and ``tpl``
    renders no tools: then ``fmt`` stands in for it (SmolLM2: every block and prompt learned before
    stays byte-identical). A check, not a guess from the vocabulary: a template that renders anything
    else (DeepSeek R1-Distill-Qwen's, on a vocabulary that has ChatML's markers) is used as it is."""
    if tpl.uses_tools:
        return False
    try:
        return all(tpl.render(list(_CONVO[:k]), add_generation_prompt=True) ==
                   fmt.render(list(_CONVO[:k]), generation_prompt=True) for k in (2, 4))
    except (TemplateError, ConfigError):
        return False


def _hand_written(engine: "Engine") -> Optional[ChatFormat]:
    """The hand-written format whose marker is one special token of this vocabulary (None: neither)."""
    for fmt in FORMATS.values():
        if len(engine.tokenize(fmt.probe, add_special=False)) == 1:
            return fmt
    return None


def detect_format(engine: "Engine", template: "ChatTemplate | str | None" = None) -> Optional[ChatFormat]:
    """The chat format of this engine's requests and chat blocks.

    ``template`` (a `ChatTemplate` or a file path, as llama-server's ``--chat-template-file``) wins.
    Otherwise the GGUF's own ``tokenizer.chat_template``, cut into a block part and a task part by
    `template_format`, unless a hand-written format renders exactly what it renders
    (`renders_as_template`: SmolLM2) or it cannot hold a manual as a turn of its own (then the
    hand-written format, logged). A GGUF without a template falls back to the hand-written format whose
    marker is a single special token in the vocabulary (Gemma 3 270M); None when nothing fits.
    """
    if template is not None:
        given = template if isinstance(template, ChatTemplate) else load_template(template, engine)
        return template_format(engine, given)
    cache = getattr(engine, "_graftmem_formats", None)
    if cache is None:
        cache = {}
        try:
            engine._graftmem_formats = cache  # type: ignore[attr-defined]
        except AttributeError:
            pass
    if "auto" in cache:
        return cache["auto"]
    legacy = _hand_written(engine)
    tpl = model_template(engine)
    chosen: Optional[ChatFormat] = legacy
    if tpl is not None and not (legacy is not None and renders_as_template(legacy, tpl)):
        try:
            chosen = template_format(engine, tpl)
        except TemplateError as exc:
            log.warning("model %s: its chat template cannot hold a manual as a turn of its own (%s); %s",
                        engine.fingerprint.model_name, exc,
                        f"using the hand-written {legacy.name!r} format" if legacy else "chat is unavailable")
            chosen = legacy
            cache["why"] = f"its chat template cannot hold a manual as a turn of its own ({exc})"
    if tpl is None and legacy is None:
        cache["why"] = (f"the GGUF has no chat template and none of the hand-written formats "
                        f"({', '.join(sorted(FORMATS))}) fits its vocabulary")
    cache["auto"] = chosen
    return chosen


def no_format_reason(engine: "Engine") -> str:
    """Why `detect_format` found no chat format for ``engine`` (what a refusal says: the real reason,
    not a guess)."""
    detect_format(engine)
    cache = getattr(engine, "_graftmem_formats", None) or {}
    return str(cache.get("why", "no chat format fits this model"))


def request_template(engine: "Engine", template: "ChatTemplate | str | None" = None) -> Optional[ChatTemplate]:
    """The template a chat *request* is rendered with: ``template`` (an object or a file) if given,
    else the GGUF's own, except where a hand-written format renders exactly what it renders
    (`renders_as_template`; None: render with `detect_format`'s format; what still differs is logged). Unlike a chat block's format, a request needs no block/task cut, so a
    template that cannot render a system turn alone (Qwen3.5 raises "No user query found") still
    renders every request."""
    if template is not None:
        return template if isinstance(template, ChatTemplate) else load_template(template, engine)
    tpl = model_template(engine)
    if tpl is None:
        return None
    legacy = _hand_written(engine)
    if legacy is not None and renders_as_template(legacy, tpl):
        log.info("model %s: graftmem's hand-written %r format renders what its chat template renders for a "
                 "conversation with a system turn; requests use it (what differs: a request without a system "
                 "message gets no default system turn the template may add, and tools are graftmem's Hermes "
                 "text in the system message, which the template does not render)",
                 engine.fingerprint.model_name, legacy.name)
        return None
    return tpl


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
    the next request of the conversation can cut there too. Both render paths (`cut_template`,
    `cut_turns`) cut through this one function.

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


