"""A state kept in the context's own buffers (`Engine.keep_on_device`, llama.cpp's
``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``) puts back exactly the cells a restore from bytes does, and every
handle llama.cpp would abort the process on, or would copy wrong (a quantized cache), is refused first.

On this CPU build the "device" is host RAM, so these tests pin the contract (the same cells, the same
logits as a fresh prefill, refusals by name) that a GPU build's speed rests on (bench/gpu.py measures it
there); the speed on a CPU is a memcpy either way (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from graftmem import ClosedError, EngineError, Memory, UnsupportedFeature
from graftmem.core.engine import Engine, logits_sha256
from graftmem.memory.answer import graft

from .conftest import long_text
from .tiny import arch_path


def _fresh(eng: Engine, tokens: list[int], query: list[int]) -> str:
    with eng.session():
        eng.prefill(tokens)
        eng.prefill(query)
        return logits_sha256(eng.logits())


def _on_device(eng: Engine, tokens: list[int], query: list[int]) -> tuple[str, bytes, bytes]:
    """Prefill, keep on the device, wipe the cache (data too), restore from the device copy, then the query:
    the logits' SHA-256, the state captured before the copy and after its restore."""
    with eng.session():
        eng.prefill(tokens)
        before = bytes(eng.capture())
        copy = eng.keep_on_device()
        assert copy.n_tokens == len(tokens) and len(copy.description) < len(before) // 10
        eng.reset()  # zeroes every cell: what comes back comes from the device copy
        eng.restore_on_device(copy)
        assert eng.n_past == len(tokens)
        after = bytes(eng.capture())
        eng.prefill(query)
        return logits_sha256(eng.logits()), before, after


def test_smollm2_on_device_restore_equals_fresh_prefill_and_the_bytes(smol):
    tokens = smol.tokenize(long_text(300, seed=5))
    query = smol.tokenize("\nQuestion: which step comes first?", add_special=False)
    got, before, after = _on_device(smol, tokens, query)
    assert after == before  # the same cells, byte for byte, as the state it copied
    assert got == _fresh(smol, tokens, query)


def test_gemma_past_its_window_on_device_restore_of_a_graft_is_exact(gemma, tmp_path):
    """A block past the sliding window is grafted with its window cells placed at their fresh indices
    (docs/exactness.md); a device copy of that graft must restore the same placed cells."""
    with Memory(engine=gemma, home=tmp_path / "home") as mem:
        block = mem.learn(long_text(700, seed=9), name="long")
        assert block.n_tokens > gemma.n_swa
        query = gemma.tokenize("\nQuestion: which step comes first?", add_special=False)
        with gemma.session():
            graft(gemma, mem.store, block)
            grafted = bytes(gemma.capture())
            copy = gemma.keep_on_device()
            gemma.reset()
            gemma.restore_on_device(copy)
            assert bytes(gemma.capture()) == grafted
            gemma.prefill(query)
            got = logits_sha256(gemma.logits())
        assert got == _fresh(gemma, list(block.tokens), query)


def test_only_the_latest_copy_of_this_engine_is_restored(smol, gemma):
    """llama.cpp keeps one copy per sequence and context and aborts on a description that does not match
    it: an older handle, or another engine's, is refused and the cells are left as they were."""
    a = smol.tokenize(long_text(80, seed=1))
    b = smol.tokenize(long_text(120, seed=2))
    with smol.session():
        smol.prefill(a)
        old = smol.keep_on_device()
        smol.reset()
        smol.prefill(b)
        new = smol.keep_on_device()
        state = bytes(smol.capture())
        with pytest.raises(EngineError, match="no on-device copy of that state"):
            smol.restore_on_device(old)
        assert smol.n_past == len(b) and bytes(smol.capture()) == state
        with gemma.session():
            gemma.prefill(gemma.tokenize("a short text"))
            theirs = gemma.keep_on_device()
        with pytest.raises(EngineError, match="no on-device copy of that state"):
            smol.restore_on_device(theirs)
        assert smol.n_past == len(b)
        smol.reset()
        smol.restore_on_device(new)
        assert bytes(smol.capture()) == state


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "gpt-oss"])
def test_kv_architectures_restore_from_the_device_exactly(arch):
    """MoE, latent attention (MLA) and interleaved sliding windows (tiny random-weight bodies)."""
    with Engine(arch_path(arch), {"n_ctx": 2048, "n_threads": 1}) as eng:
        tokens = eng.tokenize(long_text(200, seed=3))
        query = eng.tokenize(" and then", add_special=False)
        got, before, after = _on_device(eng, tokens, query)
        assert after == before
        assert got == _fresh(eng, tokens, query)


@pytest.mark.parametrize("arch", ["mamba2", "qwen35"])
def test_recurrent_and_hybrid_memory_is_refused_by_name(arch):
    with Engine(arch_path(arch), {"n_ctx": 2048, "n_threads": 1}) as eng:
        with eng.session():
            eng.prefill(eng.tokenize("a short text"))
            with pytest.raises(UnsupportedFeature, match="restore it from bytes"):
                eng.keep_on_device()
            assert eng.n_past > 0


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_quantized_cache_is_refused_by_name(kv):
    """llama.cpp 0.3.36 copies a 32nd of a block-quantized cache's bytes on the device: measured, the
    state that comes back differs in ~96 % of its bytes (docs/benchmarks.md), so it is refused."""
    with Engine("smollm2", {"type_k": kv, "type_v": kv, "flash_attn": True, "probe": False}) as eng:
        with eng.session():
            eng.prefill(eng.tokenize("a short text"))
            with pytest.raises(UnsupportedFeature, match=f"{kv} KV cache"):
                eng.keep_on_device()


def test_a_closed_engine_refuses_and_forgets_its_copy(tiny_llama):
    eng = tiny_llama.sibling()
    with eng.session():
        eng.prefill(eng.tokenize("a short text"))
        copy = eng.keep_on_device()
    eng.close()
    with pytest.raises(ClosedError):
        eng.restore_on_device(copy)
