"""The persistent prompt cache: find the longest stored chain that is a prefix of a request, learn
long prefixes that come back.

The index maps a hash of a prompt prefix, taken segment by segment (`graftmem.server.chat`), to
the block that holds exactly that prefix: for a chain ``root -> ... -> block``, the key hashes each
chain block's token ids with its length, root first, so it equals the key of a request's first k
segments exactly when the block holds those token ids *cut at the same places*. That is the
condition for byte-exactness (a state is reproduced only by the same prefill calls), and it is
checked on ids, never on text. Only blocks of this engine's fingerprint are indexed; anything else
(another model, another build, other engine settings) is invisible to the lookup.

The index is rebuilt from the store whenever another process has written to it
([`Store.data_version()`][graftmem.Store.data_version]) or the block count changed, and kept in sync with the blocks learned here.

Learning: a request's prompt up to the start of its last message (all segments but the last message
and the assistant's header) that is at least ``min_tokens`` long and has been seen ``sightings`` times
is learned as a chain, one block per segment (kind ``"auto"``), continuing the longest chain already
stored, so an agent that re-sends its system prompt, tools and conversation on every call finds them
grafted on the next call, and after a restart too. Each block is written by the one learn path
(`prefill_and_store()`).

Retention: the automatic blocks (and only those: a block a user learned is never touched) are kept
under ``max_auto_bytes`` of stored state; past it, the least recently used *leaf* auto block is deleted
first (a chain shrinks from its end, so no remaining block loses its parent), "used" meaning grafted
by this process, else learned.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from ..core.blocks import Block, Fingerprint, block_id_for
from ..core.errors import GraftmemError
from ..memory.learn import prefill_and_store
from ..store.chain import chain_of

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.local import Store

__all__ = ["AUTO_KIND", "PrefixCache", "Match", "prefix_keys"]

log = logging.getLogger("graftmem")

AUTO_KIND = "auto"
_MAX_SIGHTINGS = 4096


def prefix_keys(segments: Sequence[Sequence[int]]) -> list[bytes]:
    """``keys[k]`` is the key of the first ``k + 1`` segments (each hashed with its length)."""
    h = hashlib.sha256(b"graftmem-prefix-v1")
    out = []
    for seg in segments:
        h.update(len(seg).to_bytes(4, "little"))
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in seg))
        out.append(h.copy().digest())
    return out


@dataclass(frozen=True)
class Match:
    """A stored block holding the request's first ``n_segments`` segments (``n_tokens`` token ids)."""

    block: Block
    n_segments: int
    n_tokens: int


class PrefixCache:
    """The prefix index over one store, for one engine fingerprint, plus the auto-learn policy."""

    def __init__(self, store: "Store", fingerprint: Fingerprint, *, min_tokens: int = 256,
                 sightings: int = 2, learn: bool = True, max_auto_bytes: Optional[int] = 2 << 30) -> None:
        self.store, self.fingerprint = store, fingerprint
        self.max_auto_bytes = max_auto_bytes
        self._used: dict[str, float] = {}
        self.min_tokens, self.sightings, self.learn_enabled = min_tokens, sightings, learn
        self._digest = fingerprint.digest()
        self._lock = threading.RLock()
        self._index: dict[bytes, str] = {}
        self._seen: "OrderedDict[bytes, int]" = OrderedDict()
        self._refused: set[str] = set()
        self._version: Optional[tuple[int, int]] = None

    # ------------------------------------------------------------------ index
    def _current(self) -> tuple[int, int]:
        return self.store.data_version(), self.store.stats().blocks

    def refresh(self, force: bool = False) -> None:
        """Rebuild the index if the store changed since the last build."""
        with self._lock:
            now = self._current()
            if not force and now == self._version:
                return
            index: dict[bytes, str] = {}
            for b in self.store.list():
                if b.fingerprint.digest() != self._digest:
                    continue
                try:
                    chain = chain_of(self.store, b)
                except GraftmemError as exc:
                    log.warning("prefix cache: block %s left out: %s", b.short_id, exc)
                    continue
                index[prefix_keys([c.tokens for c in chain])[-1]] = b.id
            self._index, self._version = index, now

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, segments: Sequence[Sequence[int]]) -> Optional[Match]:
        """The longest indexed prefix of ``segments`` that leaves at least one segment to prefill."""
        self.refresh()
        keys = prefix_keys(segments[:-1])
        with self._lock:
            for k in range(len(keys), 0, -1):
                bid = self._index.get(keys[k - 1])
                if bid is None or bid in self._refused:
                    continue
                try:
                    block = self.store.get(bid)
                    now = time.time()
                    for b in chain_of(self.store, block):
                        self._used[b.id] = now
                except GraftmemError:
                    continue
                return Match(block, k, sum(len(s) for s in segments[:k]))
        return None

    def refuse(self, block_id: str, why: str) -> None:
        """Stop using ``block_id`` in this process (it failed its checks); the store is left as it is."""
        with self._lock:
            self._refused.add(block_id)
        log.warning("prefix cache: block %s refused, the request is served cold: %s", block_id[:12], why)

    # ------------------------------------------------------------------ learning
    def learn_target(self, segments: Sequence[Sequence[int]]) -> int:
        """How many segments of this prompt to learn now (0: none): the prompt up to its last message,
        when it is long enough, not stored yet, and seen often enough."""
        if not self.learn_enabled or len(segments) < 3:
            return 0
        k = len(segments) - 2
        if sum(len(s) for s in segments[:k]) < self.min_tokens:
            return 0
        key = prefix_keys(segments[:k])[-1]
        with self._lock:
            if key in self._index:
                return 0
            n = self._seen.pop(key, 0) + 1
            self._seen[key] = n
            while len(self._seen) > _MAX_SIGHTINGS:
                self._seen.popitem(last=False)
        return k if n >= self.sightings else 0

    def learn(self, engine: "Engine", segments: Sequence[Sequence[int]], texts: Sequence[str], k: int,
              start: Optional[Match]) -> Optional[Block]:
        """Store the first ``k`` segments as a chain (continuing ``start``); returns the last block.

        Runs its own [`Engine.session()`][graftmem.Engine.session] per block (the one learn path)."""
        parent = start.block if start is not None and start.n_segments <= k else None
        first = start.n_segments if parent is not None else 0
        try:
            for i in range(first, k):
                tokens = list(segments[i])
                bid = block_id_for(self.fingerprint, tokens, parent.id if parent is not None else None)
                if self.store.contains(bid):
                    block = self.store.get(bid)
                else:
                    block = prefill_and_store(engine, self.store, block_id=bid, tokens=tokens, text=texts[i],
                                              name=f"auto: {' '.join(texts[i].split())[:40]}", kind=AUTO_KIND,
                                              metadata={"segment": i}, parent=parent)
                with self._lock:
                    self._index[prefix_keys(segments[:i + 1])[-1]] = block.id
                    self._used[block.id] = time.time()
                parent = block
        except GraftmemError as exc:
            log.warning("prefix cache: learning a %d-segment prefix failed: %s", k, exc)
            return None
        with self._lock:
            self._version = self._current()
        log.info("prefix cache: learned a %d-token prompt prefix as block %s",
                 sum(len(s) for s in segments[:k]), parent.short_id if parent else "-")
        self.evict()
        return parent

    def evict(self) -> list[str]:
        """Delete least recently used leaf auto blocks until they fit ``max_auto_bytes``; their ids."""
        if self.max_auto_bytes is None:
            return []
        removed: list[str] = []
        with self._lock:
            autos = {b.id: b for b in self.store.list(kind=AUTO_KIND)}
            total = sum(b.state_size for b in autos.values())
            while total > self.max_auto_bytes and autos:
                leaves = [b for b in autos.values() if not self.store.children(b.id)]
                if not leaves:
                    break
                victim = min(leaves, key=lambda b: self._used.get(b.id, b.created_at.timestamp()))
                try:
                    self.store.delete(victim.id)
                except GraftmemError as exc:
                    log.warning("prefix cache: could not evict block %s: %s", victim.short_id, exc)
                    break
                total -= victim.state_size
                del autos[victim.id]
                removed.append(victim.id)
            if removed:
                log.info("prefix cache: evicted %d auto block(s) to stay under %d bytes", len(removed),
                         self.max_auto_bytes)
                self.refresh(force=True)
        return removed
