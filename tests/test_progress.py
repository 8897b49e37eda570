"""The progress bars of prefill model the slowing rate: work = sum(1 + p / p0) over the positions, so the
time left tqdm derives from the work done so far holds while the tokens per second fall (a 20,000-token
learn said 00:59 left at 3 % and took 6 minutes). Checked on the model's arithmetic and on what learn
and learn_document hand the bar (their segments' positions), not on timings."""

from __future__ import annotations

import pytest

from graftmem.core import progress
from graftmem.core.progress import PREFILL_P0, PrefillBar, prefill_work

from .conftest import long_text


def test_work_grows_with_position():
    assert prefill_work(0, 1) == 1.0
    assert prefill_work(0, 1000) == pytest.approx(1000 + 1000 * 999 / 2 / PREFILL_P0)
    # the same 1,000 tokens late in a context are more work than early: what a token-counting bar missed
    assert prefill_work(19000, 1000) > 5 * prefill_work(0, 1000) > 0
    assert prefill_work(0, 2000) == pytest.approx(prefill_work(0, 1000) + prefill_work(1000, 1000))


def test_bar_counts_work_across_segments(capsys):
    bar = PrefillBar([(0, 512), (0, 512), (4096, 100)], "learn", leave=False)
    for n in (300, 300, 300, 124, 100):  # crossing the page ends, as Engine.prefill reports chunks
        bar.update(n)
    assert bar.tokens == bar.tokens_total == 1124
    assert bar.bar.n == pytest.approx(bar.bar.total, abs=1e-2)
    assert bar.bar.total == pytest.approx(2 * prefill_work(0, 512) + prefill_work(4096, 100), abs=1e-2)
    line = str(bar.bar)  # what the terminal shows: tokens and rate inside tqdm's brackets, no stray comma
    assert "| , " not in line and ", 1,124/1,124 tok, " in line and line.endswith(" tok/s]"), line
    bar.close()


def test_learn_and_documents_give_the_bar_their_positions(tiny_mem, monkeypatch):
    seen: list[list[tuple[int, int]]] = []
    real = progress.PrefillBar

    def spy(segments, desc, leave, p0=PREFILL_P0):
        seen.append(list(segments))
        return real(segments, desc, leave, p0)

    monkeypatch.setattr(progress, "PrefillBar", spy)
    root = tiny_mem.learn(long_text(1400, seed=4), name="root", progress=True)
    tiny_mem.learn(long_text(1400, seed=5), name="child", parent=root.id, progress=True)
    assert seen[0] == [(0, root.n_tokens)] and seen[1][0][0] == root.pos_end  # a chained text starts late
    seen.clear()
    rep = tiny_mem.learn_document(long_text(1500, seed=6), window=512, overlap=32, progress=True)
    assert len(seen) == 1 and len(seen[0]) == rep.pages and all(s == 0 for s, _ in seen[0])
    seen.clear()  # a rerun skips every page: no bar (it showed the skipped tokens done at 500,000 tok/s)
    again = tiny_mem.learn_document(long_text(1500, seed=6), window=512, overlap=32, progress=True)
    assert again.pages_skipped == rep.pages and seen == []
