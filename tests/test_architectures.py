"""Every architecture of scripts/tiny_models.py's `ARCHS` (tiny random-weight GGUFs of real llama.cpp
bodies: Qwen3-MoE, Qwen 3.5's gated delta net, Granite 4 / Nemotron-H / pure Mamba-2, LFM2, GPT-OSS,
DeepSeek 2's latent attention) end to end: llama.cpp's own state bytes parse per memory kind
(`graftmem.core.statefmt`), learn / ask / verify / a chained child are byte-exact (SHA-256 of the
logits), what a recurrent state cannot do is refused by name before any work, and the server's prompt
cache learns, grafts after a restart and warm-starts exactly on a hybrid, a recurrent and a windowed
model. One engine per architecture for the module; texts of a few hundred tokens."""

from __future__ import annotations

import json

import openai
import pytest

from graftmem import Memory, UnsupportedFeature
from graftmem.core import statefmt as sf
from graftmem.core.engine import Engine
from graftmem.memory.exactness import verify_block
from graftmem.server import RECEIPT_HEADER, api_server
from graftmem.store.chain import full_state
from graftmem.store.local import Store

from .conftest import long_text
from .tiny import arch_path, tiny_models

ARCHS = list(tiny_models().ARCHS)

#: What llama.cpp writes per sequence for each, section by section (`statefmt.layout`).
LAYOUT = {
    "qwen3moe": ["kv"], "deepseek2": ["kv-latent"], "gpt-oss": ["kv", "kv"], "qwen35": ["kv+ext", "recurrent"],
    "granitehybrid": ["kv", "recurrent"], "nemotron_h": ["kv", "recurrent"], "mamba2": ["recurrent"],
    "lfm2": ["kv", "recurrent"],
}
KIND = {"qwen3moe": "attention", "deepseek2": "attention", "gpt-oss": "window", "mamba2": "recurrent",
        "qwen35": "hybrid", "granitehybrid": "hybrid", "nemotron_h": "hybrid", "lfm2": "hybrid"}


@pytest.fixture(scope="module")
def engines():
    """One engine per architecture, loaded on first use and closed with the module."""
    open_: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in open_:
            open_[name] = Engine(arch_path(name), {"n_ctx": 2048, "n_threads": 1})
        return open_[name]

    yield get
    for e in open_.values():
        e.close()


def _states(eng: Engine, tokens: list[int], cut_at: int) -> tuple[bytes, bytes]:
    with eng.session():
        eng.prefill(tokens[:cut_at])
        short = bytes(eng.capture())
        eng.prefill(tokens[cut_at:])
        return short, bytes(eng.capture())


def test_every_architecture_is_covered():
    assert set(LAYOUT) == set(ARCHS) == set(KIND)


@pytest.mark.parametrize("name", ARCHS)
def test_llamas_own_state_bytes_parse_per_memory_kind(engines, name):
    """The bytes of ``llama_state_seq_get_data`` parse exactly (re-encoded byte for byte) as the memory kind
    the engine reports; a delta of a child over its parent merges back to the child's bytes (a recurrent
    section is replaced whole); a prefix is cut out of a longer state only where every section keeps every
    position (attention), and refused with StateLayoutError elsewhere (a window past its size, a recurrent
    state)."""
    eng = engines(name)
    assert eng.memory.kind == KIND[name] and eng.memory.arch == tiny_models().ARCHS[name].arch
    assert eng.memory.latent == (name == "deepseek2")
    tokens = eng.tokenize(long_text(240, seed=5))[:300]
    short, whole = _states(eng, tokens, 200)
    assert sf.layout(whole) == LAYOUT[name]
    assert sf.encode_state(sf.parse_state(whole)) == whole
    delta = sf.split(short, whole, 200)
    assert sf.merge(short, delta) == whole
    assert len(delta) < len(whole) or eng.memory.kind == "recurrent"  # Mamba-2: the delta IS the new state
    if eng.memory.cuts:
        assert bytes(sf.cut(whole, 200)) == short
    else:
        with pytest.raises(sf.StateLayoutError, match="recurrent|sliding-window"):
            sf.cut(whole, 200)


@pytest.mark.parametrize("name", ARCHS)
def test_learn_ask_verify_and_a_child_are_byte_exact(engines, name, tmp_path):
    eng = engines(name)
    assert eng.exactness.exact, eng.exactness.reason
    with Memory(engine=eng, home=tmp_path / "home") as mem:
        block = mem.learn(long_text(380, seed=11), name="manual")
        assert 400 < block.n_tokens < 700
        r = mem.ask(block.id, "\nQ: what comes first?\nA:", max_tokens=4)
        assert r.receipt.exact and r.receipt.tokens_restored == block.n_tokens
        rep = mem.verify(block.id, samples=4, cross_process=False)
        assert rep.sha_equal == rep.samples == 4 and rep.floor_sha_equal == rep.floor_samples, rep
        child = mem.learn(" Then the agent checks the ticket.", parent=block.id)
        rep = mem.verify(child.id, samples=3, cross_process=False)
        assert rep.sha_equal == 3, rep


@pytest.mark.parametrize("name", [n for n in ARCHS if KIND[n] in ("recurrent", "hybrid")])
def test_what_a_recurrent_state_cannot_do_is_refused_by_name_before_any_work(engines, name, tmp_path):
    eng = engines(name)
    arch = tiny_models().ARCHS[name].arch
    with eng.session():
        eng.prefill(eng.tokenize("the agent reads the manual"))
        n = eng.n_past
        with pytest.raises(UnsupportedFeature, match=arch) as info:
            eng.trim(n - 2)
        assert info.value.arch == arch and "trimming" in info.value.feature
        assert eng.n_past == n  # nothing changed
        eng.trim(n)  # dropping nothing is no trim: allowed
    with Memory(engine=eng, home=tmp_path / "home") as mem:
        block = mem.learn(long_text(60, seed=3))
        with pytest.raises(UnsupportedFeature, match=f"{arch}.*reprefill"):
            verify_block(eng, mem.store, block.id, samples=2, cross_process=False, fresh="trim")


def _ask(c: openai.OpenAI, messages, *, cache: bool = True) -> tuple[str, dict]:
    raw = c.chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=3, temperature=0, extra_body={"graftmem": {"cache": cache}})
    return raw.parse().choices[0].message.content, json.loads(raw.headers[RECEIPT_HEADER])


@pytest.mark.parametrize("name", ARCHS)
def test_the_prompt_cache_learns_grafts_after_a_restart_and_warm_starts_exactly(engines, name, tmp_path):
    """Every architecture (hybrids, pure recurrent, windowed MoE, latent attention): a conversation's second
    turn learns the system prompt and turn 1 (captured at each segment's end during the prefill where the
    state cannot be cut: no silent "nothing learned"), the stored system prompt is byte for byte a fresh
    prefill's, a restarted server grafts the chain with the cold request's first logits and answer, and a
    warm start keeps the grafted chain in RAM (no trim on a recurrent state) and answers from it."""
    eng = engines(name)
    system = {"role": "system", "content": "You are a shop's support agent. " + long_text(200, seed=23)}
    t1 = [system, {"role": "user", "content": "Hi"}]
    t2 = t1 + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Thanks"}]
    t3 = t2 + [{"role": "assistant", "content": "Welcome"}, {"role": "user", "content": "Bye"}]
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [eng], min_prefix_tokens=32, sightings=2) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            cold_text, cold = _ask(c, t3, cache=False)
            _ask(c, t1)
            text2, _ = _ask(c, t2)  # the cells t1 left end in its answer: reused only where they can be
            assert srv.pipeline.wait_idle()
            autos = sorted(store.list(kind="auto"), key=lambda b: b.metadata["segment"])
            assert [b.metadata["segment"] for b in autos] == [0, 1], autos
        with eng.session():
            eng.prefill(list(autos[0].tokens))
            fresh = bytes(eng.capture())
        assert full_state(store, autos[0]) == fresh
        with api_server(store, [eng], min_prefix_tokens=32, sightings=2, warm=False) as srv:  # a restart
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            text, r3 = _ask(c, t3)
            assert r3["source"] == "store" and r3["block_id"] == autos[1].id, r3
            assert r3["first_logits_sha256"] == cold["first_logits_sha256"] and text == cold_text
        with api_server(store, [eng], min_prefix_tokens=32, sightings=2) as srv:  # warm: the chain in RAM
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            text, r4 = _ask(c, t3)
            assert r4["source"] == "ram" and r4["tokens_restored"] == autos[1].pos_end, r4
            assert r4["first_logits_sha256"] == cold["first_logits_sha256"] and text == cold_text
    finally:
        store.close()


@pytest.mark.parametrize("name", ARCHS)
def test_a_bundle_moves_a_chain_to_another_home_rederived_and_grafts_exactly(engines, name, tmp_path):
    """Export a block and its chained child, import them into another home with the default
    re-derivation (every state prefilled again there and compared byte for byte), and ask there: the
    receipt's first logits are the source's."""
    eng = engines(name)
    q = "\nQ: what comes first?\nA:"
    with Memory(engine=eng, home=tmp_path / "a") as a:
        block = a.learn(long_text(200, seed=5), name="manual")
        child = a.learn(" Then the agent checks the ticket.", parent=block.id)
        want = a.ask(child.id, q, max_tokens=2)
        a.export(tmp_path / "chain.gmb", [block.id, child.id])
    with Memory(engine=eng, home=tmp_path / "b") as b:
        report = b.import_bundle(tmp_path / "chain.gmb")
        assert {x.id for x in b.get_all()} >= {block.id, child.id}, report
        assert b.get(child.id).provenance == "rederived"
        got = b.ask(child.id, q, max_tokens=2)
        assert got.receipt.first_logits_sha256 == want.receipt.first_logits_sha256
        assert got.text == want.text


@pytest.mark.parametrize("name", ARCHS)
def test_a_stored_response_continues_after_a_restart_as_it_does_in_ram(engines, name, tmp_path):
    """A Responses turn stored as a KV chain (prompt and generated tokens), continued on the same server
    (its cells in RAM) and, with the same input, on a restarted server on the same home (no warm start):
    the restarted one grafts the stored chain and computes the same first logits and answer."""
    eng = engines(name)
    greedy = {"temperature": 0, "max_output_tokens": 3}
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [eng]) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            instructions = "You help. " + long_text(60, seed=3)
            r1 = c.responses.create(model="m", instructions=instructions, input="Hi", **greedy)
            follow = {"model": "m", "instructions": instructions, "input": "And then?",
                      "previous_response_id": r1.id, **greedy}
            in_ram = c.responses.create(**follow)
            ra = in_ram.model_extra["graftmem"]
            assert ra["response"]["continued"] is True
            assert srv.pipeline.wait_idle()
        with api_server(store, [eng], warm=False) as srv:  # a restart
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            again = c.responses.create(**follow)
            rb = again.model_extra["graftmem"]
            assert rb["source"] == "store" and rb["response"]["chain"] == ra["response"]["chain"], rb
            assert rb["first_logits_sha256"] == ra["first_logits_sha256"]
            assert again.output_text == in_ram.output_text
    finally:
        store.close()
