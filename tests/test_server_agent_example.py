"""examples/openai_agent/agent.py against a real server: a cold run, then a run after a server restart
on the same home. Mechanics only (SmolLM2-135M is small): the tool call round trip works, the second run
is served from grafted blocks (cached_tokens > 0 from its first step) and gives the same answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from graftmem.server import api_server
from graftmem.store.local import Store

AGENT = Path(__file__).resolve().parents[1] / "examples" / "openai_agent" / "agent.py"


def _run(url: str) -> dict:
    p = subprocess.run([sys.executable, str(AGENT), "--base-url", url + "/v1", "--max-tokens", "32", "--json"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OPENAI_API_KEY": "unused"})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_openai_agent_example_cold_then_warm_after_restart(smol, tmp_path):
    home = tmp_path / "home"
    runs = []
    for _ in range(2):  # the second server is a restart: a new process state over the same store
        store = Store(home)
        try:
            with api_server(store, [smol]) as srv:
                runs.append(_run(srv.url))
        finally:
            store.close()
    cold, warm = runs
    first = cold["steps"][0]
    assert first["finish_reason"] == "tool_calls" and first["tool_calls"][0]["name"] == "lookup"
    assert "topic" in json.loads(first["tool_calls"][0]["arguments"])
    assert len(cold["steps"]) >= 2 and first["tool_results"]  # the result went back and was answered
    assert first["cached_tokens"] == 0
    assert warm["steps"][0]["cached_tokens"] > 256  # system prompt, tool, worked examples: grafted
    strip = lambda r: [(s["text"], [(c["name"], c["arguments"]) for c in s["tool_calls"]]) for s in r["steps"]]  # noqa: E731
    assert strip(warm) == strip(cold)  # grafted or prefilled, the same greedy answers
