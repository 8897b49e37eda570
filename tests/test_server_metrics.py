"""``GET /health`` (public) and ``GET /metrics`` (Prometheus text, behind the key) on a real server.

What is counted (requests, tokens, seconds by source, written / grafted / refused blocks) is server
plumbing and holds on any model: the server runs the tiny random-weight Llama 3.1 of tests/tiny.py
(`tiny_llama`, a real llama.cpp engine with the real tokenizer and template), whose prefills cost ~1/100th
of SmolLM2's."""

from __future__ import annotations

import re

import httpx
import openai

from graftmem.server import api_server
from graftmem.store.local import Store

KEY = "sk-metrics-test-key"


def _samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value for every sample line of a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_health_is_public_and_metrics_count_requests_and_tokens(tiny_llama, tmp_path):
    with api_server(Store(tmp_path / "home"), [tiny_llama], api_key=KEY) as srv:
        # the probe carries no key and still gets its answer
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        # /metrics is behind the key
        assert httpx.get(srv.url + "/metrics").status_code == 401
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        for _ in range(2):  # the second request keeps the first one's cells: cached tokens from RAM
            out = c.chat.completions.create(model="m", max_tokens=3, temperature=0, messages=[
                {"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hi"}])
        assert out.usage.prompt_tokens_details.cached_tokens > 0
        assert srv.pipeline.wait_idle()  # a request's counters are added when its work ends, after the answer
        r = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.text
        names = {m for m in re.findall(r"^# TYPE (\S+)", text, re.M)}
        assert not any(":" in n for n in names), names
        s = _samples(text)
        assert s['graftmem_requests_total{route="/v1/chat/completions",status="200"}'] == 2
        assert s['graftmem_requests_total{route="/health",status="200"}'] == 1
        assert s['graftmem_requests_total{route="/metrics",status="401"}'] == 1
        # generated: 3 per request at most, at least 1; prompt: twice the prompt's tokens
        assert s["graftmem_prompt_tokens_total"] == 2 * out.usage.prompt_tokens
        assert s["graftmem_generated_tokens_total"] >= 2
        assert s['graftmem_cached_tokens_total{source="ram"}'] == out.usage.prompt_tokens_details.cached_tokens
        assert s["graftmem_queue_depth"] == 0
        assert s["graftmem_rate_limited_total"] == 0
        assert s["graftmem_auto_block_bytes"] >= 0
        # where the time went: the first request prefilled cold, the second restored from RAM
        assert s['graftmem_prefill_seconds_total{source="none"}'] > 0
        assert s['graftmem_prefill_seconds_total{source="ram"}'] > 0
        assert s['graftmem_restore_seconds_total{source="ram"}'] > 0
        assert s['graftmem_restore_seconds_total{source="store"}'] == 0
        assert s['graftmem_cached_tokens_total{source="bucket"}'] == 0
        assert s["graftmem_decode_seconds_total"] > 0
        assert s["graftmem_created_tokens_total"] == 0  # a short prompt, seen twice: nothing stored
        assert s["graftmem_verify_failures_total"] == 0
        # a path no route serves is labelled "other": random paths do not grow the label set
        assert httpx.get(srv.url + "/no/such/path/123", headers={"x-api-key": KEY}).status_code == 404
        s = _samples(httpx.get(srv.url + "/metrics", headers={"x-api-key": KEY}).text)
        assert s['graftmem_requests_total{route="other",status="404"}'] == 1
        assert s['graftmem_requests_total{route="/metrics",status="200"}'] == 1


def test_health_says_loading_until_the_engines_are_loaded(tiny_llama, tmp_path):
    """The socket is bound before the engines load (what ``graftmem serve`` does): a probe reads 503
    ``loading`` and an API call a 503 in its API's shape, until the server built on it starts; then 200."""
    import threading

    import anthropic

    from graftmem.core.engine import Engine
    from graftmem.server import bind

    runner = bind()
    runner.start()
    go = threading.Event()
    made: dict = {}

    def load() -> None:  # what serve's loader thread does, held until the test lets it go
        go.wait()
        made["engine"] = engine = Engine(tiny_llama.model_path, tiny_llama.config)
        made["srv"] = api_server(Store(tmp_path / "home"), [engine], api_key=KEY, runner=runner).start()

    loader = threading.Thread(target=load)
    loader.start()
    try:
        r = httpx.get(runner.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        assert r.headers["retry-after"] == "1"
        c = openai.OpenAI(base_url=runner.url + "/v1", api_key=KEY, max_retries=0)
        try:
            c.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.body["code"] == "loading"
        else:
            raise AssertionError("a request was served while loading")
        a = anthropic.Anthropic(base_url=runner.url, api_key=KEY, max_retries=0)
        try:
            a.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        except anthropic.APIStatusError as exc:
            assert exc.status_code == 503 and exc.body["error"]["type"] == "overloaded_error"
        else:
            raise AssertionError("a request was served while loading")
        go.set()
        loader.join()
        r = httpx.get(runner.url + "/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        out = c.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert out.choices[0].message is not None
    finally:
        go.set()
        loader.join()
        if "srv" in made:
            made["srv"].close()
        else:
            runner.close()
        if "engine" in made:
            made["engine"].close()


def test_metrics_count_written_blocks_store_grafts_and_refused_blocks(tiny_llama, tmp_path):
    """A breakpoint's block written (created tokens), grafted from the store (restore seconds by source),
    then damaged on disk: the graft's check refuses it (a verify failure) and the request is served cold."""
    import anthropic

    from .conftest import flip_bit, long_text

    system = [{"type": "text", "text": "You file tickets. " + long_text(260, seed=21), "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "Open a ticket."}]
    with api_server(Store(tmp_path / "home"), [tiny_llama], api_key=KEY) as srv:
        c = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)
        first = c.messages.create(model="m", max_tokens=2, system=system, messages=ask, extra_body={"temperature": 0})
        created = first.usage.cache_creation_input_tokens
        assert created > 0
        # the answer is sent before its request hands what it learned to the writer: wait for both
        # (cache.flush alone could return before the hand-over: a race this test lost once in CI)
        assert srv.pipeline.wait_idle()
        # served cold (and nothing kept in RAM), then from the stored block
        c.messages.create(model="m", max_tokens=2, system=system, messages=ask,
                          extra_body={"temperature": 0, "graftmem": {"cache": False}})
        read = c.messages.create(model="m", max_tokens=2, system=system, messages=ask, extra_body={"temperature": 0})
        assert read.model_extra["graftmem"]["source"] == "store"
        assert srv.pipeline.wait_idle()  # a request's counters are added when its work ends, after the answer
        s = _samples(httpx.get(srv.url + "/metrics", headers={"x-api-key": KEY}).text)
        # the second request learns its user turn (seen twice now) on top of the stored system prompt
        assert s["graftmem_created_tokens_total"] == created + (read.usage.cache_creation_input_tokens or 0)
        assert s['graftmem_cached_tokens_total{source="store"}'] == read.usage.cache_read_input_tokens
        assert s['graftmem_restore_seconds_total{source="store"}'] > 0
        assert s["graftmem_verify_failures_total"] == 0
        # the block's state damaged on disk: its next graft is refused, the answer served cold
        assert srv.pipeline.wait_idle()  # the user turn the read learned: the chain the next request grafts ends there
        blocks = srv.store.list()
        block = next(b for b in blocks if b.id not in {x.parent for x in blocks})  # the chain's leaf
        path = srv.store.path_of(block.id)
        flip_bit(path, path.stat().st_size - 64 - 1000)
        c.messages.create(model="m", max_tokens=2, system=system, messages=ask,
                          extra_body={"temperature": 0, "graftmem": {"cache": False}})
        cold = c.messages.create(model="m", max_tokens=2, system=system, messages=ask, extra_body={"temperature": 0})
        assert cold.usage.cache_read_input_tokens == 0
        assert srv.pipeline.wait_idle()
        s = _samples(httpx.get(srv.url + "/metrics", headers={"x-api-key": KEY}).text)
        assert s["graftmem_verify_failures_total"] == 1


def test_with_tenants_each_key_reads_its_own_counters_and_the_operator_key_the_server_s(tiny_llama, tmp_path):
    """Issue 37: /metrics was global, so tenant B read tenant A's cached tokens (a hit on a block B shared
    told B what A's prompt held). With a key file each key reads its own counters; the operator's metrics
    key (``serve --metrics-key``) reads the whole server's, on /metrics and /v1/info only."""
    import pytest

    from graftmem import ConfigError
    from graftmem.server import ApiKeys, hash_key

    keys = {"alice": "alice-key-0123456789", "bob": "bob-key-9876543210"}
    op = "operator-metrics-key-1"
    p = tmp_path / "keys.txt"
    p.write_text("".join(f"{n} {hash_key(k)}\n" for n, k in keys.items()))
    tenants = ApiKeys.load(p)
    with pytest.raises(ConfigError, match="also tenant 'bob'"):
        api_server(Store(tmp_path / "h2"), [tiny_llama], api_key=tenants, metrics_key=keys["bob"])
    with pytest.raises(ConfigError, match="needs API keys"):
        api_server(Store(tmp_path / "h3"), [tiny_llama], metrics_key=op)
    with api_server(Store(tmp_path / "home"), [tiny_llama], api_key=tenants, metrics_key=op) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=keys["alice"], max_retries=0)
        for _ in range(2):
            out = c.chat.completions.create(model="m", max_tokens=2, temperature=0, messages=[
                {"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hi"}])
        assert out.usage.prompt_tokens_details.cached_tokens > 0
        assert srv.pipeline.wait_idle()
        assert httpx.get(srv.url + "/metrics", headers={"x-api-key": "not-a-key-at-all"}).status_code == 401

        def read(key: str) -> dict[str, float]:
            r = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return _samples(r.text)
        a, b, o = read(keys["alice"]), read(keys["bob"]), read(op)
        assert a["graftmem_prompt_tokens_total"] == 2 * out.usage.prompt_tokens == o["graftmem_prompt_tokens_total"]
        assert a['graftmem_cached_tokens_total{source="ram"}'] == out.usage.prompt_tokens_details.cached_tokens
        assert a['graftmem_requests_total{route="/v1/chat/completions",status="200"}'] == 2
        assert b["graftmem_prompt_tokens_total"] == 0 and b['graftmem_cached_tokens_total{source="ram"}'] == 0
        assert not any("chat/completions" in k or "status=\"401\"" in k for k in b)
        assert "graftmem_verify_failures_total" not in b and "graftmem_engines" in b  # server-wide: the operator's
        assert o['graftmem_requests_total{route="/metrics",status="401"}'] == 1
        assert o['graftmem_requests_total{route="/v1/chat/completions",status="200"}'] == 2
        assert o["graftmem_verify_failures_total"] == 0
        # the operator's key opens /metrics and /v1/info, nothing else
        ho = {"Authorization": f"Bearer {op}"}
        assert httpx.get(srv.url + "/v1/info", headers=ho).json()["blocks"] == srv.store.stats().blocks
        for path in ("/v1/models", "/v1/blocks", "/v1/memory/blocks"):
            assert httpx.get(srv.url + path, headers=ho).status_code == 401, path
