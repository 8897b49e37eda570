"""``GET /health`` (public) and ``GET /metrics`` (Prometheus text, behind the key) on a real server."""

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


def test_health_is_public_and_metrics_count_requests_and_tokens(smol, tmp_path):
    with api_server(Store(tmp_path / "home"), [smol], api_key=KEY) as srv:
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
        # a path no route serves is labelled "other": random paths do not grow the label set
        assert httpx.get(srv.url + "/no/such/path/123", headers={"x-api-key": KEY}).status_code == 404
        s = _samples(httpx.get(srv.url + "/metrics", headers={"x-api-key": KEY}).text)
        assert s['graftmem_requests_total{route="other",status="404"}'] == 1
        assert s['graftmem_requests_total{route="/metrics",status="200"}'] == 1
