"""A prefix learned on its second sighting is learned from the cells the first request left in the engine
(no second prefill): turn 2 reuses them (``cached_tokens`` > 0) and stores the system prompt and turn 1's
user message (its header but the last token: the segments seen twice by then); the system prompt's stored
state is byte for byte a fresh prefill's, and after a restart turn 3 grafts that chain with the cold
request's first-token logits. A dense model cuts the state out of one capture after the answer (`statefmt.cut`):
the tiny random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`, a real llama.cpp engine on a dense
llama body as SmolLM2 is, ~1/100th of its prefill cost); Gemma 3, past its sliding window, captures it
right after trimming the kept cells to the system prompt (no tiny model has a sliding window: Gemma stays)."""

from __future__ import annotations

import json

import openai
import pytest

from graftmem.server import RECEIPT_HEADER, api_server
from graftmem.store.chain import full_state
from graftmem.store.local import Store

from .conftest import long_text


def _ask(c: openai.OpenAI, messages, *, cache: bool = True) -> tuple[str, dict]:
    raw = c.chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=3, temperature=0, extra_body={"graftmem": {"cache": cache}})
    return raw.parse().choices[0].message.content, json.loads(raw.headers[RECEIPT_HEADER])


@pytest.mark.parametrize("model,words", [("tiny_llama", 60), ("gemma", 470)])
def test_turn_two_learns_from_the_kept_cells_and_a_restart_grafts_them_exactly(model, words, request, tmp_path):
    engine = request.getfixturevalue(model)
    system = {"role": "system", "content": "You are a shop's support agent. " + long_text(words, seed=23)}
    t1 = [system, {"role": "user", "content": "Hi"}]
    t2 = t1 + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Thanks"}]
    t3 = t2 + [{"role": "assistant", "content": "Welcome"}, {"role": "user", "content": "Bye"}]
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [engine], min_prefix_tokens=32, sightings=2) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            cold_text, cold = _ask(c, t3, cache=False)
            assert cold_text  # a text to compare after the restart
            _, r1 = _ask(c, t1)
            assert r1["tokens_restored"] == 0
            _, r2 = _ask(c, t2)  # the system prompt's second sighting: learned, from the kept cells
            assert r2["source"] == "ram" and r2["tokens_restored"] > 0, r2
            assert srv.pipeline.wait_idle()
            # learned: the system prompt and turn 1's user message with the header but its last token (the
            # prompt's last segment, never learned), both seen twice now
            autos = sorted(store.list(kind="auto"), key=lambda b: b.metadata["segment"])
            assert [b.metadata["segment"] for b in autos] == [0, 1], autos
            sys_block, turn_block = autos
            assert turn_block.parent == sys_block.id
            if model == "gemma":
                assert sys_block.n_tokens > engine.n_swa  # past the window: the capture-after-trim path
        with engine.session():  # a fresh prefill of the same segment, captured
            engine.prefill(list(sys_block.tokens))
            fresh = bytes(engine.capture())
        assert full_state(store, sys_block) == fresh
        with api_server(store, [engine], min_prefix_tokens=32, sightings=2, warm=False) as srv:  # a restart
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            text, r3 = _ask(c, t3)
            assert r3["source"] == "store" and r3["block_id"] == turn_block.id, r3
            assert r3["first_logits_sha256"] == cold["first_logits_sha256"]
            assert text == cold_text
    finally:
        store.close()


def test_the_same_prompt_again_prefills_nothing_and_decodes_the_cold_bytes(tiny_llama, tmp_path):
    """Cells left by a prompt keep that prompt's first logits (`Kept.first`): the same prompt again (a
    retry, a regenerate) prefills no token, where llama-server re-evaluates its last one, and its first
    logits and answer are the cold request's; a prompt that differs only in its last message prefills it."""
    system = {"role": "system", "content": "You are a shop's support agent. " + long_text(60, seed=29)}
    t1 = [system, {"role": "user", "content": "Where is my order?"}]
    other = [system, {"role": "user", "content": "Where is my refund?"}]
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [tiny_llama], min_prefix_tokens=32, sightings=2) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            cold_text, cold = _ask(c, t1, cache=False)
            _, r1 = _ask(c, t1)
            assert r1["tokens_prefilled"] > 0
            text, r2 = _ask(c, t1)
            assert r2["source"] == "ram" and r2["tokens_prefilled"] == 0, r2
            assert r2["first_logits_sha256"] == cold["first_logits_sha256"] and text == cold_text
            _, r3 = _ask(c, other)  # the kept cells hold its system prompt, not its last message
            assert r3["source"] == "ram" and 0 < r3["tokens_prefilled"] < r1["tokens_prefilled"], r3
    finally:
        store.close()
