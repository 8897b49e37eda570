"""Exactness checks: graft vs fresh prefill, by SHA-256 of float32 logits, KL and argmax.

For each sample query q:

* **graft**: read the block file (digest checked), restore it into an empty cache, prefill q, logits;
* **fresh**: empty cache, prefill the block's own token ids, prefill q, logits.

``fresh="reprefill"`` recomputes the block prefix for every sample. ``fresh="trim"`` prefills it once
and, after each sample, removes the query's cells with ``llama_memory_seq_rm``, which leaves exactly
the cells and cache head that a fresh prefill leaves (``test_trimmed_fresh_prefix_equals_reprefilled_prefix``
compares the bytes); the first sample and the floor's samples are always full re-prefills.
``fresh="auto"`` (the default) is ``"trim"``: the prefill is nearly all of a verification's time (50
samples of a 90-token block re-prefilled took 47 s of one core, trimmed about a fifth of it; the demo's
4 samples of a 209-token block 9.0 s re-prefilled, 4.2 s trimmed), and a re-prefill per sample proves
nothing that trim does not. Trim checks itself on every run: the floor's second sample compares the
trimmed prefix's logits with those of a full re-prefill, so a trim that left other cells shows in the
floor, and in the samples too (the graft restores the stored state, which such cells would not hold).
On a model with recurrent layers (Mamba-2, the Qwen 3.5 / Granite 4 / LFM2 hybrids) nothing can be
trimmed (`graftmem.core.memkind`): ``"auto"`` re-prefills there, and an explicit ``"trim"`` is refused
(`UnsupportedFeature`) before any work.
The **floor** is fresh-vs-fresh on the first samples: if it were not SHA-equal the engine would be
nondeterministic and no graft could be called exact. **Cross-process** runs the graft in a new Python
process on the same store and compares its SHA-256s with the fresh ones computed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np

from ..core.blocks import SampleResult, VerificationRecord, VerifyReport
from ..core.engine import logits_sha256
from ..core.errors import ConfigError, EngineError
from ..store.chain import load_state, segments

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.protocol import BlockStore
    from ..store.scopes import ScopeIndex

__all__ = ["sample_queries", "kl_divergence", "graft_logits", "verify_block", "graft_in_new_process",
           "record_verification"]

_WORDS = ("what when where which how why explain list name give the first last step rule value "
          "code answer because therefore next then total number page line word").split()


def sample_queries(n: int) -> list[str]:
    """``n`` distinct, deterministic queries of 1 to ~20 tokens (varied lengths, punctuation, newlines)."""
    out = []
    for i in range(n):
        if i == 1:  # one token: the single-row decode path (split-KV over >= 512 cells)
            out.append(" the")
            continue
        if i == 2:  # a >= 64-token micro-batch: the tiled flash-attention path
            out.append("\n" + " ".join(_WORDS[(j * 7) % len(_WORDS)] for j in range(80)) + "?")
            continue
        k = 1 + (i * 5) % 13
        words = " ".join(_WORDS[(i * 3 + j * 7) % len(_WORDS)] for j in range(k))
        sep = "\n" if i % 4 == 0 else " "
        out.append(f"{sep}Q{i}: {words}{'?' if i % 3 else '.'}")
    return out


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(P || Q) in nats between the softmax distributions of two logit vectors (float64)."""
    p = p_logits.astype(np.float64) - p_logits.max()
    q = q_logits.astype(np.float64) - q_logits.max()
    lp = p - np.log(np.exp(p).sum())
    lq = q - np.log(np.exp(q).sum())
    return float(max(0.0, (np.exp(lp) * (lp - lq)).sum()))


def graft_logits(engine: "Engine", store: "BlockStore", block_id: str, query_tokens: Sequence[int]) -> np.ndarray:
    """Logits after grafting ``block_id`` and prefilling ``query_tokens`` (the cache is left as is:
    callers inside a session reset it; a standalone call gets its own session)."""
    with engine.session():
        # from disk: a verification reads the stored bytes, not the hot tier's copy
        block, view = load_state(store, block_id, engine.buffer, fingerprint=engine.fingerprint, hot=False)
        engine.restore(view, block.pos_end, block.one_token_from)
        engine.prefill(query_tokens)
        return engine.logits()


def verify_block(engine: "Engine", store: "BlockStore", block_id: str, *, samples: int = 50,
                 fresh: Literal["auto", "reprefill", "trim"] = "auto",
                 cross_process: bool = True, floor_samples: int = 2) -> VerifyReport:
    """Prove graft == fresh prefill on ``samples`` queries (see the module doc)."""
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ConfigError(f"samples must be an integer >= 1, got {samples!r}: a verification of 0 queries proves nothing")
    block = store.get(block_id)
    eng = engine
    queries = sample_queries(samples)
    qtoks = [eng.tokenize(q, add_special=False) for q in queries]
    if fresh not in ("auto", "reprefill", "trim"):
        raise ConfigError(f"fresh must be 'auto', 'reprefill' or 'trim', got {fresh!r}")
    if fresh == "trim" and not eng.memory.trims:
        raise eng.memory.refusal("verify(fresh='trim'): trimming the fresh prefix after each sample",
                                 "Use fresh='reprefill' (or 'auto', which re-prefills on this model).")
    if fresh == "auto":
        fresh = "trim" if eng.memory.trims else "reprefill"
    rows: list[SampleResult] = []
    fresh_logits: list[np.ndarray] = []
    floor_eq = 0
    floor_n = min(floor_samples, samples)
    segs = segments(store, block)  # a chained block: each block of the chain in its own call

    def prefill_fresh() -> None:
        eng.reset()
        for seg in segs:
            eng.prefill(seg)

    with eng.session():
        for i, q in enumerate(qtoks):
            if fresh == "reprefill" or i == 0:
                prefill_fresh()
            else:
                eng.trim(block.pos_end)
            eng.prefill(q)
            lf = eng.logits()
            fresh_logits.append(lf)
            if i < floor_n:  # fresh vs fresh: the engine's own determinism
                prefill_fresh()
                eng.prefill(q)
                floor_eq += logits_sha256(eng.logits()) == logits_sha256(lf)
        for i, (query, lf) in enumerate(zip(queries, fresh_logits)):
            lg = graft_logits(eng, store, block.id, qtoks[i])
            sf, sg = logits_sha256(lf), logits_sha256(lg)
            rows.append(SampleResult(
                query=query, n_query_tokens=len(qtoks[i]), graft_sha256=sg, fresh_sha256=sf,
                sha_equal=sf == sg, kl=kl_divergence(lf, lg),
                argmax_equal=int(np.argmax(lf)) == int(np.argmax(lg))))
    xproc = None
    if cross_process:
        n_x = min(samples, 5)
        shas = graft_in_new_process(eng, store, block.id, queries[:n_x])
        xproc = all(s == r.fresh_sha256 for s, r in zip(shas, rows[:n_x])) and len(shas) == n_x
    kls = [r.kl for r in rows]
    return VerifyReport(
        block_id=block.id, n_tokens=block.n_tokens, samples=samples,
        sha_equal=sum(r.sha_equal for r in rows), max_kl=max(kls, default=0.0),
        mean_kl=float(np.mean(kls)) if kls else 0.0, argmax_agree=sum(r.argmax_equal for r in rows),
        floor_sha_equal=floor_eq, floor_samples=floor_n, cross_process=xproc,
        exact_engine=eng.exactness.exact, rows=rows)


def record_verification(store: "BlockStore", scopes: "ScopeIndex", report: VerifyReport) -> VerificationRecord:
    """Keep what ``report`` proved: the block's manifest gets it as its ``verification`` (what listings show
    as ``verified``) and its history a ``verified`` event. One rule for every door that verifies
    (`Memory.verify`, the server's web page); a read-only store keeps nothing (the record is returned)."""
    rec = VerificationRecord(samples=report.samples, sha_equal=report.sha_equal, max_kl=report.max_kl,
                             argmax_agree=report.argmax_agree, ok=report.ok)
    if not store.read_only:
        block = store.get(report.block_id)
        store.set_manifest(block.model_copy(update={"verification": rec}))
        scopes.record(block.id, "verified", rec.model_dump())
    return rec


def graft_in_new_process(engine: "Engine", store: "BlockStore", block_id: str, queries: list[str]) -> list[str]:
    """Graft ``block_id`` in a fresh interpreter on the same store; return its logits SHA-256s."""
    spec = {"home": str(store.home), "model": str(engine.model_path),
            "config": engine.config.model_dump(), "block": block_id, "queries": queries}
    proc = subprocess.run([sys.executable, "-m", "graftmem.memory.child"], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if proc.returncode != 0:
        raise EngineError(f"cross-process graft failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)["sha256"]
