"""recall and search: route a task to ONE block, graft it, prefill only the task, answer.

Kept out of :mod:`graftmem._memory` so that ``Memory`` stays a thin coordinator, and so that a
``learn``/``ask`` user never imports the router (torch, faiss, MiniLM cost seconds to load).

Two answer paths over the same prompt, ``block.text + continuation``:

* ``graft``: restore the block's KV state at its own positions (:meth:`Memory.ask`), prefill the
  continuation only;
* ``text``: the way without graftmem: tokenize the block's text again and prefill it, then the task.

Both hash the first-step logits, so any caller can see that they agree byte for byte; they do only when
the seam between block and continuation does not merge tokens (:func:`graftmem._prompt.split_ids`),
which chat blocks guarantee and raw blocks may not: a merging seam is reported as ``receipt.exact=False``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional

from ._answer import answer
from ._blocks import Block, Recall, Receipt, SearchHit
from ._errors import BlockNotFound, ConfigError
from ._prompt import FORMATS, detect_format, split_ids
from ._router import DEFAULT_MIN_SCORE

if TYPE_CHECKING:
    from ._memory import Memory

__all__ = ["prepare_learn", "learned_again", "search", "recall", "continuation_for"]

log = logging.getLogger("graftmem")


def prepare_learn(mem: "Memory", text: str, name: Optional[str], metadata: Optional[Mapping[str, Any]],
                  when_to_use: Optional[str], chat: bool) -> tuple[str, Optional[str], dict[str, Any]]:
    """The text, name and metadata :meth:`Memory.learn` stores for ``when_to_use`` / ``chat``."""
    from ._memory import _default_name

    meta = dict(metadata or {})
    if when_to_use is not None:
        if not isinstance(when_to_use, str) or not when_to_use.strip():
            raise ConfigError("when_to_use must be a non-empty description of the tasks this block serves")
        meta["when_to_use"] = when_to_use.strip()
    if chat:
        fmt = detect_format(mem.engine)
        if fmt is None:
            raise ConfigError(f"model {mem.fingerprint.model_name!r} has none of the chat templates graftmem "
                              f"knows ({', '.join(sorted(FORMATS))}); learn with chat=False")
        name = name or _default_name(text)
        meta["chat_format"] = fmt.name
        text = fmt.prefix(text)
    return text, name, meta


def learned_again(mem: "Memory", block: Block, metadata: Optional[Mapping[str, Any]]) -> Block:
    """A text learned twice is one block; a new ``when_to_use`` replaces the old one in its manifest."""
    wtu = (metadata or {}).get("when_to_use")
    if wtu is None or block.metadata.get("when_to_use") == wtu:
        return block
    updated = block.model_copy(update={"metadata": {**block.metadata, "when_to_use": wtu}})
    mem.store.set_manifest(updated)
    if mem._router is not None:  # noqa: SLF001
        mem._router.add_blocks([updated])  # noqa: SLF001
    log.info("block %s: when_to_use updated", block.short_id)
    return updated


def continuation_for(block: Block, task: str) -> str:
    """What is prefilled after the block: the task as the next chat turn, or as is for raw blocks."""
    fmt = FORMATS.get(str(block.metadata.get("chat_format", "")))
    return fmt.continuation(task) if fmt is not None else task


def _check_task(task: str) -> None:
    if not isinstance(task, str) or not task.strip():
        raise ConfigError("the task is empty: give the text of the task to route")


def search(mem: "Memory", task: str, *, top_k: int = 5) -> list[SearchHit]:
    _check_task(task)
    hits = mem.router.search(task, top_k, fingerprint_digest=mem.fingerprint.digest())
    out = []
    for bid, score in hits:
        try:
            b = mem.store.get(bid)
        except BlockNotFound:  # deleted since the last sync, by another connection: drop it
            mem.router.remove([bid])
            continue
        out.append(SearchHit(block_id=bid, name=b.name, score=score, kind=b.kind, n_tokens=b.n_tokens,
                             when_to_use=b.metadata.get("when_to_use")))
    return out


def _no_match(mem: "Memory", top: Optional[tuple[str, float]], min_score: float) -> Recall:
    name = "(deleted)"
    if top is not None:
        try:
            name = mem.store.get(top[0]).name
        except BlockNotFound:
            pass
    if top is None:
        text = ("no block matched this task: the store has no block learned by this engine "
                f"({mem.fingerprint.model_name}); nothing was grafted")
    else:
        text = (f"no block matched this task: the best candidate {name!r} ({top[0][:12]}) scored "
                f"{top[1]:.3f}, below min_score {min_score:.2f}; nothing was grafted")
    receipt = Receipt(block_id=None, tokens_restored=0, tokens_prefilled=0, restore_ms=0.0, prefill_ms=0.0,
                      decode_ms=0.0, decode_tokens=0, first_logits_sha256="", exact=mem.exactness.exact)
    return Recall(text=text, tokens=[], block=None, receipt=receipt,
                  score=top[1] if top else None, runner_up=top[0] if top else None,
                  runner_up_score=top[1] if top else None)


def _seam(mem: "Memory", block: Block, continuation: str) -> tuple[list[int], bool]:
    """The continuation's ids and whether the block/continuation seam tokenizes like the joined text."""
    return split_ids(mem.engine, block.tokens, block.text, continuation, add_special=block.parent is None)


def _reread(mem: "Memory", block: Block) -> list[list[int]]:
    """The block's text tokenized again, one list per prefill call: the chain root first for a
    chained block (its fresh reference is a sequential prefill, see :mod:`graftmem._chain`)."""
    from ._chain import chain_of

    return [mem.engine.tokenize(b.text, add_special=b.parent is None) for b in chain_of(mem.store, block)]


def answer_text_way(mem: "Memory", block: Block, continuation: str, *, max_tokens: int) -> Recall:
    """The baseline without graftmem: tokenize the block's text again and prefill it, then the task.

    Two prefill calls (manual, then task), like the graft path: llama.cpp's CPU kernels are not
    invariant to how a prompt is cut into decode calls, so one call over the joined prompt gives logits
    that differ slightly (measured KL ~0.005, same argmax: docs/routing.md). The token ids are the
    joined prompt's (checked), so this is the fresh prefill the graft must equal byte for byte.
    """
    eng = mem.engine
    qtok, clean = _seam(mem, block, continuation)
    segs = _reread(mem, block)

    def reread() -> int:
        eng.reset()
        for seg in segs:
            eng.prefill(seg)
        return sum(len(s) for s in segs)

    return answer(eng, block, qtok, reread, graft=False, max_tokens=max_tokens, exact=clean)


def answer_graft_way(mem: "Memory", block: Block, continuation: str, *, max_tokens: int) -> Recall:
    _, clean = _seam(mem, block, continuation)
    if not clean:
        log.warning("block %s: the task's first tokens merge with the block's last ones; the graft "
                    "matches a prefill of the same token ids, not of the joined string (receipt.exact=False)",
                    block.short_id)
    r = mem.ask(block.id, continuation, max_tokens=max_tokens)
    if clean:
        return r
    return r.model_copy(update={"receipt": r.receipt.model_copy(update={"exact": False})})


def recall(mem: "Memory", task: str, *, max_tokens: int = 64, min_score: Optional[float] = None,
           mode: Literal["graft", "text"] = "graft") -> Recall:
    _check_task(task)
    if mode not in ("graft", "text"):
        raise ConfigError(f"mode must be 'graft' or 'text', got {mode!r}")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {max_tokens}")
    threshold = DEFAULT_MIN_SCORE if min_score is None else float(min_score)
    answer = answer_graft_way if mode == "graft" else answer_text_way
    for attempt in (1, 2):
        hits = mem.router.search(task, 2, fingerprint_digest=mem.fingerprint.digest())
        top = hits[0] if hits else None
        if top is None or top[1] < threshold:
            log.info("recall: no block above min_score %.2f (best %s)", threshold, top)
            return _no_match(mem, top, threshold)
        try:
            block = mem.store.get(top[0])
            r = answer(mem, block, continuation_for(block, task), max_tokens=max_tokens)
            break
        except BlockNotFound:
            # another process deleted the block after the last sync: forget it and route again
            if attempt == 2:
                raise
            mem.router.remove([top[0]])
    runner = hits[1] if len(hits) > 1 else None
    return r.model_copy(update={"score": top[1], "runner_up": runner[0] if runner else None,
                                "runner_up_score": runner[1] if runner else None})
