"""The one tail every answer shares: put the block's tokens in the context, prefill the task, decode.

:meth:`graftmem.Memory.ask` (graft: restore the saved KV state) and the text way of
:func:`graftmem._recall.recall` (re-prefill the block's text) differ only in how the block's tokens
get into the context. Keeping the rest in one place keeps their timings and receipts comparable, which
is the point of running both: the receipts' logits hashes must be equal, and the times must mean the
same thing (``restore_ms`` is only the graft; ``prefill_ms`` is everything prefilled).
"""

from __future__ import annotations

import time
from typing import Callable

from ._blocks import Block, Recall, Receipt
from ._engine import Engine, logits_sha256

__all__ = ["answer"]


def answer(eng: Engine, block: Block, qtok: list[int], setup: Callable[[], int], *, graft: bool,
           max_tokens: int, exact: bool = True) -> Recall:
    """Run ``setup`` (returns how many tokens it put in the context), prefill ``qtok``, decode greedily.

    ``graft`` says whether ``setup`` restored saved state (timed as ``restore_ms``, counted as
    ``tokens_restored``) or prefilled (timed and counted with the task's prefill). ``exact`` is ANDed with
    the engine's own exactness, for callers that know the prompt's seam is not clean.
    """
    with eng.lock:
        t0 = time.perf_counter()
        n_setup = setup()
        t1 = time.perf_counter()
        eng.prefill(qtok)
        first = eng.logits()
        t2 = time.perf_counter()
        out = eng.generate(max_tokens, first_logits=first)
        t3 = time.perf_counter()
        eng.reset()
    receipt = Receipt(
        block_id=block.id, tokens_restored=n_setup if graft else 0,
        tokens_prefilled=len(qtok) + (0 if graft else n_setup),
        restore_ms=(t1 - t0) * 1e3 if graft else 0.0, prefill_ms=(t2 - (t1 if graft else t0)) * 1e3,
        decode_ms=(t3 - t2) * 1e3, decode_tokens=len(out), first_logits_sha256=logits_sha256(first),
        exact=eng.exactness.exact and exact)
    return Recall(text=eng.detokenize(out), tokens=out, block=block, receipt=receipt)
