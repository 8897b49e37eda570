"""Stored responses on the fleet store: turn 1 on server A, turn 2 (``previous_response_id``) on server B,
a second process on the same SeaweedFS bucket with its own empty cache, served from the bucket's chain:
the same first-step logits and greedy answer as A continuing in RAM. A load balancer needs no stickiness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai

from graftmem.server import api_server
from graftmem.store.fleet import FleetStore
from tests.seaweed import BUCKET, bucket_url, seaweed  # noqa: F401 (fixtures)
from tests.tiny import tiny_path

REPO = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0, "max_output_tokens": 12}


def test_a_conversation_started_on_one_server_continues_on_another(tiny_llama, bucket_url, tmp_path, seaweed):
    store = FleetStore(bucket_url, cache_dir=tmp_path / "cache-a", poll_interval=0)
    with api_server(store, [tiny_llama]) as a:
        c = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0)
        r1 = c.responses.create(model="tiny", instructions="You are terse.", input="Name a primary colour.",
                                **GREEDY)
        follow = {"model": "tiny", "instructions": "You are terse.", "input": "Name another one.",
                  "previous_response_id": r1.id, **GREEDY}
        in_ram = c.responses.create(**follow)
        ra = in_ram.model_extra["graftmem"]
        assert ra["source"] == "ram" and ra["response"]["continued"] is True
        proc = subprocess.Popen(
            # B serves the same model with the same engine configuration as A (the tiny_llama fixture)
            [sys.executable, "-m", "graftmem", "--store", bucket_url, "--model", str(tiny_path("llama31")),
             "--config", json.dumps({"n_threads": 1}), "serve",
             "--port", "0", "--no-warm"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **seaweed.env(), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                 "XDG_CACHE_HOME": str(tmp_path / "cache-b")})
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert "serving" in line, (proc.stderr.read() if proc.poll() is not None else line)  # type: ignore[union-attr]
            url = line.split(" at ")[1].split()[0]
            b = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            on_b = b.responses.create(**follow)
            rb = on_b.model_extra["graftmem"]
            assert rb["source"] == "store" and rb["block_id"] == ra["response"]["chain"]  # the bucket's chain
            assert on_b.usage.input_tokens_details.cached_tokens == ra["tokens_restored"] > 0
            assert rb["first_logits_sha256"] == ra["first_logits_sha256"]
            assert on_b.output_text == in_ram.output_text
            assert c.responses.retrieve(on_b.id).output_text == on_b.output_text  # stored by B, read by A
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    assert BUCKET in bucket_url
