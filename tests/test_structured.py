"""Structured outputs in the one decode loop: a llama.cpp grammar (from a JSON schema, with llama.cpp's
own converter) masks the tokens it forbids, so the answer parses; the log-probabilities stay the model's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graftmem import ConfigError
from graftmem.core import decode, json_grammar

PROMPT = "<|im_start|>user\nDescribe a customer as JSON with name and age.<|im_end|>\n<|im_start|>assistant\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _answer(eng, grammar_text):
    with eng.session():
        eng.prefill(eng.tokenize(PROMPT))
        raw = eng.logits().astype(np.float64)
        grammar = eng.grammar(grammar_text) if grammar_text else None
        try:
            d = decode(eng, 48, grammar=grammar)
        finally:
            if grammar is not None:
                grammar.close()
    d.raw_log_softmax = raw - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    return d, eng.detokenize(d.tokens)


def test_a_schema_grammar_makes_the_answer_parse(smol):
    free, free_text = _answer(smol, None)
    with pytest.raises(json.JSONDecodeError):  # the model on its own answers with prose and code
        json.loads(free_text)
    d, text = _answer(smol, json_grammar(SCHEMA))
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int), text
    assert d.finish_reason == "stop" and len(obj["name"]) <= 16
    # the first token's log-probability is the model's own, not the masked (renormalized) distribution's
    assert d.logprobs[0] == pytest.approx(d.raw_log_softmax[d.tokens[0]], abs=1e-9)
    assert d.tokens[0] != free.tokens[0] and d.logprobs[0] < free.logprobs[0]


def test_json_object_mode_gives_an_object(smol):
    _, text = _answer(smol, json_grammar())
    assert isinstance(json.loads(text), dict), text


def test_bad_grammars_and_schemas_are_config_errors(smol):
    with pytest.raises(ConfigError, match="could not parse the grammar"):
        smol.grammar("root ::= (")
    with pytest.raises(ConfigError, match="JSON schema"):
        json_grammar({"type": "object", "properties": {"x": {"$ref": "#/definitions/missing"}}})


def test_memory_ask_takes_response_format(mem):
    blk = mem.learn("Customers of the Northwind shop: Ana Silva, 34; Bo Chen, 51.", name="customers")
    q = "\nDescribe the first customer as JSON with name and age:\n"
    free = mem.ask(blk.id, q, max_tokens=24)
    r = mem.ask(blk.id, q, max_tokens=48, response_format={"type": "json_schema", "json_schema": {
        "name": "customer", "schema": SCHEMA}})
    obj = json.loads(r.text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int), r.text
    # the grammar picks tokens, the graft is what it was: the same first logits as the free answer
    assert r.receipt.first_logits_sha256 == free.receipt.first_logits_sha256
    with pytest.raises(ConfigError, match="response_format"):
        mem.ask(blk.id, q, response_format={"type": "yaml"})


def test_memory_recall_takes_response_format(smol, minilm, tmp_path):
    """``recall`` routes, grafts and answers under the same grammar as ``ask``; the routed graft is the
    one the free recall makes (same block, same first logits)."""
    from graftmem import Memory

    with Memory(engine=smol, home=tmp_path / "rstore", embedder=minilm) as m:
        m.learn("Customers of the Northwind shop: Ana Silva, 34; Bo Chen, 51.", name="customers",
                when_to_use="questions about the shop's customers")
        task = "\nDescribe the first customer of the Northwind shop as JSON with name and age:\n"
        free = m.recall(task, max_tokens=24, min_score=-1.0)
        fmt = {"type": "json_schema", "json_schema": {"name": "customer", "schema": SCHEMA}}
        r = m.recall(task, max_tokens=48, min_score=-1.0, response_format=fmt)
        obj = json.loads(r.text)
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int), r.text
        assert r.block is not None and r.block.id == free.block.id
        assert r.receipt.first_logits_sha256 == free.receipt.first_logits_sha256
        with pytest.raises(json.JSONDecodeError):
            json.loads(free.text)
        with m.recall_stream(task, max_tokens=48, min_score=-1.0, response_format=fmt) as streamed:
            assert json.loads("".join(streamed)) == obj
        with pytest.raises(ConfigError, match="response_format"):
            m.recall(task, response_format={"type": "json_schema", "json_schema": {"schema": []}})


def test_server_response_format_through_the_openai_client(smol, tmp_path):
    import openai

    from graftmem.server import api_server
    from graftmem.store.local import Store

    store = Store(tmp_path / "home")
    with api_server(store, [smol], warm=False) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Describe a customer as JSON with name and age."}]
        r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=48, temperature=0,
                                      response_format={"type": "json_schema", "json_schema": {
                                          "name": "customer", "schema": SCHEMA, "strict": True}})
        obj = json.loads(r.choices[0].message.content)
        assert set(obj) == {"name", "age"} and r.choices[0].finish_reason == "stop", r.choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=48, temperature=0, stream=True,
            response_format={"type": "json_object"}) if ch.choices)
        assert isinstance(json.loads(streamed), dict), streamed
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8,
                                      response_format={"type": "json_schema", "json_schema": {"schema": []}})
        assert exc.value.status_code == 400 and "response_format" in str(exc.value)
    store.close()
