"""The hot tier: the states of recently grafted or written blocks, kept in this process's RAM, so that a
block grafted again is handed to llama.cpp without being read, hashed or placed again.

Why: a graft of a block from the page cache reads its 20-95 MB state (a copy by the kernel), hashes it
(the per-read check, `graftmem.store.verified`), and for a chained or window-trimmed block merges and
places cells; a hot block is grafted again and again (an agent's system prompt on every turn, the
prefix the server learned at the last turn). From the hot tier, a graft is one ``set_data`` from bytes
already checked.

What keeps it exact and safe:

* an entry is the state exactly as `graftmem.store.load_state` returns it (merged, placed), made only
  from bytes that passed every check of that read, or from the very bytes a writer captured and stored
  (`admit_written`); the entries are immutable (``bytes``, or a read-only view of a buffer the writer
  hands over and never writes again), so nothing in the process can change them;
* the key is the block's content address and its stored state's digest (``id``, ``state_digest``):
  the same key can only mean the same bytes, whichever store holds the block;
* a hit still asks the store for the block (a forgotten block is not grafted from RAM) and checks the
  engine's fingerprint against it, as every read does (`load_state`);
* bounded: at most ``GRAFTMEM_HOT_TIER_MB`` MiB of states (default 512; 0 turns it off), least recently
  used out first; a state larger than a quarter of the bound is never kept.

A read admits a state on its second read within the recently seen keys (a block grafted once is not
worth a 69 MB copy); a writer admits the state it just stored at once (the next turn grafts it).
Entries live in this process only; a new process starts empty.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Optional

from ..core.blocks import Block
from ..core.errors import ConfigError

__all__ = ["DEFAULT_HOT_TIER_MB", "HOT_TIER_ENV", "HotTier", "configure_hot_tier", "hot_key", "hot_tier"]

log = logging.getLogger("graftmem")

#: The setting: MiB of block states this process keeps in RAM (0: none).
HOT_TIER_ENV = "GRAFTMEM_HOT_TIER_MB"
DEFAULT_HOT_TIER_MB = 512
#: Keys of states read once, remembered so a second read admits the state (~100 bytes each).
_SEEN_MAX = 1024

HotKey = tuple[str, str]


def hot_key(block: Block) -> HotKey:
    """The key of a block's loaded state: its content address and its stored state's digest."""
    return (block.id, block.state_digest)


class HotTier:
    """A bounded LRU of loaded block states (read-only buffers), safe for several threads."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ConfigError(f"the hot tier's size must be >= 0 bytes, not {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._states: "OrderedDict[HotKey, memoryview]" = OrderedDict()
        self._seen: "OrderedDict[HotKey, None]" = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._states)

    def _fits(self, size: int) -> bool:
        return 0 < size <= self.max_bytes // 4

    def get(self, key: HotKey) -> Optional[memoryview]:
        """The state kept under ``key`` (read-only), or None."""
        with self._lock:
            got = self._states.get(key)
            if got is None:
                self.misses += 1
                return None
            self._states.move_to_end(key)
            self.hits += 1
            return got

    def offer(self, key: HotKey, state: memoryview) -> None:
        """A state just read and checked: kept (copied) if this key was read before, else only noted."""
        if not self._fits(len(state)):
            return
        with self._lock:
            if key in self._states:
                return
            if key not in self._seen:
                self._seen[key] = None
                while len(self._seen) > _SEEN_MAX:
                    self._seen.popitem(last=False)
                return
        self.put(key, memoryview(bytes(state)))  # the copy outside the lock

    def put(self, key: HotKey, state: memoryview | bytes) -> None:
        """Keep ``state`` (made read-only; the caller never writes it again) under ``key``."""
        view = memoryview(state).toreadonly()
        if not self._fits(view.nbytes):
            return
        with self._lock:
            old = self._states.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._seen.pop(key, None)
            self._states[key] = view
            self.bytes += view.nbytes
            while self.bytes > self.max_bytes:
                _, out = self._states.popitem(last=False)
                self.bytes -= out.nbytes

    def clear(self) -> None:
        with self._lock:
            self._states.clear()
            self._seen.clear()
            self.bytes = 0


def _from_env() -> int:
    raw = os.environ.get(HOT_TIER_ENV, "").strip()
    if not raw:
        return DEFAULT_HOT_TIER_MB << 20
    try:
        mb = int(raw)
    except ValueError:
        mb = -1
    if mb < 0:
        raise ConfigError(f"{HOT_TIER_ENV}={raw!r}: give the MiB of block states to keep in RAM, an integer >= 0 "
                          f"(0 turns the hot tier off; default {DEFAULT_HOT_TIER_MB})")
    return mb << 20


_tier: Optional[HotTier] = None
_tier_lock = threading.Lock()


def hot_tier() -> HotTier:
    """This process's hot tier (sized by ``GRAFTMEM_HOT_TIER_MB`` on first use)."""
    global _tier
    with _tier_lock:
        if _tier is None:
            _tier = HotTier(_from_env())
        return _tier


def configure_hot_tier(max_bytes: int) -> HotTier:
    """Resize this process's hot tier to ``max_bytes`` (0: off), emptying it (the code's way to set what
    ``GRAFTMEM_HOT_TIER_MB`` sets; the tests turn it on and off with it)."""
    global _tier
    with _tier_lock:
        _tier = HotTier(max_bytes)
        return _tier
