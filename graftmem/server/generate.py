"""One request on one engine: graft the longest stored prefix, prefill the rest segment by segment,
decode with stop strings, stream the text out, then store the prefix if it keeps coming back (its
states captured during this request's own prefill).

This is the engine side of the OpenAI-compatible routes; it runs in a worker thread and speaks to the
event loop only through ``emit`` (text deltas, then the result). Cache on or off, the prompt is
prefilled one segment per call (see `graftmem.server.chat`), so a request served from a grafted
prefix and the same request served cold compute the same bytes: grafting changes the time, never
the answer. A block that fails any check (digests, fingerprint, llama.cpp refusing the bytes) is
refused for the rest of the process, logged, and the request is served cold from an empty context.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..core.decode import AnswerText, Sampling, decode
from ..core.errors import GraftmemError
from ..memory.answer import graft

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.local import Store
    from .prefix import PrefixCache

__all__ = ["Job", "Result", "run_job", "MAX_CAPTURE_BYTES"]

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
    emit: Optional[Callable[[str, Any], None]] = None
    cancel: threading.Event = field(default_factory=threading.Event)
    extra: Optional[dict[str, Any]] = None  #: added to the receipt (what routing chose)
    learn_tail: int = 2  #: final segments never learned (see `PrefixCache.learn_target`)


@dataclass
class Result:
    text: str
    tokens: list[int]
    logprobs: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    receipt: dict[str, Any]


def _entry(engine: "Engine", tok: int, lp: float, top: Optional[list[tuple[int, float]]]) -> dict[str, Any]:
    """One token of OpenAI's ``logprobs.content``: its text, log-probability, bytes and alternatives."""
    def one(t: int, v: float) -> dict[str, Any]:
        b = engine.piece(t)
        return {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}

    return {**one(tok, lp), "top_logprobs": [one(t, v) for t, v in (top or [])]}


def run_job(engine: "Engine", store: "Store", cache: Optional["PrefixCache"], job: Job) -> Result:
    """Compute ``job`` on ``engine`` (which the caller holds exclusively); see the module docstring."""
    segs = job.segments
    n_prompt = sum(len(s) for s in segs)
    match = cache.lookup(segs) if cache is not None and job.use_cache else None
    answer = AnswerText(engine.piece, job.stops)  # final text only: no half character, no partial stop
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

    with engine.session():
        t0 = time.perf_counter()
        restored, first_seg, block_id = 0, 0, None
        if match is not None:
            try:
                graft(engine, store, match.block)
                restored, first_seg, block_id = match.n_tokens, match.n_segments, match.block.id
            except GraftmemError as exc:
                assert cache is not None
                cache.refuse(match.block.id, str(exc))
                engine.reset()
                match = None
        t1 = time.perf_counter()
        # the prefix to learn is decided before the prefill, so its states are captured on the way
        learn_k = cache.learn_target(segs, job.learn_tail) if cache is not None and job.use_cache else 0
        captured: list[bytes] = []
        held = 0
        for i in range(first_seg, len(segs)):
            engine.prefill(segs[i])
            if i < learn_k and held < MAX_CAPTURE_BYTES and len(captured) == i - first_seg:
                captured.append(bytes(engine.capture()))  # a copy: capture() reuses its buffer
                held += len(captured[-1])
        first = engine.logits()
        t2 = time.perf_counter()
        out = decode(engine, job.max_tokens, first_logits=first, sampling=job.sampling, on_token=on_token,
                     top_logprobs=job.top_logprobs if job.logprobs else 0)
        t3 = time.perf_counter()
    text = answer.text
    rest = answer.delta(final=True)
    if job.emit is not None and (rest or pending):
        job.emit("delta", (rest, pending[:]))
    receipt = {"block_id": block_id, "tokens_restored": restored, "tokens_prefilled": n_prompt - restored,
               "restore_ms": round((t1 - t0) * 1e3, 3) if block_id else 0.0,
               "prefill_ms": round((t2 - t1) * 1e3, 3), "decode_ms": round((t3 - t2) * 1e3, 3),
               "exact": bool(engine.exactness.exact), "cache": job.use_cache}
    result = Result(text=text, tokens=list(out.tokens), logprobs=entries, finish_reason=out.finish_reason,
                    prompt_tokens=n_prompt, cached_tokens=restored, receipt=receipt)
    if job.emit is not None:
        job.emit("done", result)
    if captured and out.finish_reason != "cancelled":
        assert cache is not None
        cache.store_captured(engine, segs, job.texts, first_seg, captured, match)
    return result


def check_fits(engine: "Engine", segments: Sequence[Sequence[int]], max_tokens: int) -> Optional[str]:
    """Why the prompt does not fit the context (None if it does)."""
    n = sum(len(s) for s in segments)
    if n + 1 > engine.n_ctx:
        return (f"this model's context is {engine.n_ctx} tokens; the prompt is {n} tokens. Shorten the "
                "messages or start the server with a larger n_ctx")
    return None
