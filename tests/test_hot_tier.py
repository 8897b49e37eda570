"""The hot tier (`graftmem.store.hot`): states of recently written or grafted blocks kept in RAM.

Exact: a graft from the hot tier is a graft of the very bytes a disk read returns (compared byte for
byte, and by the logits after a query, against a fresh prefill). Safe: a forgotten block is not grafted
from RAM, an engine of another fingerprint is refused as from disk, and the tier keeps to its bound.
The suite runs with the tier off (tests/conftest.py); these tests turn it on for themselves.
"""

from __future__ import annotations

import pytest

from graftmem import BlockNotFound, Memory
from graftmem.core.engine import logits_sha256
from graftmem.memory.answer import graft
from graftmem.store import load_state
from graftmem.store.hot import HotTier, configure_hot_tier, hot_key, hot_tier

from .conftest import long_text


@pytest.fixture
def tier():
    """This process's hot tier turned on (64 MiB) for one test, then off again."""
    yield configure_hot_tier(64 << 20)
    configure_hot_tier(0)


def _copy(n: int) -> memoryview:
    return memoryview(bytearray(n))


@pytest.mark.parametrize("model", ["smol", "tiny_llama"])
def test_a_graft_from_the_hot_tier_is_the_disk_graft_byte_for_byte(tier, model, request, tmp_path):
    eng = request.getfixturevalue(model)
    with Memory(engine=eng, home=tmp_path / "hot") as mem:
        block = mem.learn(long_text(120, seed=41), name="hot")
        kept = tier.get(hot_key(block))
        assert kept is not None and kept.readonly  # admitted by the writer, immutable
        _, disk = load_state(mem.store, block.id, _copy, fingerprint=eng.fingerprint, hot=False)
        assert bytes(kept) == bytes(disk)
        q = eng.tokenize(" The answer is", add_special=False)
        shas = []
        for hot in (True, False):
            with eng.session():
                _, view = load_state(mem.store, block.id, eng.buffer, fingerprint=eng.fingerprint, hot=hot)
                assert (view.obj is kept.obj) == hot  # served from RAM, or read from the file
                eng.restore(view, block.pos_end, block.one_token_from)
                eng.prefill(q)
                shas.append(logits_sha256(eng.logits()))
        with eng.session():
            eng.prefill(list(block.tokens))  # the reference: the block's prefill, then the query's
            eng.prefill(q)
            fresh = logits_sha256(eng.logits())
        assert shas == [fresh, fresh]
        rc = mem.ask(block.id, " The answer is", max_tokens=1).receipt  # the SDK's graft: from RAM
        assert rc.first_logits_sha256 == fresh and not rc.read_ms


def test_a_read_admits_on_the_second_read_and_a_forgotten_block_is_not_grafted(tier, tiny_llama, tmp_path):
    eng = tiny_llama
    with Memory(engine=eng, home=tmp_path / "hot") as mem:
        block = mem.learn(long_text(60, seed=42), name="hot")
        tier.clear()  # as after a restart: nothing kept
        key = hot_key(block)
        for n in range(2):
            assert tier.get(key) is None
            load_state(mem.store, block.id, _copy, fingerprint=eng.fingerprint)
        kept = tier.get(key)
        assert kept is not None  # the second read kept it
        mem.delete(block.id)
        with pytest.raises(BlockNotFound):
            with eng.session():
                graft(eng, mem.store, block)


def test_the_tier_keeps_to_its_bound_least_recently_used_out():
    t = HotTier(4000)
    states = {f"b{i}": bytes([i]) * 900 for i in range(6)}
    for name, data in states.items():
        t.put((name, "d"), data)
        assert t.bytes <= 4000
    assert t.get(("b0", "d")) is None and t.get(("b5", "d")) is not None
    assert bytes(t.get(("b2", "d"))) == states["b2"]  # used: kept over b3 at the next put
    t.put(("b6", "d"), b"x" * 900)
    assert t.get(("b3", "d")) is None and t.get(("b2", "d")) is not None
    t.put(("big", "d"), b"y" * 1001)  # over a quarter of the bound: never kept
    assert t.get(("big", "d")) is None
    assert configure_hot_tier(0).max_bytes == 0 and hot_tier().get(("b2", "d")) is None


def test_a_bad_setting_is_refused_by_name(monkeypatch):
    from graftmem import ConfigError
    from graftmem.store import hot

    for bad in ("-1", "abc", "1.5"):
        monkeypatch.setenv(hot.HOT_TIER_ENV, bad)
        with pytest.raises(ConfigError, match="GRAFTMEM_HOT_TIER_MB"):
            hot._from_env()
    monkeypatch.setenv(hot.HOT_TIER_ENV, "3")
    assert hot._from_env() == 3 << 20
    monkeypatch.delenv(hot.HOT_TIER_ENV)
    assert hot._from_env() == hot.DEFAULT_HOT_TIER_MB << 20
