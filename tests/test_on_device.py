"""A state kept in the context's own buffers (`Engine.copy_on_device`, llama.cpp's
``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``) puts back exactly the cells a restore from bytes does, and every
handle llama.cpp would abort the process on, or would copy wrong (a quantized cache), is refused first.

On this CPU build the "device" is host RAM, so these tests pin the contract (the same cells, the same
logits as a fresh prefill, refusals by name) that a GPU build's speed rests on (bench/gpu.py measures it
there); the speed on a CPU is a memcpy either way (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from graftmem import ClosedError, EngineError, GraftmemError, Memory, UnsupportedFeature
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
        copy = eng.copy_on_device()
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
            copy = gemma.copy_on_device()
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
        old = smol.copy_on_device()
        smol.reset()
        smol.prefill(b)
        new = smol.copy_on_device()
        state = bytes(smol.capture())
        with pytest.raises(EngineError, match="no on-device copy of that state"):
            smol.restore_on_device(old)
        assert smol.n_past == len(b) and bytes(smol.capture()) == state
        with gemma.session():
            gemma.prefill(gemma.tokenize("a short text"))
            theirs = gemma.copy_on_device()
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
                eng.copy_on_device()
            assert eng.n_past > 0


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_quantized_cache_is_refused_by_name(kv):
    """llama.cpp 0.3.36 copies a 32nd of a block-quantized cache's bytes on the device: measured, the
    state that comes back differs in ~96 % of its bytes (docs/benchmarks.md), so it is refused."""
    with Engine("smollm2", {"type_k": kv, "type_v": kv, "flash_attn": True, "probe": False}) as eng:
        with eng.session():
            eng.prefill(eng.tokenize("a short text"))
            with pytest.raises(UnsupportedFeature, match=f"{kv} KV cache"):
                eng.copy_on_device()


def test_a_closed_engine_refuses_and_forgets_its_copy(tiny_llama):
    eng = tiny_llama.sibling()
    with eng.session():
        eng.prefill(eng.tokenize("a short text"))
        copy = eng.copy_on_device()
    eng.close()
    with pytest.raises(ClosedError):
        eng.restore_on_device(copy)


@pytest.fixture(scope="module")
def kept_smol():
    """SmolLM2 with ``keep_on_device`` (the weights are the session engine's, shared)."""
    with Engine("smollm2", {"keep_on_device": True}) as e:
        yield e


def test_keep_on_device_grafts_the_same_block_again_from_the_device_copy(kept_smol, smol, tmp_path):
    """The second ask of a block reads nothing (no read or check phase: the copy the first graft left),
    a graft of another block replaces the copy, and every answer equals the plain engine's byte for byte."""
    home = tmp_path / "home"
    with Memory(engine=kept_smol, home=home) as mem, Memory(engine=smol, home=tmp_path / "plain") as ref:
        a = mem.learn(long_text(200, seed=21), name="a")
        b = mem.learn(long_text(120, seed=22), name="b")
        ra = ref.learn(long_text(200, seed=21), name="a")
        assert ra.id == a.id
        want = ref.ask(a.id, "\nStep 2 is:", max_tokens=6)
        first = mem.ask(a.id, "\nStep 2 is:", max_tokens=6)
        assert first.receipt.read_ms is not None  # from the store
        assert kept_smol.device_copy is not None and kept_smol.device_copy.key == (a.id, a.state_digest)
        again = mem.ask(a.id, "\nStep 2 is:", max_tokens=6)
        assert again.receipt.read_ms is None and again.receipt.check_ms is None  # from the device copy
        for r in (first, again):
            assert (r.text, r.receipt.first_logits_sha256) == (want.text, want.receipt.first_logits_sha256)
        mem.ask(b.id, "\nStep 2 is:", max_tokens=2)
        assert kept_smol.device_copy.key == (b.id, b.state_digest)
        back = mem.ask(a.id, "\nStep 2 is:", max_tokens=6)
        assert back.receipt.read_ms is not None
        assert back.receipt.first_logits_sha256 == want.receipt.first_logits_sha256


def test_a_deleted_block_is_not_grafted_from_its_device_copy(kept_smol, tmp_path):
    """The copy is a cache of a stored block, not a second store: a block deleted since is refused."""
    with Memory(engine=kept_smol, home=tmp_path / "home") as mem:
        a = mem.learn(long_text(90, seed=23), name="a")
        mem.ask(a.id, "\nStep 1 is:", max_tokens=2)
        assert kept_smol.device_copy is not None and kept_smol.device_copy.key == (a.id, a.state_digest)
        mem.delete(a.id)
        with pytest.raises(GraftmemError, match=a.id[:12]):
            mem.ask(a.id, "\nStep 1 is:", max_tokens=2)
        with kept_smol.session(), pytest.raises(GraftmemError, match=a.id[:12]):
            graft(kept_smol, mem.store, a)  # a door that looked the block up before the delete (a race)


def test_keep_on_device_is_refused_at_load_where_it_cannot_be_exact():
    with pytest.raises(UnsupportedFeature, match="q8_0 KV cache"):
        Engine("smollm2", {"keep_on_device": True, "kv": "q8_0"})
    with pytest.raises(UnsupportedFeature, match="keep_on_device=False"):
        Engine(arch_path("mamba2"), {"n_ctx": 2048, "n_threads": 1, "keep_on_device": True})


def test_a_served_prefix_comes_back_from_the_device_copy_exactly(kept_smol, smol, tmp_path):
    """Through the server's chat door: a learned system prompt grafted from the store, another request in
    between (its cells replace the graft's, the device copy stays), then the first prompt again: grafted
    from the copy (no read phase in the receipt) and equal, token and log-probability, to the same request
    served cold."""
    import openai

    from graftmem.server import api_server
    from graftmem.store.local import Store

    system = "You are the support agent of a shop. " + long_text(80, seed=31)

    def msgs(q: str, sys_text: str = system) -> list[dict]:
        return [{"role": "system", "content": sys_text}, {"role": "user", "content": q}]

    def chat(c, m, cache=True):
        r = c.chat.completions.create(model="smollm2", messages=m, max_tokens=6, temperature=0, logprobs=True,
                                      top_logprobs=2, extra_body={"graftmem": {"cache": cache}})
        toks = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]
        return r.model_extra["graftmem"], [r.choices[0].message.content, toks]

    store = Store(tmp_path / "home")
    try:
        with api_server(store, [smol], min_prefix_tokens=64, sightings=1) as srv:  # learns the system prompt
            chat(openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), msgs("Hello"))
        with api_server(store, [kept_smol], warm=False, learn=False) as srv:  # grafts, learns nothing more
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            first, _ = chat(c, msgs("Where is my parcel?"))
            assert first["source"] == "store" and first.get("read_ms") is not None
            chat(c, msgs("Hi", "Be brief."))  # a short prompt, served cold: the cells change, the copy stays
            again, got = chat(c, msgs("Where is my parcel?"))
            assert again["source"] == "store" and again["block_id"] == first["block_id"]
            assert again.get("read_ms") is None and again.get("check_ms") is None  # from the device copy
            cold, want = chat(c, msgs("Where is my parcel?"), cache=False)
            assert cold["tokens_restored"] == 0
            assert got == want
    finally:
        store.close()
