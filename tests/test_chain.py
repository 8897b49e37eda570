"""Chained blocks: a child learned on a grafted parent is byte-exact against a fresh sequential
prefill of the chain, is stored as a delta whose rebuilt bytes equal a full capture, and cannot
lose its parent silently. Real engines, both architectures, small blocks."""

from __future__ import annotations

import os

import numpy as np
import pytest

from graftmem import BlockCorrupted, BlockNotFound, ConfigError
from graftmem.core.identity import block_id_for
from graftmem.store.chain import full_state, full_tokens, segments
from graftmem.core.engine import logits_sha256
from graftmem.core import statefmt as sf
from graftmem.core.decoding import decode
from graftmem.memory.exactness import verify_block

from .conftest import long_text

# a 1-token query (llama.cpp's split-KV decode path) and a >= 64-token one (the tiled path) are the
# lengths where cell indices change the rounding on Gemma 3
QUERIES = ["\nQ: what is the first step?", " Then", "\n\nThe policy says",
           " " + long_text(60, 99)]


def _fresh(eng, segs, query=None):
    """State bytes and query logits SHA of a fresh sequential prefill of ``segs``."""
    with eng.lock:
        eng.reset()
        for s in segs:
            eng.prefill(s)
        state = bytes(eng.capture())
        sha = None
        if query is not None:
            eng.prefill(eng.tokenize(query, add_special=False))
            sha = logits_sha256(eng.logits())
        eng.reset()
    return state, sha


def _rebuilt(m, block):
    return full_state(m.store, block, fingerprint=m.fingerprint)


@pytest.mark.parametrize("fixture,words", [("mem", (80, 60, 40)), ("gmem", (300, 220, 90))])
def test_chain_is_exact_and_stored_as_delta(request, fixture, words):
    """Three levels; Gemma's chain (~670 tokens) crosses its 512-token sliding window."""
    m = request.getfixturevalue(fixture)
    eng = m.engine
    root = m.learn(long_text(words[0], 1), name="system")
    child = m.learn(" " + long_text(words[1], 2), parent=root.id, name="manual")
    grand = m.learn(" " + long_text(words[2], 3), parent=child.id, name="notes")

    # identity and positions
    ctoks = eng.tokenize(" " + long_text(words[1], 2), add_special=False)
    assert child.tokens == ctoks and child.parent == root.id
    assert child.id == block_id_for(m.fingerprint, ctoks, root.id) != block_id_for(m.fingerprint, ctoks)
    assert child.pos_start == root.pos_end and grand.pos_start == child.pos_end
    assert segments(m.store, grand) == [root.tokens, child.tokens, grand.tokens]
    assert full_tokens(m.store, grand) == root.tokens + child.tokens + grand.tokens

    # stored as deltas, much smaller than the full state
    for b in (child, grand):
        assert b.storage == "delta"
        assert b.state_size < 0.7 * b.full_state_size
        assert m.store.path_of(b.id).stat().st_size < 0.7 * b.full_state_size

    # ONE fresh sequential prefill of the chain (one call per block) is the reference for everything
    # below: its captures after the child and after the grandchild (a capture reads the cells, it
    # changes none: the bytes are those of a fresh prefill of the child's chain, then of the whole
    # chain); then the queries' logits, the query cells trimmed between samples (which leaves exactly
    # the cells a fresh prefill leaves: graftmem.memory.exactness); the first query is asked right after
    # the prefill, and its greedy generation decoded there, before any trim
    segs = segments(m.store, grand)
    assert segments(m.store, child) == segs[:2]
    full = {}
    want = []
    with eng.session():
        for b, s in zip((root, child, grand), segs):
            eng.prefill(s)
            full[b.id] = bytes(eng.capture())
        for q in QUERIES:
            eng.prefill(eng.tokenize(q, add_special=False))
            want.append(logits_sha256(eng.logits()))
            if q == QUERIES[0]:
                want_gen = decode(eng, 8).tokens
            eng.trim(grand.pos_end)

    # rebuilt bytes == a full capture of a fresh sequential prefill, byte for byte
    for b in (child, grand):
        assert _rebuilt(m, b) == full[b.id]

    # the graft == fresh sequential prefill, SHA-256 of the logits; greedy generation after the graft
    # == after the fresh prefill (every decode step)
    for q, w in zip(QUERIES, want):
        r = m.ask(grand.id, q, max_tokens=8 if q == QUERIES[0] else 1)
        assert r.receipt.first_logits_sha256 == w, q
        if q == QUERIES[0]:
            assert r.receipt.tokens_restored == grand.pos_end
            assert r.tokens == want_gen

    # verify's own fresh side on the chain (each block in its call) against its grafts. rep.ok does not
    # read the floor (fresh vs fresh: the whole chain re-prefilled twice more, the cost of this call):
    # off here; the floor, trim's self-check included, is asserted by test_exactness's 50-sample reports
    # and tests/test_verify_trim.py
    rep = verify_block(eng, m.store, grand.id, samples=3, cross_process=False, floor_samples=0)
    assert rep.ok, rep


def test_child_grafts_in_a_new_process(mem):
    root = mem.learn(long_text(30, 4))
    child = mem.learn(" " + long_text(20, 5), parent=root.id)
    rep = mem.verify(child.id, samples=3, cross_process=True, record=False)
    assert rep.cross_process is True and rep.ok


def test_smollm2_chain_equals_one_call_concatenation(mem):
    """On the dense Q4_1 model even one prefill call over the concatenated tokens is equal."""
    root = mem.learn(long_text(120, 6))
    child = mem.learn(" " + long_text(120, 7), parent=root.id)
    _, want = _fresh(mem.engine, [root.tokens + child.tokens], QUERIES[0])
    assert mem.ask(child.id, QUERIES[0], max_tokens=1).receipt.first_logits_sha256 == want



def test_same_text_on_another_parent_is_another_block(tiny_mem):
    mem = tiny_mem
    a = mem.learn(long_text(40, 8))
    b = mem.learn(long_text(40, 9))
    ca = mem.learn(" shared manual text", parent=a.id)
    cb = mem.learn(" shared manual text", parent=b.id)
    assert ca.id != cb.id and ca.tokens == cb.tokens
    assert mem.learn(" shared manual text", parent=a.id).id == ca.id  # deduplicated


def test_delete_parent_refused_unless_cascade(tiny_mem):
    mem = tiny_mem
    root = mem.learn(long_text(40, 10))
    child = mem.learn(" " + long_text(30, 11), parent=root.id)
    grand = mem.learn(" " + long_text(20, 12), parent=child.id)
    other = mem.learn(long_text(30, 13))
    with pytest.raises(ConfigError, match="cascade=True"):
        mem.delete(root.id)
    assert mem.store.contains(root.id) and mem.store.contains(grand.id)
    assert mem.delete(grand.id) == [grand.id]
    gone = mem.delete(root.id, cascade=True)
    assert gone == [child.id, root.id]
    assert [b.id for b in mem.get_all()] == [other.id]


def test_cli_delete_refuses_parent(tiny_mem, capsys):
    mem = tiny_mem
    from graftmem.cli import main

    root = mem.learn(long_text(30, 14))
    mem.learn(" " + long_text(20, 15), parent=root.id)
    assert main(["--home", str(mem.store.home), "delete", root.id]) == 2
    assert "cascade" in capsys.readouterr().err
    assert mem.store.contains(root.id)


def test_tampered_parent_refuses_the_child(tiny_mem):
    mem = tiny_mem
    root = mem.learn(long_text(60, 16))
    child = mem.learn(" " + long_text(40, 17), parent=root.id)
    path = mem.store.path_of(root.id)
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 4096] ^= 1  # a byte of the parent's state
    os.chmod(path, 0o644)
    path.write_bytes(bytes(raw))
    with pytest.raises(BlockCorrupted, match="digest"):
        mem.ask(child.id, " Q", max_tokens=1)


def test_tampered_delta_refused(tiny_mem):
    mem = tiny_mem
    root = mem.learn(long_text(60, 18))
    child = mem.learn(" " + long_text(40, 19), parent=root.id)
    path = mem.store.path_of(child.id)
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 100] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(BlockCorrupted):
        mem.ask(child.id, " Q", max_tokens=1)


def test_missing_parent_refused(tiny_mem):
    mem = tiny_mem
    root = mem.learn(long_text(30, 20))
    child = mem.learn(" " + long_text(20, 21), parent=root.id)
    mem.store.path_of(root.id).unlink()  # e.g. another process, or a bundle that left it behind
    mem.store.reconcile()
    with pytest.raises(BlockNotFound):
        mem.ask(child.id, " Q", max_tokens=1)
    with pytest.raises(BlockNotFound):
        mem.learn(" more", parent=root.id)


def test_chat_cannot_be_chained(tiny_mem):
    mem = tiny_mem
    root = mem.learn(long_text(20, 22))
    with pytest.raises(ConfigError, match="chat"):
        mem.learn("hello", parent=root.id, chat=True)


# ----------------------------------------------------------------------------- _statefmt, pure
def test_state_roundtrip_and_split_on_real_bytes(smol, gemma):
    for eng, n_sections in ((smol, 1), (gemma, 2)):
        toks = eng.tokenize(long_text(60, 23))
        with eng.lock:
            eng.reset()
            eng.prefill(toks[:40])
            parent = bytes(eng.capture())
            eng.prefill(toks[40:])
            full = bytes(eng.capture())
            eng.reset()
        secs = sf.parse_state(full)
        assert len(secs) == n_sections
        assert all(list(s.positions) == list(range(len(toks))) for s in secs)
        assert sf.encode_state(secs) == full
        delta = sf.split(parent, full, 40)
        assert sf.merge(parent, delta) == full
        assert sf.delta_sizes(parent, delta) == len(full)
        with pytest.raises(sf.StateLayoutError):
            sf.parse_state(full[:-1])
        with pytest.raises(sf.StateLayoutError):
            sf.parse_state(full + b"\0")
        with pytest.raises(sf.StateLayoutError):  # the old cells are not the parent's
            sf.split(parent, full, 20)


def _synthetic(v_trans: bool, positions: list[int], seed: int) -> sf.Section:
    rng = np.random.default_rng(seed)
    n = len(positions)
    meta = np.zeros(n, dtype=sf._META)
    meta["pos"], meta["n_seq_id"] = positions, 1
    k = [sf._Layer(1, 8, rng.integers(0, 255, (n, 8), dtype=np.uint8)) for _ in range(2)]
    if v_trans:
        v = [sf._Layer(1, 2, rng.integers(0, 255, (4, n, 2), dtype=np.uint8), 4) for _ in range(2)]
    else:
        v = [sf._Layer(1, 8, rng.integers(0, 255, (n, 8), dtype=np.uint8)) for _ in range(2)]
    return sf.Section(meta=meta, v_trans=v_trans, k=k, v=v)


@pytest.mark.parametrize("v_trans", [False, True])
def test_split_merge_synthetic_layouts(v_trans):
    """Transposed V (flash attention off) and a window section that keeps only the parent's tail."""
    full_secs = [_synthetic(v_trans, list(range(10)), 1), _synthetic(v_trans, list(range(4, 10)), 2)]
    parent_secs = [full_secs[0].take(slice(0, 7)),
                   sf._concat(_synthetic(v_trans, [1, 2, 3], 3), full_secs[1].take(slice(0, 3)))]
    full, parent = sf.encode_state(full_secs), sf.encode_state(parent_secs)
    assert sf.encode_state(sf.parse_state(full)) == full
    delta = sf.split(parent, full, 7)
    assert sf.merge(parent, delta) == full
    out = memoryview(bytearray(len(full)))
    assert sf.merge(parent, delta, out) is out and bytes(out) == full


@pytest.mark.parametrize("v_trans", [False, True])
def test_place_cells_pads_a_trimmed_window(v_trans):
    full = _synthetic(v_trans, list(range(10)), 4)
    window = _synthetic(v_trans, list(range(6, 10)), 5)
    state = sf.encode_state([full, window])
    placed = sf.parse_state(sf.place_cells(state, 10))
    assert [list(s.positions) for s in placed] == [list(range(10))] * 2
    assert sf.encode_state([placed[1].take(slice(6, None))]) == sf.encode_state([window])
    assert all(not l.data[:, :6].any() if v_trans else not l.data[:6].any() for l in placed[1].k[:0] + placed[1].v)
    assert not any(l.data[:6].any() for l in placed[1].k)  # placeholders are zero
    assert sf.place_cells(sf.encode_state([full]), 10) is None  # nothing trimmed: nothing to do
    with pytest.raises(sf.StateLayoutError):  # a window that does not end at the last position
        sf.place_cells(state, 12)


@pytest.mark.parametrize("v_trans", [False, True])
def test_place_cells_into_writes_the_same_bytes(v_trans):
    """The in-place writer (zero runs, no intermediate arrays) against a placement built the plain
    way: zero placeholder cells concatenated in front of the window section, then encoded."""
    full = _synthetic(v_trans, list(range(10)), 6)
    window = _synthetic(v_trans, list(range(6, 10)), 7)
    state = sf.encode_state([full, window])
    meta = np.zeros(6, dtype=sf._META)
    meta["pos"], meta["n_seq_id"] = np.arange(6), 1
    ph = sf.Section(meta=meta, v_trans=v_trans,
                    k=[sf._Layer(l.type, l.unit, np.zeros((6, l.unit), np.uint8)) for l in window.k],
                    v=[sf._Layer(l.type, l.unit, np.zeros((l.n_embd, 6, l.unit) if v_trans else (6, l.unit),
                                                          np.uint8), l.n_embd) for l in window.v])
    expected = sf.encode_state([full, sf._concat(ph, window)])
    assert sf.needs_placing(state) and not sf.needs_placing(sf.encode_state([full]))
    assert sf.place_cells(state, 10) == expected
    buf = bytearray(len(expected) + 100)  # the engine's buffer: larger than needed, with junk in it
    buf[:] = b"\xff" * len(buf)
    got = sf.place_cells_into(state, 10, lambda n: memoryview(buf)[:n])
    assert len(got) == len(expected) and bytes(got) == expected
    with pytest.raises(sf.StateLayoutError):
        sf.place_cells_into(sf.encode_state([full]), 10, lambda n: memoryview(bytearray(n)))


def test_join_refuses_overlapping_positions():
    a = sf.encode_state([_synthetic(False, [0, 1, 2], 6)])
    b = sf.encode_state([_synthetic(False, [2, 3], 7)])
    with pytest.raises(sf.StateLayoutError):
        sf.join(a, b)
    c = sf.encode_state([_synthetic(False, [3, 4], 8)])
    assert [list(s.positions) for s in sf.parse_state(sf.join(a, c))] == [[0, 1, 2, 3, 4]]
