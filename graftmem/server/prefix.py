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
grafted on the next call, and after a restart too. Learning costs no second prefill: the states are
those of the cells the request (or the previous request, whose cells it kept in RAM) computed anyway
(`graftmem.server.generate`: cut out of one capture after the answer, or captured at the prefix's end
on a sliding-window model), and they are written by the cache's writer thread (`store_later()`) after
the request has released its engine, so neither the answer nor the next request waits for the writes.

A prefix the client marked (Anthropic's ``cache_control``, `graftmem.server.anthropic`) is learned the
same way at its first sighting, its last message included, if it is at least ``min_tokens`` long.

Storage: a chained automatic block is stored ``"full"`` by default (its whole state, not a delta over
its parent): a delta chain is rebuilt level by level on every graft, each level merged and its full
state hashed again, which costs hundreds of milliseconds per level at a few thousand tokens, while a
full block is one read and one check. ``auto_storage="delta"`` trades that time for disk.

Retention: the automatic blocks (and only those: a block a user learned is never touched) are kept
under ``max_auto_bytes`` of stored state; past it, the least recently used *leaf* auto block is deleted
first (a chain shrinks from its end, so no remaining block loses its parent), "used" meaning grafted
by this process, else learned.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from ..core.blocks import PROVENANCE_LOCAL, Block, Fingerprint
from ..core.identity import Salts, block_id_for, check_block_id, incompatibility
from ..core.format import paced, state_digest
from ..core.errors import ConfigError, GraftmemError
from ..memory.router import AUTO_KIND
from ..memory.access import cache_tenant, owner_of
from ..memory.verbs import first_untrusted
from ..store.chain import admit_written, chain_of, full_state, make_delta

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.protocol import BlockStore

__all__ = ["AUTO_KIND", "PrefixCache", "Match", "key_states", "prefix_keys", "segment_ends"]

log = logging.getLogger("graftmem")

_MAX_SIGHTINGS = 4096

#: Learned prefixes waiting for the writer thread (each holds one copy of a request's cells): a request
#: that finds the queue full waits for room while it still holds its engine (back-pressure on a writer
#: that cannot keep up), so the states held in RAM stay bounded.
MAX_PENDING_STORES = 2

#: Seconds the writer waits for the engines to stop computing before it cuts, hashes and writes a
#: learned prefix anyway (`PrefixCache.computing`): a prefix becomes findable within about this long
#: even on a server that never goes quiet.
WRITER_MAX_WAIT = 5.0


def prefix_keys(segments: Sequence[Sequence[int]], tenant: Optional[str] = None, *,
                after: "Optional[hashlib._Hash]" = None) -> list[bytes]:
    """``keys[k]`` is the key of the first ``k + 1`` segments (each hashed with its length). ``tenant``
    salts every key: one tenant's prefixes are found only under its own keys (`graftmem.server.tenants`);
    None is the shared space (the operator's blocks, every block of a server without tenants). A chain
    is indexed under the keys of the one tenant it names (`graftmem.memory.access.cache_tenant`: blocks
    that tenant owns, learned or automatic, or shared), so a block another tenant shared never answers
    a prompt: sharing guesses of a tenant's system prompt would tell which one it sent.

    ``after``: the hash state after earlier segments (`key_states`), which ``segments`` continue; a
    request computes its prompt's states once (`graftmem.server.generate.Job.keys`) and continues them
    for what it appends (a stored response's answer) instead of hashing its prompt again."""
    return [h.digest() for h in key_states(segments, tenant, after=after)[1:]]


def _shared_keys(segments: Sequence[Sequence[int]], keys: Sequence[bytes], tenant: Optional[str],
                 shared: Optional[Sequence[bytes]]) -> Sequence[bytes]:
    """The unsalted keys (the operator's blocks) of the first ``len(keys)`` segments, beside a tenant's
    salted ``keys``: ``shared`` if the caller has them (a request's `Job.shared_keys`), hashed otherwise;
    without a tenant the keys are the shared ones."""
    if tenant is None:
        return keys
    return prefix_keys(segments[:len(keys)]) if shared is None else shared[:len(keys)]


def key_states(segments: Sequence[Sequence[int]], tenant: Optional[str] = None, *,
               after: "Optional[hashlib._Hash]" = None) -> "list[hashlib._Hash]":
    """The hash states of `prefix_keys`: ``states[k]`` after the first ``k`` segments (``states[0]``:
    before any, the tenant's salt or ``after`` only). The one place a prompt's token ids are hashed."""
    if after is not None:
        h = after.copy()
    else:
        h = hashlib.sha256(b"graftmem-prefix-v1")
        if tenant is not None:
            h.update(b"\0tenant\0" + tenant.encode("utf-8") + b"\0")
    out = [h.copy()]
    for seg in segments:
        h.update(len(seg).to_bytes(4, "little"))
        h.update(struct.pack(f"<{len(seg)}i", *seg))  # each id as 4 little-endian signed bytes
        out.append(h.copy())
    return out


def segment_ends(segments: Sequence[Sequence[int]]) -> list[int]:
    """``ends[k]`` is the number of tokens in the first ``k + 1`` segments."""
    out, n = [], 0
    for seg in segments:
        n += len(seg)
        out.append(n)
    return out


@dataclass(frozen=True)
class Match:
    """A stored block holding the request's first ``n_segments`` segments (``n_tokens`` token ids);
    ``chain`` is its chain (root first), ``untrusted`` the link of it that needs consent (None: none)."""

    block: Block
    n_segments: int
    n_tokens: int
    chain: tuple[Block, ...] = ()
    untrusted: Optional[Block] = None


def auto_name(engine: "Engine", tokens: Sequence[int]) -> str:
    """A readable name for an automatic block: ``auto:`` and the start of its text as the user wrote it.

    Why: the segment's text is the rendered template (``<|im_start|>system ...``); named from it, `graftmem
    ls` showed the template's markers instead of the conversation. The tokens are spelled without their
    control tokens (`Engine.detokenize` skips them), whitespace folded, cut at 40 characters (no
    space left at the cut: a page shows the name as text, trimmed)."""
    words = " ".join(engine.detokenize(tokens).split())
    return f"auto: {words[:40].rstrip()}" if words else "auto"


class PrefixCache:
    """The prefix index over one store, for one engine fingerprint, plus the auto-learn policy."""

    def __init__(self, store: "BlockStore", fingerprint: Fingerprint, *, min_tokens: int = 256,
                 sightings: int = 2, learn: bool = True, max_auto_bytes: Optional[int] = 2 << 30,
                 auto_storage: str = "full", tenants: int = 1) -> None:
        if auto_storage not in ("full", "delta"):
            raise ConfigError(f"auto_storage must be 'full' or 'delta', got {auto_storage!r}")
        self.store, self.fingerprint = store, fingerprint
        self.auto_storage = auto_storage
        self.max_auto_bytes = max_auto_bytes
        #: how many tenants share ``max_auto_bytes``: each keeps its automatic blocks under its share,
        #: and storing evicts only the storing tenant's (one tenant cannot evict another's)
        self.tenants = max(1, tenants)
        self._used: dict[str, float] = {}
        self.min_tokens, self.sightings, self.learn_enabled = min_tokens, sightings, learn
        self._digest = fingerprint.digest()
        self._lock = threading.RLock()
        self._index: dict[bytes, str] = {}
        self._seen: "OrderedDict[bytes, int]" = OrderedDict()
        self._refused: set[str] = set()
        self.refusals = 0  #: blocks that failed a check when grafted or warmed (`refuse`), for /metrics
        self._version: Optional[tuple[int, int]] = None
        #: prefixes handed to the writer (`store_later`) and not stored yet: not learned a second time
        self._pending: dict[bytes, int] = {}
        self._writes: "queue.Queue[tuple]" = queue.Queue(maxsize=MAX_PENDING_STORES)
        self._writer: Optional[threading.Thread] = None
        self._unfinished = 0
        self._idle = threading.Condition(self._lock)
        self._computing = 0  #: requests computing on an engine now (`computing`)
        self._pressing = 0   #: requests waiting for room in the writer's queue
        self._quiet = threading.Condition(self._lock)
        self.writer_max_wait = WRITER_MAX_WAIT
        self.deferred_writes = 0  #: learned prefixes whose writing waited for a request to finish, for /metrics
        #: told of every block stored or evicted here (`graftmem.server.fleet.KvEvents`: ``/v1/kv_events``)
        self.events: Optional[Any] = None

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
                if b.fingerprint.digest() != self._digest or not self._same_threads(b):
                    continue
                try:
                    chain = chain_of(self.store, b)
                except GraftmemError as exc:
                    log.warning("prefix cache: block %s left out: %s", b.short_id, exc)
                    continue
                found, who = cache_tenant(chain)  # a chain naming two tenants is no prompt's
                if found:
                    index[prefix_keys([c.tokens for c in chain], who)[-1]] = b.id
            self._index, self._version = index, now

    def _same_threads(self, block: Block) -> bool:
        """Whether a block with cells of one-token calls recorded this engine's thread count for them (the
        one rule is `incompatibility`): another count's block is as invisible as another fingerprint's."""
        return block.one_token_from is None or incompatibility(block, self.fingerprint) is None

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, segments: Sequence[Sequence[int]], keys: Optional[Sequence[bytes]] = None, *,
               allow_unverified: bool = False, tenant: Optional[str] = None,
               shared: Optional[Sequence[bytes]] = None) -> Optional[Match]:
        """The longest indexed prefix of ``segments`` that leaves at least one segment to prefill.
        ``keys``: the prompt's `prefix_keys()`, if the caller has them already (they are cumulative, so
        the first ``k`` keys of the whole prompt are the keys of its first ``k`` segments).

        A block whose chain holds a block nothing here vouches for (``unverified``: imported without
        re-derivation, dropped into the store) is passed over, shorter prefixes tried instead, unless
        ``allow_unverified`` (the caller's consent, `graftmem.memory.verbs`): such a state may not be
        its text's, and a forged system prompt would answer every client.

        ``tenant``: the requester (``keys``, if given, are its salted keys); its own prefixes (automatic,
        learned, or shared by it) and the operator's (``shared``: the unsalted keys, if the caller has
        them) are found, never one another tenant owns or shared."""
        self.refresh()
        keys = (prefix_keys(segments, tenant) if keys is None else keys)[:len(segments) - 1]
        shared = _shared_keys(segments, keys, tenant, shared)
        with self._lock:
            for k in range(len(keys), 0, -1):
                bid = self._index.get(keys[k - 1]) or self._index.get(shared[k - 1])
                if bid is None or bid in self._refused:
                    continue
                try:
                    block = self.store.get(bid)
                    chain = chain_of(self.store, block)
                except GraftmemError:
                    continue
                untrusted = first_untrusted(chain)
                if untrusted is not None and not allow_unverified:
                    continue
                now = time.time()
                for b in chain:
                    self._used[b.id] = now
                return Match(block, k, sum(len(s) for s in segments[:k]), tuple(chain), untrusted)
        return None

    def used_at(self, block: Block) -> tuple[float, bool]:
        """When ``block`` was last used, as eviction reads it: (seconds since the epoch, whether this process
        saw it used: grafted, or learned, here; False: not since the server started, the time is its creation)."""
        with self._lock:
            at = self._used.get(block.id)
        return (at, True) if at is not None else (block.created_at.timestamp(), False)

    def touch(self, block_ids: Sequence[str]) -> None:
        """Mark blocks used now (for least-recently-used eviction): a chain grafted without a lookup."""
        now = time.time()
        with self._lock:
            for b in block_ids:
                self._used[b] = now

    def refuse(self, block_id: str, why: str) -> None:
        """Stop using ``block_id`` in this process (it failed its checks); the store is left as it is."""
        with self._lock:
            self._refused.add(block_id)
            self.refusals += 1
        log.warning("prefix cache: block %s refused, the request is served cold: %s", block_id[:12], why)

    # ------------------------------------------------------------------ learning
    def learn_target(self, segments: Sequence[Sequence[int]], tail: int = 2,
                     keys: Optional[Sequence[bytes]] = None, tenant: Optional[str] = None,
                     marks: Sequence[int] = (), shared: Optional[Sequence[bytes]] = None) -> int:
        """How many segments of this prompt to learn (0: none), decided before the prompt is prefilled.

        Every prefix of the prompt up to the start of its last message is counted as seen once; the
        answer is the longest such prefix that is long enough, not stored yet, and seen ``sightings``
        times. Counting every prefix (not only the whole conversation so far) is what makes an agent's
        stable part learned within its first session: turn 2 re-sends turn 1's system prompt and tools
        (their second sighting, learned then), turn 3 re-sends turn 2's messages, and so on.

        ``tail``: how many final segments are never learned (2 for a chat whose generation header is a
        segment of its own: the last turn and the header; 1 for a chat whose header joined the last turn,
        `graftmem.core.segments._header_cuts`: the header's last token; 1 for a raw completion prompt: its
        last chunk).

        ``marks``: prefixes (counts of segments, the last one excluded) the client asked to be stored
        (Anthropic's ``cache_control``): one that is not stored yet and at least ``min_tokens`` long is
        learned at its first sighting, the last message included (Anthropic, too, caches nothing
        shorter than a minimum). With learning off (``serve --no-learn``) nothing is stored, marked or not.

        On a fleet store the sightings are the fleet's, counted in the bucket, and a due prefix is learned
        only under this worker's lease of it (`graftmem.store.fleet.sightings`): one worker learns it,
        whichever workers saw it."""
        if not self.learn_enabled:
            return 0
        auto = max(0, len(segments) - tail) if len(segments) >= tail + 1 else 0
        wanted = {k for k in marks if 0 < k < len(segments)}
        top = max([auto, *wanted])
        if top == 0:
            return 0
        keys = (prefix_keys(segments, tenant) if keys is None else keys)[:top]
        shared = _shared_keys(segments, keys, tenant, shared)
        lengths = [0, *segment_ends(segments[:top])]
        best = 0
        fleet = getattr(self.store, "sightings", None)  # a fleet store counts sightings in its bucket
        todo: list[tuple[int, bytes]] = []
        with self._lock:
            for k, key in enumerate(keys, start=1):
                if key in self._index or shared[k - 1] in self._index or key in self._pending:
                    continue
                if k in wanted and lengths[k] >= self.min_tokens:
                    best = max(best, k)
                if k > auto:
                    continue
                if fleet is not None:
                    if lengths[k] >= self.min_tokens:
                        todo.append((k, key))
                    continue
                n = self._seen.pop(key, 0) + 1
                self._seen[key] = n
                if n >= self.sightings and lengths[k] >= self.min_tokens:
                    best = max(best, k)
            while len(self._seen) > _MAX_SIGHTINGS:
                self._seen.popitem(last=False)
        if fleet is not None:  # off the lock: bucket calls (graftmem.store.fleet.sightings)
            return fleet.learn_target(todo, self.sightings, best, list(keys))
        return best

    def store_captured(self, engine: "Engine", segments: Sequence[Sequence[int]], texts: Sequence[str],
                       first: int, states: Sequence[bytes], start: Optional[Match],
                       tenant: Optional[str] = None, *, metadata: Optional[dict[str, Any]] = None,
                       response: Optional[str] = None, evict: bool = True,
                       calls: Sequence[Optional[dict[str, int]]] = (),
                       keys: Optional[Sequence[bytes]] = None) -> Optional[Block]:
        """Store segments ``first .. first + len(states) - 1`` of a served request as a chain, from the
        states the request captured after prefilling each of them (no second prefill: learning costs
        a copy and a write, after the answer). ``start`` is the grafted block they continue, if any.

        Each state is exactly what [`prefill_and_store()`][graftmem.memory.learn.prefill_and_store]
        computes for the same block (the same prefill calls after the same grafted or prefilled
        parent), so a block written here is the block the learn path would have written.

        ``tenant`` owns what is stored: its name is in each block's metadata, mixed into each block's id
        (two tenants sending the same prompt get two blocks: neither can read, delete or evict the
        other's) and into its index key. ``metadata`` is added to each block's, and ``response`` (the id of
        the stored response in ``metadata["response"]``) mixed into each id (a stored response's block is
        its own, `graftmem.server.responses`, even when another response generated the same tokens).
        ``calls[j]``: what state ``j``'s cells record of their one-token calls (`Engine.one_token_calls`,
        taken when the state was captured), if any. Every salt goes through `block_id_for` and is recorded
        in the block (`graftmem.core.identity`), so the block leaves this store as it is. ``keys``: the
        `prefix_keys()` of ``segments`` (at least of its first ``first + len(states)``), if the caller has
        them (a request's `Job.keys`)."""
        parent = start.block if start is not None and first > 0 else None
        pfull: Optional[bytes] = full_state(self.store, parent, fingerprint=self.fingerprint) \
            if parent is not None and self.auto_storage == "delta" else None
        n = first + len(states)
        keys = prefix_keys(segments[:n], tenant) if keys is None or len(keys) < n else list(keys[:n])
        ids: list[str] = []
        try:
            for i in range(first, first + len(states)):
                tokens = list(segments[i])
                own = calls[i - first] if i - first < len(calls) else None  # its one-token calls, if any
                salts = Salts(tenant=tenant, response=response, one_token_threads=own["threads"] if own else None)
                bid = block_id_for(self.fingerprint, tokens, parent.id if parent is not None else None, salts)
                full: Optional[bytes] = None  # ``states`` may cut it on demand: only when it is needed
                if self.store.contains(bid):
                    block = self.store.get(bid)
                else:
                    full = states[i - first]
                    fields: dict[str, Any]
                    if parent is None:
                        fields = {"state_size": len(full), "state_digest": state_digest(full)}
                        data: bytes = full
                    else:
                        digest = state_digest(full)
                        fields = {"parent": parent.id, "pos_start": parent.pos_end,
                                  "full_state_size": len(full), "full_state_digest": digest}
                        delta = make_delta(pfull, full, parent.pos_end) if pfull is not None else None
                        data = full if delta is None else delta
                        fields.update(storage="full" if delta is None else "delta", state_size=len(data),
                                      state_digest=digest if delta is None else state_digest(data))
                    block = Block(id=bid, name=auto_name(engine, tokens), kind=AUTO_KIND,
                                  text=texts[i], tokens=tokens, n_tokens=len(tokens), fingerprint=self.fingerprint,
                                  metadata=salts.stamp({"segment": i, **(metadata or {}),
                                                        **({"one_token_calls": own} if own else {})}),
                                  **fields)
                    check_block_id(block)
                    block = self.store.put(block, memoryview(data), provenance=PROVENANCE_LOCAL,
                                           labels_trusted=True)
                    admit_written(block, full)  # the next turn grafts it from RAM (``full`` is never written again)
                with self._lock:
                    self._index[keys[i]] = block.id
                    self._used[block.id] = time.time()
                ids.append(block.id)
                if self.auto_storage == "delta" and full is None:
                    full = states[i - first]
                parent, pfull = block, (full if self.auto_storage == "delta" else None)
        except GraftmemError as exc:
            log.warning("prefix cache: storing a %d-segment prefix failed: %s", first + len(states), exc)
            return None
        with self._lock:
            self._version = self._current()
        if self.events is not None and ids:
            self.events.stored(keys[first:], ids, keys[first - 1] if first else None,
                               sum(len(s) for s in segments[:first + len(states)]))
        log.info("prefix cache: learned a %d-token prompt prefix as block %s",
                 sum(len(s) for s in segments[:first + len(states)]), parent.short_id if parent else "-")
        if evict:
            self.evict(tenant)
        return parent

    def store_later(self, engine: "Engine", segments: Sequence[Sequence[int]], texts: Sequence[str],
                    first: int, states: Sequence[bytes], start: Optional[Match],
                    tenant: Optional[str] = None, calls: Sequence[Optional[dict[str, int]]] = (),
                    keys: Optional[Sequence[bytes]] = None) -> None:
        """`store_captured()` on the cache's writer thread, so that the request's engine is free for the
        next request while the blocks are cut, hashed and written (measured: ~0.4 s per turn for a
        3,000-token SmolLM2 prefix, which the next turn of the same agent used to wait for). Until
        then its prefixes count as learned for `learn_target()` (no second copy is taken) but are not
        found by `lookup()`: the next request reuses the same cells from RAM. `flush()` waits for
        what is queued (graceful shutdown, `ChatPipeline.wait_idle`). ``keys``: as `store_captured()`'s."""
        n = first + len(states)
        every = prefix_keys(segments[:n], tenant) if keys is None or len(keys) < n else list(keys[:n])
        keys = every[first:]
        with self._lock:
            for k in keys:
                self._pending[k] = self._pending.get(k, 0) + 1
            self._unfinished += 1
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="graftmem-prefix-writer", daemon=True)
                self._writer.start()
            full = self._writes.full()
            if full:  # the writer stops waiting for a quiet moment: a request is waiting for it
                self._pressing += 1
                self._quiet.notify_all()
        try:
            self._writes.put((engine, segments, texts, first, states, start, tenant, keys, calls, every))
        finally:
            if full:
                with self._lock:
                    self._pressing -= 1

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Held by a request while it computes on an engine (prefill and decode). The writer starts no
        cut, hash or write meanwhile, unless a request waits for room in its queue or it has waited
        ``writer_max_wait`` seconds: on a machine with few cores those writes took the cores from the
        engine's threads, which wait for each other at every step of a llama.cpp graph, so a write of a
        few tens of milliseconds of CPU held the next turn's prefill up far longer."""
        with self._lock:
            self._computing += 1
        try:
            yield
        finally:
            with self._lock:
                self._computing -= 1
                if not self._computing:
                    self._quiet.notify_all()

    def _is_quiet(self) -> bool:
        """No request computes, or one waits for room in the writer's queue (the caller holds the lock)."""
        return not self._computing or bool(self._pressing)

    def _wait_for_quiet(self) -> None:
        """Block the writer while a request computes (see `computing`)."""
        with self._lock:
            if self._is_quiet():
                return
            self.deferred_writes += 1
            self._quiet.wait_for(self._is_quiet, timeout=self.writer_max_wait)

    def _quiet_until(self, deadline: float) -> None:
        """The pacer of the writer's block writes (`graftmem.core.format.paced`): wait while a request
        computes, until ``deadline`` (`writer_max_wait` after the write began), then no more."""
        with self._lock:
            left = deadline - time.monotonic()
            if left > 0 and not self._is_quiet():
                self._quiet.wait_for(self._is_quiet, timeout=left)

    def _write_loop(self) -> None:
        # below the engines' threads: on a machine with few cores the writes share them with the next
        # request's prefill, which a client is waiting for (Linux: a thread's nice value is its own)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5))
        while True:
            item = self._writes.get()
            engine, segments, texts, first, states, start, tenant, keys, calls, every = item
            try:
                self._wait_for_quiet()
                deadline = time.monotonic() + self.writer_max_wait
                with paced(functools.partial(self._quiet_until, deadline)):  # and between chunks of each file
                    self.store_captured(engine, segments, texts, first, states, start, tenant, calls=calls,
                                        keys=every)
            except Exception:  # a failed store loses a cache entry, never the server (logged with its traceback)
                log.exception("prefix cache: storing a learned prefix failed")
            finally:
                with self._lock:
                    for k in keys:
                        left = self._pending.get(k, 1) - 1
                        if left > 0:
                            self._pending[k] = left
                        else:
                            self._pending.pop(k, None)
                    self._unfinished -= 1
                    self._idle.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every prefix handed to `store_later()` is stored (or failed); False at ``timeout``."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._unfinished, timeout=timeout)

    def evict(self, tenant: Optional[str] = None) -> list[str]:
        """Delete ``tenant``'s least recently used leaf auto blocks until they fit its share of
        ``max_auto_bytes``; their ids. Another tenant's blocks are never touched."""
        if self.max_auto_bytes is None:
            return []
        budget = self.max_auto_bytes // self.tenants
        removed: list[str] = []
        with self._lock:
            autos = {b.id: b for b in self.store.list(kind=AUTO_KIND) if owner_of(b) == tenant}
            total = sum(b.state_size for b in autos.values())
            while total > budget and autos:
                leaves = [b for b in autos.values() if not self.store.children(b.id)]
                if not leaves:
                    break
                victim = min(leaves, key=lambda b: self.used_at(b)[0])
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
                if self.events is not None:
                    self.events.removed([k for k, v in self._index.items() if v in set(removed)], removed)
                self.refresh(force=True)
        return removed
