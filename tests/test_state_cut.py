"""The state of a prompt's first segments, cut out of a capture of the whole sequence (the prompt and
its answer, as a served request leaves them), is byte for byte the state a fresh prefill of those
segments' calls captures: what lets the server learn a prefix from cells it already computed, with
no second prefill (`graftmem.core.statefmt.cut`)."""

from __future__ import annotations

import pytest

from graftmem.core import statefmt
from graftmem.core.engine import Engine

from .conftest import long_text


def _segments(engine: Engine, sizes: list[int]) -> list[list[int]]:
    """Segments of about ``sizes`` words each (the first with BOS), cut where a server would cut them."""
    out = []
    for i, n in enumerate(sizes):
        out.append(engine.tokenize(long_text(n, seed=40 + i) + "\n", add_special=i == 0))
    return out


def _fresh(engine: Engine, segs: list[list[int]]) -> list[bytes]:
    """A fresh prefill of ``segs``, one call per segment, captured after each call: ``out[k]`` is the
    state of a fresh prefill of ``segs[:k + 1]`` (a capture reads the cells, it changes none)."""
    out = []
    with engine.session():
        for s in segs:
            engine.prefill(s)
            out.append(bytes(engine.capture()))
    return out


def _long(engine: Engine, segs: list[list[int]], answer: int = 3) -> bytes:
    """All of ``segs`` prefilled call by call, then ``answer`` decoded tokens one by one, captured."""
    with engine.session():
        for s in segs:
            engine.prefill(s)
        for _ in range(answer):
            engine.prefill([int(engine.logits().argmax())])
        return bytes(engine.capture())


def _check_cuts(engine: Engine, segs: list[list[int]]) -> bytes:
    """Each cut of the long state (after segment k) against a fresh capture of the first k segments;
    returns the long state."""
    whole = _long(engine, segs)
    fresh = _fresh(engine, segs[:-1])  # another computation than the long one: its own session
    n = 0
    for k in range(1, len(segs)):
        n += len(segs[k - 1])
        assert statefmt.cut(whole, n) == fresh[k - 1], f"cut after segment {k} ({n} tokens)"
    return whole


def test_smollm2_cut_equals_fresh_capture_across_an_ubatch_boundary(smol):
    segs = _segments(smol, [300, 12, 150, 6])  # ~420, ~17, ~210, ~9 tokens: crosses n_ubatch=512
    _check_cuts(smol, segs)


def test_smollm2_cut_with_transposed_v(tmp_path):
    """Without flash attention llama.cpp stores V transposed (one column per cell): cut along cells."""
    with Engine("smollm2", {"flash_attn": False, "probe": False}) as e:
        segs = _segments(e, [40, 10, 20])
        assert statefmt.parse_state(_check_cuts(e, segs))[0].v_trans


def test_gemma3_cut_inside_the_window_equals_fresh_capture(gemma):
    segs = _segments(gemma, [120, 10, 60, 5])  # ~300 tokens: every section holds every position
    assert sum(map(len, segs)) + 3 <= gemma.n_swa
    _check_cuts(gemma, segs)


def test_gemma3_cut_past_the_window_is_refused(gemma):
    """Past the window the sliding-window section of the longer state lacks cells the shorter prefix's
    state holds: the cut raises instead of returning other bytes (the server captures at the prefix's
    end instead)."""
    segs = _segments(gemma, [360, 150])
    assert len(segs[0]) < gemma.n_swa < sum(map(len, segs))
    with pytest.raises(statefmt.StateLayoutError, match="sliding-window"):
        statefmt.cut(_long(gemma, segs), len(segs[0]))
