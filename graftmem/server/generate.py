"""One request on one engine: graft the longest stored prefix, prefill the rest segment by segment,
decode with stop strings, stream the text out, then hand the prefix to the prefix cache's writer if it
keeps coming back.

Learning takes no second prefill and holds the engine for one copy at most. A prefix to learn is
decided before the prefill (`PrefixCache.learn_target`); its states are the cells this request holds
anyway, those it kept from the previous request included: on a model without a sliding window, one
copy of the engine's cells after the answer, each learned segment's state cut out of it on the
writer's thread (`graftmem.core.statefmt.cut`, byte-equal to a fresh capture: tests/test_state_cut.py);
on a sliding-window model (whose state past the window cannot be cut) and on a model with recurrent
layers (whose state holds only its last position: `graftmem.core.memkind`), a copy at each learned
segment's end, taken during the prefill this request runs anyway: the kept cells are trimmed to the
first one and captured there. The writer cuts, hashes and writes after the engine is released
(`PrefixCache.store_later`).

This is the engine side of the OpenAI-compatible routes; it runs in a worker thread and speaks to the
event loop only through ``emit`` (text deltas, then the result). Cache on or off, the prompt is
prefilled one segment per call (see `graftmem.server.chat`), so a request served from a grafted
prefix and the same request served cold compute the same bytes: grafting changes the time, never
the answer. A block that fails any check (digests, fingerprint, llama.cpp refusing the bytes) is
refused for the rest of the process, logged, and the request is served cold from an empty context.

In-RAM reuse (llama-server's slot reuse, with the same exactness argument as a graft): a request
leaves its prompt's cells in its engine (`Kept` describes them: the prompt's segment keys and ends);
the next request on that engine keeps the longest run of whole segments it shares with them, trims
the rest (the previous answer too) and prefills from there. Segment for segment the kept cells are
the cells a fresh prefill of the same calls computes, so, as for a graft at a segment boundary, the
answer's bytes do not change; only the time does. A model with recurrent layers cannot trim (its state
is the one after the last cell): there the kept cells are reused only when they end exactly where the
shared segments do (a warm start's graft, a stored response's end continued by the next turn), and
otherwise the request grafts the stored prefix instead. A stored block is grafted instead when it holds
more of the prompt, or when the request must learn a prefix that has to continue a stored chain.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from ..core import statefmt
from ..core.blocks import Receipt
from ..core.decoding import AnswerText, Sampling, decode
from ..core.engine import logits_sha256
from ..core.errors import GraftmemError
from ..core.grammar_limits import DEFAULT_GRAMMAR_LIMITS, GrammarLimits
from ..memory.access import cache_tenant
from ..memory.verbs import MemoryVerbs, first_untrusted, weakest_provenance
from ..store.chain import chain_of
from .prefix import AUTO_KIND, key_states, prefix_keys, segment_ends

if TYPE_CHECKING:
    import hashlib

    from ..core.engine import Engine
    from ..core.blocks import Block
    from .chat import TokenCache
    from .prefix import Match, PrefixCache

log = logging.getLogger("graftmem")

__all__ = ["EndState", "Job", "Kept", "Result", "run_job", "engine_fit", "kept_segments", "warm_engines", "MAX_CAPTURE_BYTES"]

#: States one request keeps in memory to learn its prefix; a longer new prefix is learned in part (a
#: contiguous chain from the grafted block) and the rest by the requests that follow.
MAX_CAPTURE_BYTES = 1 << 30


@dataclass
class Job:
    """What to compute. ``emit(kind, payload)`` receives ``("delta", (text, logprob entries))`` as text
    becomes final and ``("done", Result)`` once; ``cancel`` is set when the client went away."""

    segments: list[list[int]]
    texts: list[str]
    max_tokens: int
    sampling: Sampling
    stops: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    use_cache: bool = True
    emit: Optional[Callable[[str, Any], object]] = None
    cancel: threading.Event = field(default_factory=threading.Event)
    extra: Optional[dict[str, Any]] = None  #: added to the receipt (what routing chose)
    learn_tail: int = 2  #: final segments never learned (see `PrefixCache.learn_target`)
    #: prefixes (counts of segments) the client asked to be stored, at first sight (Anthropic's
    #: ``cache_control`` breakpoints; see `PrefixCache.learn_target`)
    marks: list[int] = field(default_factory=list)
    #: called in the worker once the prompt's start is restored and before its prefill, with the tokens
    #: restored (grafted or kept in RAM) and the tokens this request will write to new blocks (a stream's
    #: first event reports them: Anthropic's ``message_start``)
    on_start: Optional[Callable[[int, int], object]] = None
    #: the client's consent to graft blocks nothing here vouches for (``graftmem.allow_unverified``)
    allow_unverified: bool = False
    #: who asks (from the API key, `graftmem.server.tenants`): salts the prompt's keys, owns what it learns
    tenant: Optional[str] = None
    #: a GBNF grammar the answer must follow (``response_format``; `graftmem.memory.validate.response_format`)
    grammar: Optional[str] = None
    #: what ``grammar`` may cost (`graftmem.core.grammar_limits`; the server's `Limits.grammar`)
    grammar_limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS
    #: the texts of control tokens the answer shows (a family's markers, `graftmem.core.answers.AnswerSpec.specials`):
    #: written out in the streamed deltas and the final text alike, so the answer's parser sees them
    specials: frozenset[str] = frozenset()
    #: a stored chain this prompt continues (a Responses ``previous_response_id``): its blocks are the
    #: prompt's first ``base.n_segments`` segments and it is grafted (or found in RAM) instead of looked up
    base: Optional["Match"] = None
    #: keep the state after the answer's last token (`EndState`; a stored response's chain ends in it)
    capture_end: bool = False
    #: called in the worker with the result and the end state (None: not captured) before ``done`` is
    #: emitted, so a stored response exists before its client can name it in the next request
    on_end: Optional[Callable[["Result", Optional["EndState"]], None]] = None

    @functools.cached_property
    def _key_states(self) -> "list[hashlib._Hash]":
        return key_states(self.segments, self.tenant)

    @functools.cached_property
    def keys(self) -> list[bytes]:
        """The prompt's cumulative segment keys (`prefix_keys`), computed once per request: the prefix
        cache's lookup, what it learns and writes, and the cells an engine keeps all take these."""
        return [h.digest() for h in self._key_states[1:]]

    @functools.cached_property
    def shared_keys(self) -> list[bytes]:
        """The prompt's keys in the shared space (the operator's blocks), for a tenant's request: once too."""
        return self.keys if self.tenant is None else prefix_keys(self.segments)

    def keys_then(self, n: int, tokens: Sequence[int]) -> list[bytes]:
        """The keys of the prompt's first ``n`` segments and then ``tokens`` (a stored response's answer
        segment), continuing the request's hash state instead of hashing the prompt again."""
        return [*self.keys[:n], *prefix_keys([tokens], after=self._key_states[n])]

    def prefer(self, engine: "Engine") -> tuple[bool, int]:
        """The pool's engine choice for this request (`engine_fit`)."""
        return engine_fit(engine, self.keys, self.allow_unverified, self.use_cache)


@dataclass
class Result:
    text: str
    tokens: list[int]
    logprobs: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    receipt: Receipt
    #: the stop string that ended the answer, if one did (``finish_reason`` is then ``"stop"``)
    stop_sequence: Optional[str] = None
    #: prompt tokens this request hands to the prefix cache's writer as new blocks (beyond
    #: ``cached_tokens``: what Anthropic calls ``cache_creation_input_tokens``)
    created_tokens: int = 0


@dataclass
class EndState:
    """The cells after a request's last generated token, captured from the engine that generated them
    (never re-prefilled): ``parent`` is the stored chain that holds the prompt's first
    ``parent.n_segments`` segments (None: none, the state starts at position 0); ``tokens`` are the rest
    of the prompt and the generated tokens, prefilled in the calls ``calls`` lists (the prompt's
    segments, then one call per generated token, as the decode loop makes them)."""

    parent: Optional["Match"]
    tokens: list[int]
    text: str
    calls: list[int]
    state: bytes
    #: what the state records of its one-token calls (`Engine.one_token_calls`): the decoded tokens' at least
    one_token: Optional[dict[str, int]] = None


@dataclass(frozen=True)
class Kept:
    """What a request (or the warm start) left in an engine's cache for the next request there: the
    prompt's segments as cumulative keys (`graftmem.server.prefix.prefix_keys`) and the token count
    at the end of each; cells past the last end (the answer) are trimmed by whoever reuses them."""

    keys: tuple[bytes, ...]
    ends: tuple[int, ...]
    block_id: Optional[str] = None  #: the stored block these cells were grafted from, if any
    #: the provenance of the grafted block when it needs consent (``unverified``): then the cells hold a
    #: state nothing here vouches for, and only a request that consents may reuse them
    untrusted: Optional[str] = None
    #: the logits the call that computed the last segment returned (a copy), when these cells were left
    #: by the prompt itself: a request with exactly this prompt then prefills nothing and decodes from
    #: them (the bytes its own last call would compute: the same calls on the same cells). None: a
    #: request always prefills at least its last segment, as llama-server re-evaluates its last token.
    first: Optional[np.ndarray] = field(default=None, compare=False, repr=False)


def can_keep(engine: "Engine") -> bool:
    """Whether trimming this engine's cells back to a segment boundary gives the fresh state: not for an
    engine measured inexact, nor a sliding-window cache that drops cells (``swa_full=False``)."""
    return bool(engine.exactness.exact) and (engine.n_swa == 0 or engine.config.swa_full)


def kept_segments(engine: "Engine", keys: Sequence[bytes], allow_unverified: bool = False) -> int:
    """How many leading segments of a prompt with ``keys`` this engine's kept cells hold: all but the
    last, which a request prefills to get its first logits, unless the cells were left by exactly this
    prompt with those logits (`Kept.first`: all of them); none when they hold an unverified block's
    state and the request did not consent."""
    kept = engine.kept
    if not isinstance(kept, Kept) or (kept.untrusted is not None and not allow_unverified):
        return 0
    if kept.first is not None and len(kept.keys) == len(keys) and kept.keys[-1] == keys[-1]:
        n = len(keys)  # the whole prompt, with its first logits (`Kept.first`)
    else:
        n = min(len(kept.keys), len(keys) - 1)
        while n > 0 and kept.keys[n - 1] != keys[n - 1]:  # a key covers every segment before it too
            n -= 1
    if n and not engine.memory.trims and kept.ends[n - 1] != engine.n_past:
        return 0  # recurrent layers: only cells that END there are that prefix's state (no trim)
    return n


def engine_fit(engine: "Engine", keys: Sequence[bytes], allow_unverified: bool = False,
               use_cache: bool = True) -> tuple[bool, int]:
    """How well a free engine suits a prompt with ``keys`` (the pool takes the highest, and among equals
    the least recently released: `graftmem.server.pool.EnginePool.acquire`): first whether the request
    loses nothing there (the engine is empty, or its kept cells are entirely a prefix of this prompt:
    the same conversation, extended, which replaces only the previous prompt's generation header), then
    the kept tokens it reuses minus those it throws away.

    Why not simply the engine holding most of the prompt (llama-server's slot choice by similarity):
    conversations that share a system prompt would take each other's engines, since the shared prompt
    is most of an early turn, and each would overwrite the other's history while another engine sat
    empty; then no conversation finds its turns in RAM (measured behind SMG, docs/fleet.md: half of the
    turns 2-5 before a kill were "ram", and those hits held the shared system prompt only). A new conversation pays the shared prompt
    once, and not even that once it is learned (a graft from the hot tier or the store); a
    conversation that finds its engine taken pays its whole history at every turn after."""
    kept = engine.kept if isinstance(engine.kept, Kept) else None
    if kept is None or not kept.keys:
        return True, 0
    n = kept_segments(engine, keys, allow_unverified) if use_cache else 0
    reused = kept.ends[n - 1] if n else 0
    if n and n >= len(kept.keys) - 1:
        # this conversation's own cells: all of the previous prompt but its last segment, which is the
        # generation header (or its last token: `graftmem.server.chat`), where the next turn has the answer
        return True, reused
    return False, reused - (kept.ends[-1] - reused)


#: The graft's phases a receipt carries (`graftmem.core.blocks.Receipt`): ``fetch_ms`` says the block
#: came from a fleet store's bucket (a cache miss), which `/metrics` counts apart.
_PHASES = ("fetch_ms", "read_ms", "check_ms", "place_ms", "set_data_ms")

#: Bytes of the warmed chains' other blocks that the warm start reads and checks (BLAKE3) ahead.
WARM_CHECK_BYTES = 1 << 30


def warm_engines(desks: Sequence[MemoryVerbs], cache: "PrefixCache", *, allow_unverified: bool = False,
                 check_bytes: int = WARM_CHECK_BYTES, tokens: Optional["TokenCache"] = None,
                 run: Optional[Callable[["Engine", Callable[[], None]], None]] = None) -> list[dict[str, Any]]:
    """Graft the most recently learned automatic prompt prefixes, one per engine (``desks``: the verbs of
    each pooled engine over the store), and keep them: a restarted server finds an agent's last
    conversation in RAM, as llama-server finds its slot's, instead of reading and checking it from disk
    on the first request. Each graft is checked (BLAKE3 on this process's first read) like any other; a
    block that fails is refused and skipped. A chain holding a block nothing here vouches for
    (``unverified``) is not warmed unless the operator consented (``allow_unverified``): the warm start
    is a graft like any other (`MemoryVerbs.graft`).
    Then the other blocks of those chains (the conversation's earlier turns, which the next requests
    graft once the first one has trimmed the engine's cells to its own prompt) are read and checked
    too, up to ``check_bytes``: their later grafts in this process check xxh3 only
    (`graftmem.store.verified`). The prefix index is built and, with ``tokens``, the chains' message
    texts are tokenized into that cache, so the first request does none of it either. ``run(engine, fn)``
    calls ``fn`` where that engine computes (the server's pool: the engine's own thread, so its first
    request finds llama.cpp's thread team built; `graftmem.server.pool`); None: here. Returns what each
    engine got (block id, tokens, milliseconds, provenance)."""
    cache.refresh()
    if not desks:
        return []
    store = desks[0].store
    engine0 = desks[0].engine
    digest = engine0.fingerprint.digest()
    autos = [b for b in store.list(kind=AUTO_KIND) if b.fingerprint.digest() == digest]
    leaves = sorted((b for b in autos if not store.children(b.id)), key=lambda b: b.created_at, reverse=True)
    chains: list[tuple["Block", list["Block"], Optional["Block"]]] = []
    for leaf in leaves:
        if len(chains) >= len(desks):
            break
        try:
            chain = chain_of(store, leaf)
        except GraftmemError as exc:
            cache.refuse(leaf.id, str(exc))
            continue
        if not cache_tenant(chain)[0]:  # no prompt's (`prefix_keys`): nothing would find its cells
            continue
        bad = first_untrusted(chain)
        if bad is not None and not allow_unverified:
            log.info("serve: warm start skips block %s: %s is %s (no consent)", leaf.short_id, bad.short_id,
                     bad.provenance)
            continue
        chains.append((leaf, chain, bad))
    done: list[dict[str, Any]] = []
    ahead: list["Block"] = []
    for desk, (block, chain, bad) in zip([d for d in desks if can_keep(d.engine)], chains):
        engine = desk.engine
        t0 = time.perf_counter()

        def warm(desk: MemoryVerbs = desk, engine: "Engine" = engine, block: "Block" = block,
                 chain: list["Block"] = chain, bad: Optional["Block"] = bad) -> None:
            with engine.session(keep=True):
                desk.graft(block, allow_unverified=allow_unverified, chain=chain)
                # one throwaway token after the grafted cells, then trimmed away: the first decode over a
                # context this long sizes llama.cpp's compute buffers and faults their pages in (measured:
                # a restarted server's first request prefilled its 4 tokens in 70-93 ms, later ones in 55);
                # not on a memory that cannot trim (recurrent layers): the graft alone is kept there
                if engine.memory.trims:
                    engine.prefill([int(block.tokens[-1])])  # the chain's last token again
                    engine.trim(block.pos_end)
                segs = [c.tokens for c in chain]
                owner = cache_tenant(chain)[1]  # the keys it is indexed under (`PrefixCache.refresh`)
                engine.kept = Kept(tuple(prefix_keys(segs, owner)), tuple(segment_ends(segs)), block.id,
                                   bad.provenance or "unverified" if bad is not None else None)

        try:
            if run is None:
                warm()
            else:
                run(engine, warm)
        except GraftmemError as exc:
            cache.refuse(block.id, str(exc))
            continue
        ahead += reversed(chain[:-1])  # the latest turns first: the likeliest to be grafted next
        if tokens is not None:
            for i, c in enumerate(chain):  # what the agent sends next starts with these texts
                tokens.tokenize(engine, c.text, i == 0)
        done.append({"block_id": block.id, "tokens": block.pos_end, "ms": round((time.perf_counter() - t0) * 1e3, 1),
                     "provenance": weakest_provenance(block, bad)})
        log.info("serve: warm start grafted %d tokens (block %s) in %.0f ms", block.pos_end, block.short_id,
                 done[-1]["ms"])
    engines = [d.engine for d in desks]
    t0, n, left = time.perf_counter(), 0, check_bytes
    seen: set[str] = set()
    for b in ahead:
        if b.id in seen or b.state_size > left:
            continue
        seen.add(b.id)
        try:
            with engines[0].lock:  # its buffer is the scratch space: no graft of another holder meanwhile
                store.read_state(b.id, engines[0].buffer, fingerprint=engines[0].fingerprint)
        except GraftmemError as exc:
            cache.refuse(b.id, str(exc))
            continue
        left -= b.state_size
        n += 1
    if n:
        log.info("serve: warm start checked %d more block(s), %d MB, in %.0f ms", n, (check_bytes - left) >> 20,
                 (time.perf_counter() - t0) * 1e3)
    return done


def _entry(engine: "Engine", tok: int, lp: float, top: Optional[list[tuple[int, float]]]) -> dict[str, Any]:
    """One token of OpenAI's ``logprobs.content``: its text, log-probability, bytes and alternatives."""
    def one(t: int, v: float) -> dict[str, Any]:
        b = engine.piece(t)
        return {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}

    return {**one(tok, lp), "top_logprobs": [one(t, v) for t, v in (top or [])]}


def cuts_states(engine: "Engine") -> bool:
    """Whether a request on ``engine`` learns its prefix from ONE capture of its cells after the answer,
    each learned segment's state cut out of it (`graftmem.core.statefmt.cut`): on a model without a
    sliding window, where every section of the state holds every position from 0. A sliding-window
    model's capture lacks the cells a shorter prefix's window holds once the sequence passes the
    window, and a recurrent layer's state holds only the last position (`graftmem.core.memkind`), so
    there the states are captured at each learned segment's end, during the prefill."""
    return engine.memory.cuts


class PrefixStates(Sequence[bytes]):
    """The states of a request's first segments (``ends``: the token count at each one's end), cut on
    demand out of one copy of the engine's cells taken after the answer: the engine is held for that
    copy only; the cuts (and whatever the store writes and hashes) happen on the store's thread."""

    def __init__(self, whole: "bytes | bytearray", ends: Sequence[int]) -> None:
        self.whole, self.ends = whole, list(ends)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return statefmt.cut(self.whole, self.ends[i])


def capture_prefixes(engine: "Engine", ends: Sequence[int]) -> Sequence[bytes]:
    """The states of the prefixes ending at ``ends`` of what the engine holds (`PrefixStates`); none
    if the capture is larger than `MAX_CAPTURE_BYTES` or cannot be cut (logged: nothing is learned, the
    answer is unaffected)."""
    whole = engine.capture_copy()  # its own buffer: capture() reuses the engine's
    if len(whole) > MAX_CAPTURE_BYTES:
        log.info("prefix cache: a %d MB state is over the capture limit: not learned", len(whole) >> 20)
        return []
    try:
        if statefmt.cuttable(statefmt.parse_state(whole)) < max(ends):
            raise statefmt.StateLayoutError("the state ends before the prefix to learn")
    except statefmt.StateLayoutError as exc:
        log.warning("prefix cache: the prefix's state cannot be cut out of the engine's cells: %s", exc)
        return []
    return PrefixStates(whole, ends)


def run_job(desk: MemoryVerbs, cache: Optional["PrefixCache"], job: Job) -> Result:
    """Compute ``job`` on ``desk``'s engine (which the caller holds exclusively); see the module
    docstring. Every graft goes through ``desk`` (consent first); cells that hold a state nothing here
    vouches for are reused only by a request that consents, and nothing is learned on top of them."""
    engine = desk.engine
    segs = job.segments
    caching = cache is not None and job.use_cache
    keep = caching and can_keep(engine)
    keys = job.keys
    ends = segment_ends(segs)
    n_prompt = ends[-1]
    consent = job.allow_unverified
    if job.base is not None:  # a stored response's chain: grafted as it is, never looked up
        match: Optional["Match"] = job.base
        caching = False  # a continued prompt is not learned as a prefix: its response chain is what stays
        keep = can_keep(engine)
    else:
        match = cache.lookup(segs, keys, allow_unverified=consent, tenant=job.tenant, shared=job.shared_keys) \
            if caching and cache is not None else None
    answer = AnswerText(_piece(engine, job.specials), job.stops)  # final text only: no half character, no partial stop
    entries: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # logprob entries not streamed yet

    def on_token(tok: int, lp: float, top: Optional[list[tuple[int, float]]]) -> Optional[str]:
        stopped = answer.add(tok)
        if job.logprobs:
            entries.append(_entry(engine, tok, lp, top))
            pending.append(entries[-1])
        if stopped:
            return "stop"
        if job.emit is not None:
            delta = answer.delta()
            if delta:
                job.emit("delta", (delta, pending[:]))
                pending.clear()
        if job.cancel.is_set():
            return "cancelled"
        return None

    with engine.session(resume=keep, keep=keep), (cache.computing() if cache is not None else nullcontext()):
        t0 = time.perf_counter()
        # the prefix to learn is decided before the prefill, so its states are captured on the way
        learn_k = cache.learn_target(segs, job.learn_tail, keys, job.tenant, job.marks, shared=job.shared_keys) \
            if caching and cache is not None else 0
        m = match.n_segments if match is not None else 0
        in_ram = kept_segments(engine, keys, consent) if keep else 0
        cut_later = learn_k > 0 and cuts_states(engine)
        if learn_k > m and not cut_later:  # what is learned continues the stored chain at m: keep no more
            in_ram = min(in_ram, m + 1)    # than its first segment, captured right after the trim below
        if in_ram and not engine.memory.trims and ends[in_ram - 1] != engine.n_past:
            in_ram = 0  # recurrent layers cannot be trimmed back: graft the stored prefix instead
        restored, first_seg, block_id, source = 0, 0, None, None
        phases: dict[str, float] = {}  #: where a graft's time went (read, check, a bucket's fetch, ...)
        untrusted: Optional[str] = None  #: provenance of an unverified state in the cells, if any
        provenance: Optional[str] = None
        kept_first: Optional[np.ndarray] = None
        if in_ram > 0 and in_ram >= m:
            kept = engine.kept if isinstance(engine.kept, Kept) else None
            if in_ram == len(segs) and kept is not None:
                kept_first = kept.first
            kept_block = kept.block_id if kept is not None else None
            untrusted = kept.untrusted if kept is not None else None
            restored = ends[in_ram - 1]
            engine.trim(restored)
            first_seg, source = in_ram, "ram"
            block_id = match.block.id if match is not None and in_ram == m else kept_block
            if match is not None and in_ram == m:
                provenance = weakest_provenance(match.block, match.untrusted)
            else:
                provenance = untrusted or "local"
        else:
            if engine.n_past:
                engine.reset()
            if match is not None:
                try:
                    desk.graft(match.block, allow_unverified=consent, chain=match.chain, timings=phases)
                    restored, first_seg, block_id, source = match.n_tokens, m, match.block.id, "store"
                    provenance = weakest_provenance(match.block, match.untrusted)
                    if match.untrusted is not None:
                        untrusted = provenance
                except GraftmemError as exc:
                    if job.base is not None:
                        raise  # a continued response has no other state to start from
                    assert cache is not None
                    cache.refuse(match.block.id, str(exc))
                    engine.reset()
                    match = None
        if untrusted is not None or (match is not None and match.untrusted is not None):
            learn_k = 0  # a chain learned from these cells (or on that block) would carry the unverified state
        learn_from = min(m, first_seg)  # the first segment learned (0: a refused graft starts the chain anew)
        t1 = time.perf_counter()
        if job.on_start is not None:
            job.on_start(restored, _new_tokens(segs, max(learn_from, first_seg), learn_k))
        captured: list[bytes] = []
        if learn_k > learn_from and not cut_later and first_seg == learn_from + 1:
            captured.append(engine.capture_copy())  # the kept cells end where the first learned segment does
        held = sum(map(len, captured))
        for i in range(first_seg, len(segs)):
            engine.prefill(segs[i])
            if not cut_later and i < learn_k and held < MAX_CAPTURE_BYTES and len(captured) == i - learn_from:
                captured.append(engine.capture_copy())  # its own buffer: capture() reuses the engine's
                held += len(captured[-1])
        # `engine.logits()` is a copy and `decode` never writes into its first logits: the same array can
        # be kept for the next request (and `Kept.first` is only ever read)
        first = engine.logits() if kept_first is None else kept_first
        t2 = time.perf_counter()
        grammar = engine.grammar(job.grammar, limits=job.grammar_limits) if job.grammar else None
        try:
            out = decode(engine, job.max_tokens, first_logits=first, sampling=job.sampling, on_token=on_token,
                         top_logprobs=job.top_logprobs if job.logprobs else 0, grammar=grammar)
        finally:
            if grammar is not None:
                grammar.close()
        t3 = time.perf_counter()
        states: Sequence[bytes] = captured
        if cut_later and learn_k > learn_from and out.finish_reason != "cancelled":
            states = capture_prefixes(engine, ends[learn_from:learn_k])
        # what each state records of its one-token calls: state j ends where segment learn_from + j does, and
        # the decode after the captures only added cells past the prompt, so the engine still knows it
        calls = [engine.one_token_calls(e) for e in ends[learn_from:learn_from + len(states)]]
        end: Optional[EndState] = None
        if job.capture_end and untrusted is None and can_keep(engine) and out.finish_reason in ("stop", "length") \
                and engine.n_past + 1 < engine.n_ctx:
            end = _capture_end(engine, segs, job.texts, match, n_prompt, list(out.tokens))
        if end is not None and keep:
            n = end.parent.n_segments if end.parent is not None else 0
            parts = [*segs[:n], end.tokens]
            engine.kept = Kept(tuple(job.keys_then(n, end.tokens)), tuple(segment_ends(parts)), None, None)
        elif keep:
            engine.kept = Kept(tuple(keys), tuple(ends), None, untrusted, first=first)
    text = answer.text
    rest = answer.delta(final=True)
    if job.emit is not None and (rest or pending):
        job.emit("delta", (rest, pending[:]))
    receipt = Receipt(block_id=block_id, tokens_restored=restored, tokens_prefilled=n_prompt - restored,
                      source=source, restore_ms=round((t1 - t0) * 1e3, 3) if source else 0.0,
                      prefill_ms=round((t2 - t1) * 1e3, 3), decode_ms=round((t3 - t2) * 1e3, 3),
                      decode_tokens=len(out.tokens), first_logits_sha256=logits_sha256(first),
                      exact=bool(engine.exactness.exact), cache=job.use_cache,
                      provenance=provenance if source else None, recall=(job.extra or {}).get("recall"),
                      **{k: round(v, 3) for k, v in phases.items() if k in _PHASES and source == "store"})
    stored = bool(states) and out.finish_reason != "cancelled"
    created = _new_tokens(segs, max(learn_from, first_seg), learn_from + len(states)) if stored else 0
    result = Result(text=text, tokens=list(out.tokens), logprobs=entries, finish_reason=out.finish_reason,
                    prompt_tokens=n_prompt, cached_tokens=restored, receipt=receipt, stop_sequence=answer.stopped_by,
                    created_tokens=created)
    if job.on_end is not None:
        try:
            job.on_end(result, end)
        except GraftmemError as exc:  # the answer stands; what it would have stored is lost (logged)
            log.warning("serve: storing a response failed: %s", exc)
    if job.emit is not None:
        job.emit("done", result)
    if stored:
        assert cache is not None
        cache.store_later(engine, segs, job.texts, learn_from, states, match, job.tenant, calls, keys=keys)
    return result


def _new_tokens(segs: Sequence[Sequence[int]], start: int, stop: int) -> int:
    """Tokens of segments ``start .. stop - 1``: those written to new blocks that were not restored (the
    segments between the stored chain and the cells kept in RAM are written too, but were not prefilled)."""
    return sum(len(s) for s in segs[start:stop])


def _capture_end(engine: "Engine", segs: Sequence[Sequence[int]], texts: Sequence[str], match: Optional["Match"],
                 n_prompt: int, generated: list[int]) -> Optional[EndState]:
    """The state after the last generated token: the decode loop evaluates every token but the last
    (it stops once it has picked it), so that one is evaluated here, in its own call as the loop would
    have. ``match`` (the grafted chain, or the one the kept cells equal) becomes the parent."""
    if engine.n_past == n_prompt + len(generated) - 1 and generated:
        engine.prefill([generated[-1]])
    if engine.n_past != n_prompt + len(generated):
        return None  # a stop string cut the answer: no state to keep
    first = match.n_segments if match is not None else 0
    rest = [list(s) for s in segs[first:]]
    tokens = [t for s in rest for t in s] + generated
    return EndState(parent=match, tokens=tokens, text="".join(texts[first:]) + answer_text_of(engine, generated),
                    calls=[len(s) for s in rest] + [1] * len(generated), state=bytes(engine.capture()),
                    one_token=engine.one_token_calls())


def _piece(engine: "Engine", specials: frozenset[str]) -> Callable[[int], bytes]:
    """A token's bytes in the answer: a control token's text where it is one of ``specials`` (a family's
    markers: ``[TOOL_CALLS]``, ``<|channel|>``, as llama-server's preserved tokens), else its piece."""
    if not specials:
        return engine.piece

    def piece(token: int) -> bytes:
        if engine.is_control(token) and (text := engine.token_text(token)) in specials:
            return text.encode()
        return engine.piece(token)
    return piece


def answer_text_of(engine: "Engine", tokens: Sequence[int]) -> str:
    """The generated tokens' text, as their bytes decode."""
    return b"".join(engine.piece(t) for t in tokens).decode("utf-8", "replace")


def check_fits(engine: "Engine", segments: Sequence[Sequence[int]], max_tokens: int) -> Optional[str]:
    """Why the prompt does not fit the context (None if it does)."""
    n = sum(len(s) for s in segments)
    if n + 1 > engine.n_ctx:
        return (f"this model's context is {engine.n_ctx} tokens; the prompt is {n} tokens. Shorten the "
                "messages or start the server with a larger n_ctx")
    return None
