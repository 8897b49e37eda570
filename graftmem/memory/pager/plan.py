"""Cutting a document into pages that fit one window, and its passages: deterministic (same text,
window, overlap and tokenizer give the same pages, so a rerun finds its stored pages by id), with
token offsets in the document (the package doc says how they are counted and what they cost)."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Union

from ...core.errors import ConfigError

if TYPE_CHECKING:
    from ...core.engine import Engine

__all__ = ["Page", "DocumentPlan", "Source", "read_source", "plan_document", "DEFAULT_RESERVE", "DEFAULT_OVERLAP",
           "PASSAGE_CHARS"]

#: positions of the window kept free for the question and the answer when ``window`` is not given
DEFAULT_RESERVE = 256
#: tokens repeated at the start of the next page, so a sentence cut by a page end is whole in one page
DEFAULT_OVERLAP = 64
#: characters a passage grows to before a new one starts (MiniLM reads at most 256 word pieces)
PASSAGE_CHARS = 480

Source = Union[str, "os.PathLike[str]", Iterable[str]]

# a unit ends after sentence punctuation (with closing quotes/brackets) followed by white space, or at
# a blank line; the white space stays with the unit before it, so units concatenate to the text
_BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n\s*")


@dataclass(frozen=True)
class Page:
    """One page of a plan: its text (a slice of the document), token ids and place in the document."""

    page: int
    char_start: int
    char_end: int
    token_start: int
    tokens: list[int]
    text: str
    passages: list[tuple[int, int, int]]  #: (char_start, char_end, token_start) in document coordinates

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class DocumentPlan:
    """How a document is cut into pages for one engine; deterministic, so a rerun gets the same pages."""

    document: str
    name: str
    text: str
    window: int
    overlap: int
    pages: list[Page]
    n_tokens: int  #: tokens of the document, overlaps counted once (see the module docstring)
    tokenize: Callable[[str], list[int]] = field(repr=False, compare=False)

    @property
    def page_tokens(self) -> int:
        """Tokens prefilled to store every page (overlaps and BOS counted on every page)."""
        return sum(p.n_tokens for p in self.pages)

    def token_offset(self, char_pos: int) -> int:
        """Token offset in the document of character ``char_pos``: the start of the last page that
        begins at or before it, plus the tokens of the page text before it."""
        import bisect

        starts = [p.char_start for p in self.pages]
        page = self.pages[max(0, bisect.bisect_right(starts, char_pos) - 1)]
        head = self.text[page.char_start:char_pos]
        return page.token_start + (len(self.tokenize(head)) if head else 0)

    def pages_holding(self, char_start: int, char_end: int) -> list[int]:
        """Page numbers whose text contains the whole range ``[char_start, char_end)``."""
        return [p.page for p in self.pages if p.char_start <= char_start and char_end <= p.char_end]


def read_source(source: Source) -> str:
    """The document text: a path (``Path``, or a ``str`` naming an existing file with no newline in it),
    a text, or an iterable of texts (joined by blank lines, each one a section)."""
    if isinstance(source, os.PathLike):
        return Path(source).read_text(encoding="utf-8")
    if isinstance(source, str):
        if "\n" not in source and len(source) < 4096:
            try:
                if Path(source).expanduser().is_file():
                    return Path(source).expanduser().read_text(encoding="utf-8")
            except OSError:
                pass
        return source
    if isinstance(source, (bytes, bytearray)):
        raise ConfigError("pass the document as text (str), a path, or an iterable of str, not bytes")
    parts = []
    for i, part in enumerate(source):
        if not isinstance(part, str):
            raise ConfigError(f"item {i} of the document is {type(part).__name__}, expected str")
        parts.append(part.strip())
    return "\n\n".join(p for p in parts if p)


def _units(text: str) -> list[tuple[int, int]]:
    """Sentence/paragraph units as (start, end) char spans that tile the text."""
    spans = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        end = m.end()
        if end > start:
            spans.append((start, end))
            start = end
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def _split_long(text: str, start: int, end: int, n_tok: int, budget: int) -> list[tuple[int, int]]:
    """Cut a unit with no sentence break that exceeds ``budget`` tokens at word boundaries."""
    pieces = max(2, -(-n_tok // max(1, budget // 2)))
    step = max(1, (end - start) // pieces)
    out = []
    s = start
    while s < end:
        e = min(end, s + step)
        if e < end:
            sp = text.rfind(" ", s + 1, e)
            e = sp + 1 if sp > s else e
        out.append((s, e))
        s = e
    return out


def plan_document(engine: "Engine", text: str, *, window: Optional[int] = None,
                  overlap: int = DEFAULT_OVERLAP, document: Optional[str] = None,
                  name: Optional[str] = None, passage_chars: int = PASSAGE_CHARS) -> DocumentPlan:
    """Cut ``text`` into pages of at most ``window`` tokens (BOS included) at sentence or paragraph
    boundaries, each page starting ``overlap`` tokens (whole sentences) before the previous one ended.

    ``window`` defaults to the engine's ``n_ctx`` minus `DEFAULT_RESERVE` positions for the
    question and the answer. ``document`` is the document id (default: a hash of the text).
    """
    if not text or not text.strip():
        raise ConfigError("cannot learn an empty document")
    window = engine.n_ctx - DEFAULT_RESERVE if window is None else int(window)
    if window < 32:
        raise ConfigError(f"window={window} tokens is too small for a page (at least 32)")
    if window > engine.n_ctx - 16:
        raise ConfigError(f"window={window} leaves no room for a question in n_ctx={engine.n_ctx}: "
                          f"use at most {engine.n_ctx - 16} (default n_ctx - {DEFAULT_RESERVE})")
    if overlap < 0 or overlap >= window // 2:
        raise ConfigError(f"overlap={overlap} must be >= 0 and less than half the window ({window // 2})")
    doc_id = document or "doc-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    bos = len(engine.tokenize(""))  # the BOS each page starts with, if the model uses one
    budget = window - bos - 2  # joins between units may tokenize a little differently

    spans: list[tuple[int, int]] = []
    counts: list[int] = []
    for s, e in _units(text):
        n = len(engine.tokenize(text[s:e], add_special=False))
        if n > budget:
            for s2, e2 in _split_long(text, s, e, n, budget):
                spans.append((s2, e2))
                counts.append(len(engine.tokenize(text[s2:e2], add_special=False)))
        else:
            spans.append((s, e))
            counts.append(n)
    def count(t: str) -> int:
        return len(engine.tokenize(t, add_special=False)) if t else 0

    page_tok = 0  # token offset of the current page: the previous one's plus its text up to here
    prev_cs = 0

    pages: list[Page] = []
    i = 0
    n_units = len(spans)
    while i < n_units:
        j = i
        total = 0
        while j < n_units and total + counts[j] <= budget:
            total += counts[j]
            j += 1
        if j == i:  # cannot happen after _split_long, but never loop forever
            j = i + 1
        while True:
            cs, ce = spans[i][0], spans[j - 1][1]
            page_text = text[cs:ce].rstrip()
            tokens = engine.tokenize(page_text)
            if len(tokens) <= window or j == i + 1:
                break
            j -= 1
        if len(tokens) > window:
            raise ConfigError(f"a sentence at character {cs} does not fit a {window}-token page")
        page_tok += count(text[prev_cs:cs])
        prev_cs = cs
        passages = []
        k = i
        p_tok, p_cs = page_tok, cs  # passage offsets, counted piece by piece (linear in the page)
        while k < j:
            m = k
            while m < j and (m == k or spans[m][1] - spans[k][0] <= passage_chars):
                m += 1
            p_tok += count(text[p_cs:spans[k][0]])
            p_cs = spans[k][0]
            passages.append((spans[k][0], min(spans[m - 1][1], cs + len(page_text)), p_tok))
            k = m
        pages.append(Page(page=len(pages), char_start=cs, char_end=cs + len(page_text),
                          token_start=page_tok, tokens=tokens, text=page_text, passages=passages))
        if j >= n_units:
            break
        # the next page starts at the earliest unit such that the units it repeats fit in `overlap`
        nxt = j
        kept = 0
        while nxt - 1 > i and kept + counts[nxt - 1] <= overlap:
            nxt -= 1
            kept += counts[nxt]
        i = nxt
    n_doc = page_tok + count(text[prev_cs:])
    return DocumentPlan(document=doc_id, name=name or doc_id, text=text, window=window, overlap=overlap,
                        pages=pages, n_tokens=n_doc, tokenize=lambda t: engine.tokenize(t, add_special=False))
