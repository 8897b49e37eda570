"""A model's answer split into reasoning, content and tool calls: one state machine for the stream and
for the whole answer.

Why one machine: a streamed answer and the same answer sent whole were split by two pieces of code
(a stream filter and a whole-text parser) that disagreed at the edges (an unclosed think block, an
empty thought, the text before a call, a call without its opening tag). Here the whole answer IS the
stream fed at once: `split_answer(text, spec)` is ``AnswerParser(spec).feed(text)`` then ``finish()``,
and the answer is the sum of the events either way.

How it streams (as llama-server does): after every piece the text so far is parsed in *partial* mode
and only what grew since the last event is sent. Partial mode is the final parse made conservative so
that it can only grow: the content stops at the first place a call may begin (a family's opener, or a
suffix that may be the start of one), trailing whitespace waits for what follows, reasoning stops
before a possible closing tag. Calls are sent once the answer is complete (a call is only known whole;
a span that does not parse stays text). `finish()` parses the whole text and sends the rest.

What decides the split (`AnswerSpec`): the call family (`graftmem.core.toolcalls`: its markers and its
parser), the request's tool names (None: no tools, calls are not parsed), the template's reasoning tags
and whether the prompt opened the think block. GPT-OSS's harmony channels are split with or without
tools: ``analysis`` is the reasoning, ``final`` (and a ``commentary`` preamble) the content.

Markers may be control tokens: the server writes the family's markers out as text in the stream and in
the whole answer alike (`AnswerSpec.specials`), so the parser always sees them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from . import toolcalls
from .toolcalls import ToolCallFormat, held_suffix

__all__ = ["AnswerSpec", "Event", "Answer", "AnswerParser", "split_answer", "think_tags", "answer_spec"]

log = logging.getLogger("graftmem")

#: reasoning tags by the template marker that shows them (first match wins); ``<think>`` last
_THINK_TAGS: tuple[tuple[str, tuple[str, str]], ...] = (
    ("[/THINK]", ("[THINK]", "[/THINK]")),                               # Magistral, Ministral reasoning
    ("<|END_THINKING|>", ("<|START_THINKING|>", "<|END_THINKING|>")),    # Command R7B
    ("</seed:think>", ("<seed:think>", "</seed:think>")),                # Seed-OSS
    ("</mm:think>", ("<mm:think>", "</mm:think>")),                      # MiniMax M3
    ("<channel|>", ("<|channel>thought", "<channel|>")),                 # Gemma 4
    ("<|inner_suffix|>", ("<|inner_prefix|>", "<|inner_suffix|>")),      # Apertus
    ("</think>", ("<think>", "</think>")),                                # DeepSeek R1, Qwen3, GLM, Kimi, ...
)


def think_tags(template_source: Optional[str]) -> Optional[tuple[str, str]]:
    """The reasoning tags the template writes (``("<think>", "</think>")``, Mistral's ``[THINK]``, ...);
    None when it writes none (its model does not reason in tags)."""
    src = template_source or ""
    for marker, tags in _THINK_TAGS:
        if marker in src:
            return tags
    return None


@dataclass(frozen=True)
class AnswerSpec:
    """What decides how an answer splits."""

    #: the family whose calls (and, for harmony, channels) the answer is written in
    fmt: ToolCallFormat = toolcalls.HERMES
    #: the tools a call may name; None: the request offered none (or ``tool_choice: "none"``): no calls
    names: Optional[frozenset[str]] = None
    #: the template's reasoning tags (`think_tags`); None: it has none
    think: Optional[tuple[str, str]] = None
    #: split the reasoning off (False: ``reasoning_format: "none"``, it stays in the content)
    reasoning: bool = True
    #: the prompt opened the think block (its generation prompt ends with the opening tag)
    think_open: bool = False
    #: what the prompt opened that belongs to the answer's content when reasoning is not split (the
    #: think block's opening tag the generation prompt wrote), as llama.cpp shows it
    #: other families whose calls are also read (a template that renders no tools gets graftmem's
    #: Hermes prompt, yet its model may still write its own family's calls)
    also: tuple[ToolCallFormat, ...] = ()
    echo: str = ""

    @property
    def families(self) -> tuple[ToolCallFormat, ...]:
        return (self.fmt, *self.also)

    @property
    def specials(self) -> frozenset[str]:
        """Marker texts the answer must show even where they are control tokens (what llama-server
        calls preserved tokens)."""
        out = {m for f in self.families for m in f.specials}
        if self.think is not None:
            out.update(self.think)
        return frozenset(out)


def answer_spec(template_source: Optional[str], *, fmt: Optional[ToolCallFormat] = None,
                names: Optional[Iterable[str]] = None, reasoning: bool = True, prompt_tail: str = "") -> AnswerSpec:
    """The spec of an answer to a prompt rendered by a template of ``template_source`` (None: no template,
    graftmem's own format): ``fmt`` the family the request's tools are written in (None: the template's
    own, `graftmem.core.toolcalls.tool_format`), ``names`` the tools offered (None: none),
    ``reasoning=False`` keeps reasoning in the content, ``prompt_tail`` the end of the rendered prompt
    (where a template opens the think block)."""
    own = toolcalls.tool_format(template_source) if template_source else toolcalls.HERMES
    fmt = fmt or own
    think = think_tags(template_source)
    if fmt is not toolcalls.HARMONY and own is toolcalls.HARMONY:
        fmt = own  # harmony's channels are the answer's shape, whatever the tool prompt
    also = (own,) if own is not fmt and names is not None else ()
    tail = prompt_tail.rstrip()
    think_open = think is not None and tail.endswith(think[0])
    echo = prompt_tail[tail.rfind(think[0]):] if think is not None and think_open and not reasoning else ""
    return AnswerSpec(fmt=fmt, names=frozenset(names) if names is not None else None, think=think,
                      reasoning=reasoning, think_open=think_open, echo=echo, also=also)


@dataclass(frozen=True)
class Event:
    """One piece of the answer: ``content`` or ``reasoning`` text (a delta), or a complete ``call``
    (OpenAI's ``tool_calls`` entry)."""

    kind: str
    text: str = ""
    call: Optional[dict[str, Any]] = None


@dataclass
class Answer:
    """The whole answer: content (None: none), reasoning (None: none) and calls."""

    content: Optional[str]
    reasoning: Optional[str] = None
    calls: list[dict[str, Any]] = field(default_factory=list)


def _split_reasoning(text: str, spec: AnswerSpec, final: bool) -> tuple[str, str, bool]:
    """``(reasoning, rest, decided)``; ``decided`` False: the text may still turn out to open a think
    block (partial mode only): nothing is sent yet."""
    if spec.think is None or not spec.reasoning:
        return "", text, True
    open_, close = spec.think
    head = text.lstrip()
    if spec.think_open:
        body = text  # the prompt opened it: an opening tag the model writes again is reasoning text
    elif head.startswith(open_):
        body = head[len(open_):]
    elif head.startswith(close):  # an empty thought whose opening tag the model left out
        return "", head[len(close):], True
    elif not final and (open_.startswith(head) or close.startswith(head)):
        return "", "", False  # nothing yet, or maybe a tag arriving
    else:
        return "", text, True
    j = body.find(close)
    if j >= 0:
        return body[:j], body[j + len(close):], True
    i = _first_opener(body, spec, bare=False) if spec.names is not None else -1
    if i >= 0:  # never closed, and a call begins: the reasoning ends there (llama.cpp reads it so)
        return body[:i], body[i:], True
    if final:
        return body, "", True  # never closed: it is all reasoning, as llama.cpp reads it
    markers = [close, *(o for f in spec.families for o in f.openers)] if spec.names is not None else [close]
    return body[:len(body) - held_suffix(body, markers)], "", True


def _first_opener(text: str, spec: AnswerSpec, bare: bool = True) -> int:
    """Where the first call may begin in ``text`` (-1: nowhere); ``bare``: a bare JSON call counts."""
    cuts = [i for f in spec.families for o in f.openers if (i := text.find(o)) >= 0]
    if bare and any(f.bare_json for f in spec.families):
        head = text.lstrip()
        if head.startswith("{"):
            cuts.append(len(text) - len(head))
    return min(cuts) if cuts else -1


def _split_calls(rest: str, spec: AnswerSpec, final: bool) -> tuple[str, list[dict[str, Any]], str]:
    """``(content, calls, reasoning)`` of the text after the reasoning."""
    if spec.fmt is toolcalls.HARMONY:
        return toolcalls.harmony_split(rest, spec.names if spec.names is not None else (), final=final,
                                       reasoning=spec.reasoning)
    strip = [m for f in spec.families for m in f.strip
             if spec.reasoning or spec.think is None or not any(m in t for t in spec.think)]
    if not strip:
        return _calls(rest, spec, final)
    if not final:
        rest = rest[:len(rest) - held_suffix(rest, strip)]
    content, calls, more = _calls(rest, spec, final)
    for m in sorted(strip, key=len, reverse=True):
        content = content.replace(m, "")
    return content, calls, more


def _calls(rest: str, spec: AnswerSpec, final: bool) -> tuple[str, list[dict[str, Any]], str]:
    if spec.names is None:
        if final:
            return rest, [], ""
        return rest[:len(rest) - held_suffix(rest, ())], [], ""
    i = _first_opener(rest, spec)
    if not final:
        if i >= 0:
            return rest[:i], [], ""
        if any(f.bare_json for f in spec.families) and not rest.strip():
            return "", [], ""
        markers = [o for f in spec.families for o in f.openers]
        return rest[:len(rest) - held_suffix(rest, markers)], [], ""
    if i < 0:
        return rest, [], ""
    for fmt in spec.families:
        parsed = toolcalls.parse(rest, fmt, spec.names)
        if parsed.calls:
            return parsed.content or "", parsed.calls, parsed.reasoning or ""
    return rest, [], ""


def _parse(text: str, spec: AnswerSpec, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
    """``(content, reasoning, calls)`` of ``text``; ``final=False``: the partial view (see the module
    docstring), which the final one only extends."""
    if spec.fmt is toolcalls.HARMONY:
        content, calls, reasoning = _split_calls(text, spec, final)
        return content, reasoning, calls
    if spec.echo:
        text = spec.echo + text
    reasoning, rest, decided = _split_reasoning(text, spec, final)
    if not decided:
        return "", "", []
    content, calls, more = _split_calls(rest, spec, final)
    return content, (reasoning + ("\n" + more if more and reasoning else more)), calls


def _trim(text: str, final: bool) -> str:
    return text.strip() if final else text.lstrip().rstrip()


class AnswerParser:
    """Feed an answer's text as it arrives; each call returns the events that became certain.

    ``feed(delta) -> list[Event]``, then ``finish() -> list[Event]`` once the answer is complete;
    `answer` is what was sent, whole. Every event extends what was sent before, so a client that joins
    the deltas gets exactly `split_answer`'s result."""

    def __init__(self, spec: AnswerSpec) -> None:
        self.spec = spec
        self.text = ""
        self._content = ""
        self._reasoning = ""
        self._calls: list[dict[str, Any]] = []
        self._done = False

    def _events(self, content: str, reasoning: str, calls: list[dict[str, Any]], final: bool) -> list[Event]:
        out: list[Event] = []
        reasoning, content = _trim(reasoning, final), _trim(content, final)
        if reasoning.startswith(self._reasoning):
            if len(reasoning) > len(self._reasoning):
                out.append(Event("reasoning", reasoning[len(self._reasoning):]))
                self._reasoning = reasoning
        else:
            log.debug("answer: reasoning %r does not extend what was sent %r", reasoning[:40], self._reasoning[:40])
        if content.startswith(self._content):
            if len(content) > len(self._content):
                out.append(Event("content", content[len(self._content):]))
                self._content = content
        else:
            log.debug("answer: content %r does not extend what was sent %r", content[:40], self._content[:40])
        for c in calls[len(self._calls):]:
            out.append(Event("call", call=c))
            self._calls.append(c)
        return out

    def feed(self, delta: str) -> list[Event]:
        """The events ``delta`` makes certain (often none: a marker may be arriving)."""
        if self._done:
            raise ValueError("the answer is finished")
        if not delta:
            return []
        self.text += delta
        content, reasoning, _ = _parse(self.text, self.spec, final=False)
        return self._events(content, reasoning, [], final=False)

    def finish(self) -> list[Event]:
        """The rest, once the answer is complete: held text, the calls."""
        if self._done:
            return []
        self._done = True
        content, reasoning, calls = _parse(self.text, self.spec, final=True)
        return self._events(content, reasoning, calls, final=True)

    @property
    def answer(self) -> Answer:
        return Answer(content=self._content or None, reasoning=self._reasoning or None, calls=list(self._calls))


def split_answer(text: str, spec: AnswerSpec) -> Answer:
    """The whole answer split: the stream fed at once (`AnswerParser`)."""
    p = AnswerParser(spec)
    p.feed(text)
    p.finish()
    return p.answer
