"""verify's default mode trims the query's cells between samples instead of re-prefilling the block; the
floor's second sample compares a trimmed prefix with a full re-prefill, so a trim that leaves different
cells fails the report. The tiny Llama 3.1 suffices: what is tested is verify's bookkeeping over real
llama.cpp cells, not a model family."""

from __future__ import annotations

from graftmem.memory.exactness import verify_block


def test_auto_trims_and_a_trim_that_keeps_the_wrong_cells_fails_the_floor(tiny_mem):
    mem = tiny_mem
    block = mem.learn("Refunds: ask for the order number, check the date, then approve or decline.",
                      name="refunds")
    eng = mem.engine
    calls: list[str] = []
    real_trim, real_reset = eng.trim, eng.reset
    eng.trim = lambda n: (calls.append("trim"), real_trim(n))[1]
    eng.reset = lambda: (calls.append("reset"), real_reset())[1]
    try:
        rep = verify_block(eng, mem.store, block.id, samples=6, cross_process=False)
        assert rep.ok and rep.sha_equal == 6 and rep.floor_sha_equal == rep.floor_samples == 2
        # the block was prefilled for sample 0 and the two floor samples only; every other sample trimmed
        assert calls.count("trim") == 5, calls
        fresh_resets = calls.count("reset")
        full = verify_block(eng, mem.store, block.id, samples=6, fresh="reprefill", cross_process=False)
        assert [r.fresh_sha256 for r in full.rows] == [r.fresh_sha256 for r in rep.rows]

        # a trim that drops one cell of the prefix too many: the floor's trimmed-vs-re-prefilled sample
        # differs, and so do the trimmed samples from the grafts: the report is not ok
        calls.clear()
        eng.trim = lambda n: real_trim(n - 1)
        bad = verify_block(eng, mem.store, block.id, samples=6, cross_process=False)
        assert bad.floor_sha_equal == 1 and bad.sha_equal == 1 and not bad.ok
    finally:
        del eng.trim, eng.reset
    assert fresh_resets >= 3


def test_a_report_whose_floor_differs_is_not_ok_even_if_every_sample_matched(tiny_mem):
    """The floor compares two fresh prefills: when they differ, the engine is not deterministic here, and
    samples that happened to match their graft prove nothing (``ok`` read only the samples before)."""
    mem = tiny_mem
    block = mem.learn("Returns: ask for the receipt, check the date, then refund or exchange.", name="returns")
    rep = verify_block(mem.engine, mem.store, block.id, samples=3, cross_process=False)
    assert rep.ok and rep.floor_sha_equal == rep.floor_samples == 2
    shaky = rep.model_copy(update={"floor_sha_equal": 1})
    assert shaky.sha_equal == shaky.samples and not shaky.ok
