"""The one tail every answer shares: put the block's tokens in the context, prefill the task, decode.

`ask()` (graft: restore the saved KV state, what [`Memory.ask()`][graftmem.Memory.ask] runs) and the text way
of `recall()` (re-prefill the block's text) differ only in how the block's
tokens get into the context. Keeping the rest in one place keeps their timings and receipts comparable,
which is the point of running both: the receipts' logits hashes must be equal, and the times must mean
the same thing (``restore_ms`` is only the graft; ``prefill_ms`` is everything prefilled).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from ..core.blocks import Block, Recall, Receipt
from ..core.decoding import GREEDY, AnswerText, Sampling, decode
from ..core.engine import Engine, logits_sha256
from ..core.errors import ConfigError
from ..store.chain import load_state, recheck
from ..store.hot import hot_key
from ..core.identity import incompatibility

if TYPE_CHECKING:
    from ..store.protocol import BlockStore

__all__ = ["answer", "ask", "graft", "OnText"]

#: ``on_text(delta)`` with each piece of answer text that became final (streams); True cancels the answer
OnText = Callable[[str], bool]

#: the receipt's phase fields that ``setup`` may fill (Receipt.read_ms ...)
_PHASES = ("route_ms", "fetch_ms", "read_ms", "check_ms", "place_ms", "set_data_ms")


def answer(eng: Engine, block: Block, qtok: list[int], setup: Callable[[], int], *, graft: bool,
           max_tokens: int, exact: bool = True, sampling: Sampling = GREEDY,
           phases: Optional[dict[str, float]] = None, stops: Sequence[str] = (),
           on_text: Optional[OnText] = None, grammar: Optional[str] = None) -> Recall:
    """Run ``setup`` (returns how many tokens it put in the context), prefill ``qtok``, decode.

    ``graft`` says whether ``setup`` restored saved state (timed as ``restore_ms``, counted as
    ``tokens_restored``) or prefilled (timed and counted with the task's prefill). ``exact`` is ANDed with
    the engine's own exactness, for callers that know the prompt's seam is not clean. ``phases`` is a
    dict that ``setup`` fills while it runs (``read_ms``, ``check_ms``, ``place_ms``, ``set_data_ms``,
    see `graft()`); its entries go into the receipt's breakdown. ``stops`` end the answer at the first
    stop string (cut from the text, ``finish_reason="stop"``); ``on_text`` receives the text as it
    becomes final (`AnswerText`) and cancels the answer by returning True (``finish_reason="cancelled"``).
    ``grammar`` (GBNF, from ``response_format``) constrains which tokens are picked, never the logits.
    """
    text = AnswerText(eng.piece, stops)
    constraint = eng.grammar(grammar) if grammar else None

    def on_token(tok: int, lp: float, top: object) -> Optional[str]:
        if text.add(tok):
            return "stop"
        if on_text is not None:
            delta = text.delta()
            if delta and on_text(delta):
                return "cancelled"
        return None

    with eng.session():
        t0 = time.perf_counter()
        n_setup = setup()
        t1 = time.perf_counter()
        eng.prefill(qtok)
        first = eng.logits()
        t2 = time.perf_counter()
        try:
            dec = decode(eng, max_tokens, first_logits=first, sampling=sampling,
                         on_token=on_token if (stops or on_text is not None) else None, grammar=constraint)
        finally:
            if constraint is not None:
                constraint.close()
        out = dec.tokens
        t3 = time.perf_counter()
    receipt = Receipt(
        block_id=block.id, tokens_restored=n_setup if graft else 0,
        tokens_prefilled=len(qtok) + (0 if graft else n_setup),
        restore_ms=(t1 - t0) * 1e3 if graft else 0.0, prefill_ms=(t2 - (t1 if graft else t0)) * 1e3,
        decode_ms=(t3 - t2) * 1e3, decode_tokens=len(out), first_logits_sha256=logits_sha256(first),
        exact=eng.exactness.exact and exact, **{k: v for k, v in (phases or {}).items() if k in _PHASES})
    if on_text is not None and dec.finish_reason != "cancelled":
        rest = text.delta(final=True)
        if rest:
            on_text(rest)
    return Recall(text=text.text if (stops or on_text is not None) else eng.detokenize(out), tokens=out,
                  block=block, receipt=receipt, finish_reason=dec.finish_reason)


def graft(eng: Engine, store: "BlockStore", block: Block, timings: Optional[dict[str, float]] = None) -> int:
    """Restore ``block`` (its whole chain) as sequence 0 at its own positions; return its end position.

    Digests are checked, a chain is merged, window-trimmed cells are put back at their fresh indices
    (`load_state()`). Call inside an [`Engine.session()`][graftmem.Engine.session]. ``timings``, if
    given, gets the phases' milliseconds (``read_ms``, ``check_ms``, ``place_ms``, ``set_data_ms``).

    With ``keep_on_device`` (`EngineConfig`) the engine keeps the state it grafted last in its own
    buffers (`Engine.copy_on_device`; on the GPU where the cache is offloaded), and a graft of that
    same block (id and state digest) again puts those cells back from there, after the checks a state
    held in memory passes on every graft (`recheck`: still in the store, same fingerprint, its chain
    complete); ``set_data_ms`` is then that copy's time and nothing is read (after a read, it includes
    making the copy).
    """
    copy = eng.device_copy if eng.config.keep_on_device else None
    current = store.get(block.id) if copy is not None else None
    if copy is not None and current is not None and copy.key == hot_key(current):
        recheck(store, current, eng.fingerprint)
        ms = eng.restore_on_device(copy)
    else:
        got, view = load_state(store, block.id, eng.buffer, fingerprint=eng.fingerprint, timings=timings)
        ms = eng.restore(view, block.pos_end, block.one_token_from)
        if eng.config.keep_on_device:
            t0 = time.perf_counter()
            eng.copy_on_device(key=hot_key(got))
            ms += (time.perf_counter() - t0) * 1e3
    if timings is not None:
        timings["set_data_ms"] = timings.get("set_data_ms", 0.0) + ms
    return block.pos_end


def ask(eng: Engine, store: "BlockStore", block: Block, query: str, *, max_tokens: int = 64,
        sampling: Sampling = GREEDY, stops: Sequence[str] = (), on_text: Optional[OnText] = None,
        grammar: Optional[str] = None) -> Recall:
    """Graft ``block`` at its own positions, prefill ``query``, and answer (greedily by default)."""
    err = incompatibility(block, eng.fingerprint)
    if err is not None:
        raise err
    qtok = eng.tokenize(query, add_special=False)
    if not qtok:
        raise ConfigError("the query is empty")
    phases: dict[str, float] = {}
    return answer(eng, block, qtok, lambda: graft(eng, store, block, phases), graft=True,
                  max_tokens=max_tokens, sampling=sampling, phases=phases, stops=stops, on_text=on_text,
                  grammar=grammar)
