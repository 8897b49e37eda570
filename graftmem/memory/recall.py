"""recall and search: route a task to ONE block, graft it, prefill only the task, answer.

Kept out of `graftmem.api.memory` so that ``Memory`` stays a thin coordinator, and so that a
``learn``/``ask`` user never imports the router (torch, faiss, MiniLM cost seconds to load).

Two answer paths over the same prompt, ``block.text + continuation``:

* ``graft``: restore the block's KV state at its own positions ([`Memory.ask()`][graftmem.Memory.ask]), prefill the
  continuation only;
* ``text``: the way without graftmem: tokenize the block's text again and prefill it, then the task.

Both hash the first-step logits, so any caller can see that they agree byte for byte; they do only when
the seam between block and continuation does not merge tokens (`split_ids()`),
which chat blocks guarantee and raw blocks may not: a merging seam is reported as ``receipt.exact=False``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Literal, Optional, Sequence

from ..core.blocks import Block, Fingerprint, Recall, Receipt, SearchHit
from ..core.decoding import GREEDY, Sampling
from ..core.errors import BlockNotFound, ConfigError
from ..core.identity import same_settings
from ..core.prompt import format_of, split_ids
from ..store.chain import chain_of
from .answer import OnText, answer, ask
from .router import DEFAULT_MIN_SCORE

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.protocol import BlockStore
    from .router import Router

__all__ = ["search", "recall", "continuation_for", "answer_graft_way", "answer_text_way", "other_engines_hint"]

log = logging.getLogger("graftmem")


def continuation_for(block: Block, task: str) -> str:
    """What is prefilled after the block: the task as the next chat turn, or as is for raw blocks."""
    fmt = format_of(block.metadata)
    return fmt.continuation(task) if fmt is not None else task


def _check_task(task: str) -> None:
    if not isinstance(task, str) or not task.strip():
        raise ConfigError("the task is empty: give the text of the task to route")


#: how many routed candidates are read when a filter narrows them (scopes, metadata): the router ranks
#: every block of the engine exactly, so this bounds only the work after ranking
FILTERED_CANDIDATES = 1024

BlockFilter = Callable[[Block], bool]


def _routed(router: "Router", store: "BlockStore", task: str, k: int, fp_digest: str,
            allow: Optional[BlockFilter]) -> list[tuple[str, float]]:
    """The top ``k`` (id, score) of the router, keeping only blocks that ``allow`` accepts."""
    if allow is None:
        return router.search(task, k, fingerprint_digest=fp_digest)
    out = []
    for bid, score in router.search(task, FILTERED_CANDIDATES, fingerprint_digest=fp_digest):
        try:
            ok = allow(store.get(bid))
        except BlockNotFound:
            continue
        if ok:
            out.append((bid, score))
            if len(out) == k:
                break
    return out


def search(router: "Router", store: "BlockStore", fp_digest: str, task: str, *, top_k: int = 5,
           allow: Optional[BlockFilter] = None) -> list[SearchHit]:
    """Rank the blocks of the engine with fingerprint digest ``fp_digest`` for ``task``, best first;
    ``allow`` keeps only the blocks it accepts (a user's scope, a metadata filter)."""
    _check_task(task)
    hits = _routed(router, store, task, top_k, fp_digest, allow)
    out = []
    for bid, score in hits:
        try:
            b = store.get(bid)
        except BlockNotFound:  # deleted since the last sync, by another connection: drop it
            router.remove([bid])
            continue
        out.append(SearchHit(block_id=bid, name=b.name, score=score, kind=b.kind, n_tokens=b.n_tokens,
                             when_to_use=b.metadata.get("when_to_use")))
    return out


def other_engines_hint(store: "BlockStore", fingerprint: Fingerprint) -> Optional[str]:
    """Why blocks may look missing: how many blocks of this store another engine configuration made,
    and what differs (e.g. after a change of n_ctx, an upgrade of llama-cpp-python, another CPU)."""
    local = fingerprint.digest()
    others = [b for b in store.list() if b.fingerprint.digest() != local]
    if not others:
        return None
    diff = others[0].fingerprint.diff(fingerprint)
    what = ", ".join(f"{k} {theirs!r} there vs {ours!r} here" for k, (theirs, ours) in list(diff.items())[:3])
    return (f"{len(others)} block(s) in {store.home} were learned by another engine configuration ({what}) "
            f"and are invisible to this one: {same_settings(diff)}, or learn them again here")


def _no_match(engine: "Engine", store: "BlockStore", top: Optional[tuple[str, float]], min_score: float,
              route_ms: float, filtered: bool = False) -> Recall:
    name = "(deleted)"
    if top is not None:
        try:
            name = store.get(top[0]).name
        except BlockNotFound:
            pass
    fpd = engine.fingerprint.digest()
    held = [b for b in store.list() if b.fingerprint.digest() == fpd] if top is None else []  # listed once
    if held and filtered:
        reason = (f"no block matched this task: none of this engine's {len(held)} block(s) is in the scope (or "
                  "filters) given, which narrows recall to the blocks learned with that user_id / agent_id / "
                  "session_id; learn into that scope, or recall without it; nothing was grafted")
    elif held:
        # the engine's blocks are there but none is routed: recall routes only to blocks whose state is vouched for
        unverified = sum(not b.trusted for b in held)  # the one trust rule (`Block.trusted`)
        reason = (f"no block matched this task: this engine's {len(held)} block(s) are not routed"
                  + (f" ({unverified} unverified: imported or pulled without re-derivation or a trusted "
                     "signature; `graftmem verify ID --rederive` each, or learn their texts here)" if unverified
                     else " (their kinds or labels are not routed: prefixes a server cached, stored responses, "
                     "a document's pages, or labels from an untrusted source)")
                  + "; nothing was grafted")
    elif top is None:
        reason = ("no block matched this task: the store has no block learned by this engine "
                  f"({engine.fingerprint.model_name}); nothing was grafted; learn one first (Memory.learn, "
                  "CLI: graftmem learn FILE)")
    else:
        reason = (f"no block matched this task: the best candidate {name!r} ({top[0][:12]}) scored "
                  f"{top[1]:.3f}, below min_score {min_score:.2f}; nothing was grafted")
    hint = other_engines_hint(store, engine.fingerprint)
    if hint:
        reason += f". {hint}"
    receipt = Receipt(block_id=None, tokens_restored=0, tokens_prefilled=0, restore_ms=0.0, prefill_ms=0.0,
                      decode_ms=0.0, decode_tokens=0, first_logits_sha256="", exact=engine.exactness.exact,
                      route_ms=route_ms)
    return Recall(text="", tokens=[], block=None, receipt=receipt, matched=False, reason=reason,
                  score=top[1] if top else None, runner_up=top[0] if top else None,
                  runner_up_score=top[1] if top else None)


def _seam(engine: "Engine", block: Block, continuation: str) -> tuple[list[int], bool]:
    """The continuation's ids and whether the block/continuation seam tokenizes like the joined text."""
    return split_ids(engine, block.tokens, block.text, continuation, add_special=block.parent is None)


def answer_text_way(engine: "Engine", store: "BlockStore", block: Block, continuation: str, *, max_tokens: int,
                    sampling: Sampling = GREEDY, stops: Sequence[str] = (),
                    on_text: Optional[OnText] = None, grammar: Optional[str] = None) -> Recall:
    """The baseline without graftmem: tokenize the block's text again and prefill it, then the task.

    Two prefill calls (manual, then task), like the graft path: llama.cpp's CPU kernels are not
    invariant to how a prompt is cut into decode calls, so one call over the joined prompt gives logits
    that differ slightly (measured KL ~0.005, same argmax: docs/routing.md). The token ids are the
    joined prompt's (checked), so this is the fresh prefill the graft must equal byte for byte. A
    chained block is re-read as its chain, the root first, one prefill call per block.
    """
    qtok, clean = _seam(engine, block, continuation)
    segs = [engine.tokenize(b.text, add_special=b.parent is None) for b in chain_of(store, block)]

    def reread() -> int:
        engine.reset()
        for seg in segs:
            engine.prefill(seg)
        return sum(len(s) for s in segs)

    return answer(engine, block, qtok, reread, graft=False, max_tokens=max_tokens, exact=clean,
                  sampling=sampling, stops=stops, on_text=on_text, grammar=grammar)


def answer_graft_way(engine: "Engine", store: "BlockStore", block: Block, continuation: str, *, max_tokens: int,
                     sampling: Sampling = GREEDY, stops: Sequence[str] = (),
                     on_text: Optional[OnText] = None, grammar: Optional[str] = None) -> Recall:
    _, clean = _seam(engine, block, continuation)
    if not clean:
        log.warning("block %s: the task's first tokens merge with the block's last ones; the graft "
                    "matches a prefill of the same token ids, not of the joined string (receipt.exact=False)",
                    block.short_id)
    r = ask(engine, store, block, continuation, max_tokens=max_tokens, sampling=sampling, stops=stops,
            on_text=on_text, grammar=grammar)
    if clean:
        return r
    return r.model_copy(update={"receipt": r.receipt.model_copy(update={"exact": False})})


def recall(engine: "Engine", store: "BlockStore", router: "Router", task: str, *, max_tokens: int = 64,
           min_score: Optional[float] = None, mode: Literal["graft", "text"] = "graft",
           sampling: Sampling = GREEDY, allow: Optional[BlockFilter] = None, stops: Sequence[str] = (),
           on_text: Optional[OnText] = None, admit: Optional[Callable[[Block], None]] = None,
           grammar: Optional[str] = None) -> Recall:
    """Route ``task`` to ONE block of this engine, answer it the ``mode`` way (see the module doc).

    ``admit(block)`` runs on the routed block before anything of it reaches the engine, and refuses it
    by raising (the consent rule of `graftmem.memory.verbs`): a refusal made after the answer would
    come too late for a stream, whose text is already out."""
    _check_task(task)
    if mode not in ("graft", "text"):
        raise ConfigError(f"mode must be 'graft' or 'text', got {mode!r}")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {max_tokens}")
    threshold = DEFAULT_MIN_SCORE if min_score is None else float(min_score)
    way = answer_graft_way if mode == "graft" else answer_text_way
    fpd = engine.fingerprint.digest()
    route_ms = 0.0  # every routing attempt of this recall (embedding + vector and lexical search)
    for attempt in (1, 2):
        t0 = time.perf_counter()
        hits = _routed(router, store, task, 2, fpd, allow)
        route_ms += (time.perf_counter() - t0) * 1e3
        top = hits[0] if hits else None
        if top is None or top[1] < threshold:
            log.info("recall: no block above min_score %.2f (best %s)", threshold, top)
            return _no_match(engine, store, top, threshold, route_ms, filtered=allow is not None)
        best = top
        try:
            block = store.get(top[0])
            if admit is not None:
                admit(block)
            r = way(engine, store, block, continuation_for(block, task), max_tokens=max_tokens, sampling=sampling,
                    stops=stops, on_text=on_text, grammar=grammar)
            break
        except BlockNotFound:
            # another process deleted the block after the last sync: forget it and route again
            if attempt == 2:
                raise
            router.remove([top[0]])
    runner = hits[1] if len(hits) > 1 else None
    receipt = r.receipt.model_copy(update={"route_ms": route_ms})
    return r.model_copy(update={"receipt": receipt, "score": best[1], "runner_up": runner[0] if runner else None,
                                "runner_up_score": runner[1] if runner else None})
