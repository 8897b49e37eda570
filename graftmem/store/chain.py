"""Chained blocks: a text learned on top of another block, and the state that holds both.

A child block C of a parent P holds C's own tokens (tokenized without BOS) at positions
``[P.pos_end, P.pos_end + len(C.tokens))``; its id hashes P's id, so the same text on another parent
is another block. Learning C grafts P (every digest checked), prefills C's tokens and captures the
full per-sequence state. That state is stored as a *delta*: only C's new cells plus, per cache
section, how many of P's cells it keeps (`graftmem.core.statefmt`). Before a delta is written,
``merge(P's full state, delta)`` is compared byte for byte with the captured state; if the layout
cannot be split, or the merge differs, the full state is stored instead and the log says why.

The exactness reference of a chain is the *sequential* fresh prefill: a cleared cache, then each
block's tokens prefilled in their own call, root first (exactly what learning the chain without
grafts computes). It is not, in general, one prefill of the concatenated tokens: on SmolLM2 the two
were equal at the lengths tests/test_chain.py uses but differ for other splits (54 + 20 tokens: KL
about 0.006, same argmax); on Gemma 3 270M (Q4_K_M) they differ, because the CPU's repacked Q4_K matrix kernels round the last
``n mod 4`` rows of a micro-batch differently, so a token's K/V bytes depend on where the micro-batch
boundaries fall. docs/exactness.md has the measurement.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from ..core.blocks import Block, Fingerprint
from ..core.errors import BlockCorrupted, ConfigError
from ..core.format import state_digest
from ..core.identity import incompatibility
from ..core import statefmt as _statefmt
from .hot import hot_key, hot_tier
if TYPE_CHECKING:
    from ..core.engine import Engine
    from .protocol import BlockStore

__all__ = ["chain_of", "calls_of", "CALLS_KEY", "segments", "full_tokens", "full_state", "load_state", "recheck", "admit_written", "make_delta", "capture_child", "MAX_DEPTH"]

log = logging.getLogger("graftmem")

#: A chain deeper than this is refused (each level costs a read and a merge at restore).
MAX_DEPTH = 64


def chain_of(store: "BlockStore", block: Block) -> list[Block]:
    """The blocks from the root to ``block`` (inclusive), checked for consistent positions."""
    out = [block]
    while out[-1].parent is not None:
        if len(out) > MAX_DEPTH:
            raise ConfigError(f"block {block.short_id} is chained more than {MAX_DEPTH} levels deep")
        parent = store.get(out[-1].parent)
        if out[-1].pos_start != parent.pos_end:
            raise BlockCorrupted(f"block {out[-1].short_id} starts at position {out[-1].pos_start} but its "
                                 f"parent {parent.short_id} ends at {parent.pos_end}")
        out.append(parent)
    if out[-1].pos_start != 0:
        raise BlockCorrupted(f"root block {out[-1].short_id} starts at position {out[-1].pos_start}, not 0")
    return out[::-1]


#: The metadata key of a block whose own cells were computed in several calls (a stored response: its
#: prompt's segments, then one call per generated token, `graftmem.server.responses`): their sizes.
CALLS_KEY = "calls"


def calls_of(block: Block) -> list[list[int]]:
    """The token ids of each prefill call that computed ``block``'s own cells: the sizes its metadata
    records (``calls``: positive counts adding up to its tokens), else one call of all its tokens. A
    state computed one token at a time is not the state of one call of the same tokens (another kernel
    path), so re-deriving a stored response must replay its calls."""
    sizes = block.metadata.get(CALLS_KEY)
    if isinstance(sizes, list) and len(sizes) > 1 and all(type(n) is int and n > 0 for n in sizes) \
            and sum(sizes) == len(block.tokens):
        out, at = [], 0
        for n in sizes:
            out.append(list(block.tokens[at:at + n]))
            at += n
        return out
    return [list(block.tokens)]


def segments(store: "BlockStore", block: Block) -> list[list[int]]:
    """Token ids of each prefill call of the chain, root first: the prefill calls of the fresh reference
    (each block's tokens in their own call, or in the calls it records: `calls_of`)."""
    return [seg for b in chain_of(store, block) for seg in calls_of(b)]


def full_tokens(store: "BlockStore", block: Block) -> list[int]:
    """Every token id from position 0 to ``block.pos_end``."""
    return [t for seg in segments(store, block) for t in seg]


def _read_full(store: "BlockStore", block: Block, buffer: Callable[[int], memoryview],
               fingerprint: Optional[Fingerprint], timings: Optional[dict[str, float]] = None) -> memoryview:
    """The full state of ``block`` in ``buffer``; every stored digest on the chain checked."""
    if block.storage == "full":
        return store.read_state(block.id, buffer, fingerprint=fingerprint, timings=timings)[1]
    if block.parent is None or block.full_state_size is None or block.full_state_digest is None:
        raise BlockCorrupted(f"block {block.short_id} is stored as a delta without a parent or full digest")
    parent = store.get(block.parent)
    pstate = _read_full(store, parent, lambda n: memoryview(bytearray(n)), fingerprint, timings)
    _, delta = store.read_state(block.id, lambda n: memoryview(bytearray(n)), fingerprint=fingerprint,
                                timings=timings)
    t0 = time.perf_counter()
    out = buffer(block.full_state_size)
    try:
        _statefmt.merge(pstate, delta, out)
    except _statefmt.StateLayoutError as exc:
        raise BlockCorrupted(f"block {block.short_id}: its delta does not merge with parent "
                             f"{parent.short_id}: {exc}") from exc
    t1 = time.perf_counter()
    actual = state_digest(out)
    if timings is not None:  # the merge counts as placing cells, its digest as a check
        timings["place_ms"] = timings.get("place_ms", 0.0) + (t1 - t0) * 1e3
        timings["check_ms"] = timings.get("check_ms", 0.0) + (time.perf_counter() - t1) * 1e3
    if actual != block.full_state_digest:
        raise BlockCorrupted(f"block {block.short_id}: rebuilt state digest mismatch: expected "
                             f"{block.full_state_digest}, actual {actual}",
                             expected=block.full_state_digest, actual=actual)
    return out


def full_state(store: "BlockStore", block: Block, *, fingerprint: Optional[Fingerprint] = None) -> bytes:
    """The per-sequence state a full capture after the chain's prefill holds (a delta rebuilt), as
    new bytes; every digest checked. This is what provenance checks compare, byte for byte."""
    if block.parent is not None:
        chain_of(store, block)  # positions and depth
    return bytes(_read_full(store, block, lambda n: memoryview(bytearray(n)), fingerprint))


def load_state(store: "BlockStore", block_id: str, buffer: Callable[[int], memoryview], *,
               fingerprint: Optional[Fingerprint] = None,
               timings: Optional[dict[str, float]] = None, hot: bool = True) -> tuple[Block, memoryview]:
    """Read (and for a delta, rebuild) a block's full state into ``buffer``; check everything first.

    For a root block this is [`Store.read_state()`][graftmem.Store.read_state]. For a chained block, each ancestor's stored
    bytes and this block's delta are read with their digests checked, merged, and the merged bytes
    checked against ``full_state_digest``, all before anything is returned (so before llama.cpp).
    A chained state whose window cache was trimmed is then padded with masked placeholder cells
    (`place_cells()`) so that a restore keeps every cell at its fresh index;
    without that, Gemma 3 grafts differ from a fresh prefill for 1-token and >= 64-token queries.

    ``timings`` (optional) gets ``read_ms``, ``check_ms`` and ``place_ms`` added: where the time went
    ([`Receipt`][graftmem.Receipt]).

    A block in this process's hot tier (`graftmem.store.hot`; ``hot=False`` skips it) is returned from
    RAM instead, as a read-only view that is not in ``buffer``: the same bytes, checked when they were
    admitted; the block must still be in ``store`` and its fingerprint still match ``fingerprint``.
    """
    block = store.get(block_id)
    tier = hot_tier() if hot else None
    if tier is not None and tier.max_bytes:
        got = tier.get(hot_key(block))
        if got is not None:
            recheck(store, block, fingerprint)
            return block, got
    block, view = _load_state(store, block, buffer, fingerprint, timings)
    if tier is not None and tier.max_bytes:
        tier.offer(hot_key(block), view)
    return block, view


def recheck(store: "BlockStore", block: Block, fingerprint: Optional[Fingerprint]) -> None:
    """What a state already in memory (the hot tier's bytes, an engine's copy on the device) passes again
    on every graft, where a read from the store would check it: ``block`` (as ``store.get`` just gave it)
    still matches ``fingerprint`` and every ancestor of a chained block is still in ``store``."""
    if fingerprint is not None:
        err = incompatibility(block, fingerprint)
        if err is not None:
            raise err
    if block.parent is not None:
        chain_of(store, block)  # every ancestor still here, positions and depth


def admit_written(block: Block, state: memoryview | bytes) -> None:
    """Keep in the hot tier the state a writer just captured and stored for ``block`` (the full state
    for a delta block), handed over: the writer never writes ``state`` again. Skipped where a read
    would place window cells (the loaded state is then not the captured one)."""
    tier = hot_tier()
    if tier.max_bytes and not _needs_placing(memoryview(state)):
        tier.put(hot_key(block), state)


def _load_state(store: "BlockStore", block: Block, buffer: Callable[[int], memoryview],
                fingerprint: Optional[Fingerprint], timings: Optional[dict[str, float]]) -> tuple[Block, memoryview]:
    """`load_state` from the store: read, check, merge, place."""
    if block.parent is None:
        placing = _PLACING.get(block.fingerprint.model_sha256, False)
        if placing:
            # this model's roots needed placing before: read into scratch and place straight into
            # ``buffer`` (no copy of the stored bytes); a root that turns out not to need it is copied
            block, src = store.read_state(block.id, _scratch, fingerprint=fingerprint, timings=timings)
        else:
            block, src = store.read_state(block.id, buffer, fingerprint=fingerprint, timings=timings)
        t0 = time.perf_counter()
        try:
            if not _needs_placing(src, block.state_digest):
                if not placing:
                    return block, src
                out = buffer(len(src))
                out[:] = src
                return block, out
            if not placing:
                # first placed root of this model: the bytes sit in ``buffer``, which the placed
                # state is written to: move them to scratch (once; later roots read into scratch)
                _PLACING[block.fingerprint.model_sha256] = True
                scratch = _scratch(len(src))
                scratch[:] = src
                return block, _placed(scratch, block, buffer, fallback=src)
            return block, _placed(src, block, buffer, fallback=None)
        finally:
            if timings is not None:
                timings["place_ms"] = timings.get("place_ms", 0.0) + (time.perf_counter() - t0) * 1e3
    chain_of(store, block)  # positions and depth
    full = _read_full(store, block, lambda n: memoryview(bytearray(n)), fingerprint, timings)
    t0 = time.perf_counter()
    try:
        if _needs_placing(full):
            return block, _placed(full, block, buffer, fallback=None)
        out = buffer(len(full))
        out[:] = full
        return block, out
    finally:
        if timings is not None:
            timings["place_ms"] = timings.get("place_ms", 0.0) + (time.perf_counter() - t0) * 1e3


def _placed(state: memoryview, block: Block, buffer: Callable[[int], memoryview],
            fallback: Optional[memoryview]) -> memoryview:
    """``state`` with its window cells placed, written into ``buffer``; if the layout cannot be
    placed, the state as stored (``fallback``, or a copy in ``buffer``), with a warning: the restore
    then works but may not be byte-exact for every query length (receipts still hash the logits)."""
    try:
        return _statefmt.place_cells_into(state, block.pos_end, buffer)
    except _statefmt.StateLayoutError as exc:  # raised before ``buffer`` is touched
        log.warning("block %s: window cells not placed (%s); restoring the state as stored",
                    block.short_id, exc)
    if fallback is not None:
        return fallback
    out = buffer(len(state))
    out[:] = state
    return out


def _needs_placing(state: memoryview, digest: Optional[str] = None) -> bool:
    """Whether ``state``'s window cells must be placed (`graftmem.core.statefmt.needs_placing`).

    ``digest``: the state's checked digest, when the caller has one. The answer is a function of the
    bytes, so it is remembered by digest: parsing a 30-layer state to find out costs ~0.3 ms, a
    tenth of a hot restore's overhead over the raw read + set_data, on every graft of the same block."""
    if digest is not None:
        known = _PLACES.get(digest)
        if known is not None:
            return known
    try:
        needs = _statefmt.needs_placing(state)
    except _statefmt.StateLayoutError:  # a layout we do not parse is restored as stored
        needs = False
    if digest is not None:
        if len(_PLACES) >= 4096:  # bounded: forget everything (a re-parse costs a fraction of a ms)
            _PLACES.clear()
        _PLACES[digest] = needs
    return needs


#: `_needs_placing` by state digest (the answer depends on the bytes only, and they were checked)
_PLACES: dict[str, bool] = {}


_local = threading.local()
#: models (GGUF SHA-256) whose root blocks needed their window cells placed: read those into scratch
_PLACING: dict[str, bool] = {}


def _scratch(n: int) -> memoryview:
    """A per-thread reusable buffer (placing a window section needs the read bytes elsewhere)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = bytearray(n)
    return memoryview(buf)[:n]


def make_delta(parent_state: memoryview | bytes, full_state: memoryview | bytes,
               parent_end: int) -> Optional[bytes]:
    """The delta of ``full_state`` over ``parent_state``, or None when the layout cannot be split
    safely (then the caller stores the full state). A delta is only returned after
    ``merge(parent, delta)`` was compared with ``full_state`` byte for byte."""
    try:
        delta = _statefmt.split(parent_state, full_state, parent_end)
        rebuilt = _statefmt.merge(parent_state, delta)
    except _statefmt.StateLayoutError as exc:
        log.info("state layout not split (%s); storing the full state", exc)
        return None
    if rebuilt != bytes(full_state):
        log.warning("delta merge differs from the captured state; storing the full state")
        return None
    return delta


def capture_child(store: "BlockStore", engine: "Engine", parent: Block, tokens: list[int],
                  progress: Optional[Callable[[int], None]] = None) -> tuple[memoryview | bytes, dict]:
    """Graft ``parent``, prefill ``tokens`` after it and capture; return the bytes to store and
    the manifest fields that describe them (``storage``, sizes, digests). The caller holds
    ``engine.lock`` and resets the engine afterwards."""
    pstate = full_state(store, parent, fingerprint=engine.fingerprint)  # a copy: capture() reuses the buffer
    pview = memoryview(bytearray(pstate))
    try:
        placed = _statefmt.place_cells(pstate, parent.pos_end)
    except _statefmt.StateLayoutError:
        placed = b""
    if placed is None:
        engine.restore(pview, parent.pos_end, parent.one_token_from)
    elif placed:
        # the parent's window cache was trimmed: restore it with masked placeholders in front so
        # that every cell sits where a fresh prefill puts it (see _statefmt.place_cells)
        engine.restore(memoryview(bytearray(placed)), parent.pos_end, parent.one_token_from)
    else:
        log.info("block chained on %s: state layout not understood; re-prefilling the chain "
                 "(%d tokens) instead of grafting it", parent.short_id, parent.pos_end)
        engine.reset()
        for seg in segments(store, parent):
            engine.prefill(seg)
    engine.prefill(tokens, progress=progress)
    full = engine.capture()
    fields: dict = {"parent": parent.id, "pos_start": parent.pos_end,
                    "full_state_size": len(full), "full_state_digest": state_digest(full)}
    delta = make_delta(pstate, full, parent.pos_end)
    if delta is None:
        return full, {**fields, "storage": "full", "state_size": len(full),
                      "state_digest": fields["full_state_digest"]}
    log.info("chained block stored as a delta: %d of %d bytes (%.1f%%)", len(delta), len(full),
             100.0 * len(delta) / len(full))
    return delta, {**fields, "storage": "delta", "state_size": len(delta),
                   "state_digest": state_digest(delta)}
