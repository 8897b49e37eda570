"""The one progress bar helper: tqdm on long work (learning a long text, building a store, moving
bundles), nothing on short work or when the caller said no.

Callers get ``None`` or a bar and feed ``bar.update`` as a progress callback; keeping the policy (when a
bar is worth showing, which units) here means learn, the pager, bundles and transfers look alike.

**Prefill slows as the context grows**: attention reads every earlier cell, so a token at position p
costs about ``a + b * p``. A bar that counts tokens (tqdm's rate: tokens per second so far) promised
"00:59 left" at 3 % of a 20,000-token learn that took 6 minutes (the rate fell from 328 to 20
tokens/s). A prefill bar therefore counts *work*: each token weighs ``1 + p / PREFILL_P0``
(`prefill_work`), whose rate stays about constant, so tqdm's time left holds; it still shows tokens
and tokens/s. ``PREFILL_P0`` (= a / b) is measured by ``python -m bench.prefill_rate``
(docs/benchmarks.md, "Prefill rate vs position").
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Sequence

__all__ = ["progress_bar", "prefill_work", "PrefillBar", "PREFILL_P0"]

#: The position at which a prefilled token costs twice a token at position 0 (a / b of the fitted
#: ``seconds per token = a + b * position``): 3,477 for SmolLM2-135M on a 2-core CPU, measured to 8,192
#: positions (bench/results/prefill_rate.json; the line fits every chunk within 3 %). A ratio, so a
#: faster or slower CPU scales both terms alike; another model's shape moves it.
PREFILL_P0 = 3477.0


def prefill_work(start: int, n: int, p0: float = PREFILL_P0) -> float:
    """The work of prefilling ``n`` tokens at positions ``start .. start + n - 1``, in units of one token
    at position 0: ``sum(1 + p / p0)``."""
    if n <= 0:
        return 0.0
    return n + (n * (2 * start + n - 1) / 2) / p0


class PrefillBar:
    """A tqdm bar over the work of prefilling ``segments`` (``(start position, tokens)`` each, in the
    order they are prefilled: one for a text, one per page for a document), fed with token counts
    (``update(n)``, what `Engine.prefill` reports). Its percentage and time left are in work; the
    postfix shows tokens done and the current tokens/s."""

    def __init__(self, segments: Sequence[tuple[int, int]], desc: str, leave: bool, p0: float = PREFILL_P0) -> None:
        from tqdm.auto import tqdm

        self.segments = [(int(s), int(n)) for s, n in segments if n > 0]
        self.p0 = p0
        self.tokens_total = sum(n for _, n in self.segments)
        total = sum(prefill_work(s, n, p0) for s, n in self.segments)
        self.tokens = 0
        self._seg, self._in_seg, self._work = 0, 0, 0.0
        self._last = (time.perf_counter(), 0)
        self.bar = tqdm(total=round(total, 3), desc=desc, leave=leave, dynamic_ncols=True,
                        # tqdm hands ``{postfix}`` over as ", text": it reads as tqdm's own "[00:02<00:02, 408 it/s]"
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        self.bar.set_postfix_str(f"0/{self.tokens_total:,} tok", refresh=False)

    def update(self, n: int) -> None:
        """``n`` more tokens prefilled (across segment ends: the next segment starts at its own position)."""
        self.tokens += n
        while n > 0 and self._seg < len(self.segments):
            start, size = self.segments[self._seg]
            take = min(n, size - self._in_seg)
            self._work += prefill_work(start + self._in_seg, take, self.p0)
            self._in_seg += take
            n -= take
            if self._in_seg >= size:
                self._seg, self._in_seg = self._seg + 1, 0
        now = time.perf_counter()
        t0, k0 = self._last
        rate = (self.tokens - k0) / (now - t0) if now > t0 else 0.0
        self._last = (now, self.tokens)
        self.bar.set_postfix_str(f"{self.tokens:,}/{self.tokens_total:,} tok, {rate:.0f} tok/s", refresh=False)
        self.bar.update(round(self._work, 3) - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def progress_bar(total: int, desc: str, enabled: bool, *, unit: Literal["tok", "B"] = "tok",
                 min_total: int = 0, leave: bool = False,
                 segments: Optional[Sequence[tuple[int, int]]] = None) -> Optional[Any]:
    """A tqdm bar over ``total`` units, or None when disabled or ``total < min_total``.

    Bytes are shown scaled (KiB, MiB); tokens as counts. ``segments`` (``(start position, tokens)`` of
    each prefill, ``total`` tokens in all) makes it a `PrefillBar`, whose time left models the prefill
    slowing with position. tqdm is imported only when a bar is made.
    """
    if not enabled or total < min_total:
        return None
    if segments is not None and unit == "tok":
        return PrefillBar(segments, desc, leave)
    from tqdm.auto import tqdm

    if unit == "B":
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=leave)
    return tqdm(total=total, desc=desc, unit="tok", leave=leave, dynamic_ncols=True)
