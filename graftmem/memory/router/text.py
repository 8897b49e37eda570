"""What a block is routed by: its *route text* (name, ``when_to_use``, the start of its text), its
*passages* (a few sentences each) and its lexical terms, and the normalized task of the exact-lookup
path. Pure functions of text, so the index (`graftmem.memory.router.index`) and the benches shape
entries the same way; changing any constant here changes what an index file holds (its layout
records them, and a file built otherwise is rebuilt)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Optional

from ..lexical import tokens

if TYPE_CHECKING:
    from ...core.blocks import Block

__all__ = ["normalize_task", "route_text", "entry_key", "block_body", "passages", "route_parts", "TEXT_CHARS",
           "PASSAGE_CHARS", "MAX_PASSAGES", "LEX_CHARS"]

#: Characters of a block's text that go into its route text (MiniLM reads 256 word pieces at most).
TEXT_CHARS = 700
#: Characters a passage of a block's text grows to (whole sentences), and the most passages embedded per
#: block (the first ones; the lexical terms cover the whole text up to LEX_CHARS).
PASSAGE_CHARS = 300
MAX_PASSAGES = 12
LEX_CHARS = 50_000


def normalize_task(task: str) -> str:
    """The key of the exact-lookup path: case-folded, whitespace collapsed."""
    return " ".join(task.casefold().split())


def route_text(name: str, when_to_use: Optional[str], body: str) -> str:
    """What a block is embedded as: name, when_to_use, then the start of its text."""
    parts = [name.replace("-", " ").replace("_", " ")]
    if when_to_use:
        parts.append(when_to_use.strip())
    parts.append(" ".join(body.split())[:TEXT_CHARS])
    return "\n".join(parts)


def entry_key(name: str, when_to_use: Optional[str]) -> str:
    """Changes when what a block is embedded as changes (its text cannot: ids are content hashes)."""
    return hashlib.sha256(json.dumps([name, when_to_use or ""]).encode()).hexdigest()[:16]


def block_body(block: "Block") -> str:
    """The text a block is routed by: chat blocks contribute their manual, not the template around it."""
    from ...core.prompt import format_of

    fmt = format_of(block.metadata)
    return fmt.body(block.text) if fmt is not None else block.text


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


def passages(body: str, *, chars: int = PASSAGE_CHARS, limit: int = MAX_PASSAGES) -> list[str]:
    """The first ``limit`` passages of ``body``: whole sentences, whitespace collapsed, joined until a
    passage would pass ``chars`` characters (a longer sentence is a passage of its own)."""
    out: list[str] = []
    cur = ""
    for unit in _SENTENCE_END.split(body):
        unit = " ".join(unit.split())
        if not unit:
            continue
        if cur and len(cur) + 1 + len(unit) > chars:
            out.append(cur)
            if len(out) >= limit:
                return out
            cur = unit
        else:
            cur = f"{cur} {unit}" if cur else unit
    if cur:
        out.append(cur)
    return out[:limit]


def route_parts(name: str, when_to_use: Optional[str], body: str) -> tuple[list[str], list[str]]:
    """What an entry is indexed as: the texts embedded (its route text, then its passages) and its
    lexical terms (name, when_to_use and the text up to `LEX_CHARS` characters)."""
    texts = [route_text(name, when_to_use, body)] + passages(body)
    terms = tokens(" ".join([name.replace("-", " ").replace("_", " "), when_to_use or "", body[:LEX_CHARS]]))
    return texts, terms
