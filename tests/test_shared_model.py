"""A pool's engines share one loaded model (issue #26 item 3): each engine is its own llama.cpp
context on the same weights, computes the same bytes as an engine that loaded the model alone, keeps
its cells to itself, and outlives its siblings. Threads are sized per engine without changing the
fingerprint (the thread count was measured not to change the bytes: checked here again)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from graftmem import ClosedError, ConfigError
from graftmem.core.engine import Engine, _LoadedModel, logits_sha256, threads_per_engine, usable_cores
from graftmem.server import pool_engines

from .conftest import long_text

CFG = {"n_ctx": 1024, "n_batch": 128, "n_ubatch": 64, "probe": False}
TEXT = long_text(115, seed=3)  # ~150 tokens: crosses two n_ubatch boundaries and one n_batch one


def _alone_sha() -> str:
    """The logits of TEXT from an engine that loaded the model by itself (a new process: nothing to
    share with), as SHA-256."""
    code = ("import sys, json; from graftmem.core.engine import Engine, logits_sha256\n"
            "cfg = json.loads(sys.argv[1])\n"
            "with Engine('smollm2', cfg) as e:\n"
            "    e.prefill(e.tokenize(sys.argv[2])); print(logits_sha256(e.logits()))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(CFG), TEXT], capture_output=True, text=True,
                         timeout=300, check=True, cwd=Path(__file__).resolve().parent.parent)
    return out.stdout.strip().splitlines()[-1]


def _sha(e: Engine, tokens: list[int]) -> str:
    with e.session():
        e.prefill(tokens)
        return logits_sha256(e.logits())


def test_siblings_share_the_weights_and_compute_the_bytes_of_a_lone_engine():
    alone = _alone_sha()
    a = Engine("smollm2", CFG)
    b = a.sibling()
    try:
        assert a.model_handle == b.model_handle != 0  # one copy of the weights
        assert a.model_users == b.model_users >= 2
        assert b.fingerprint == a.fingerprint and b.config == a.config
        tokens = a.tokenize(TEXT)
        assert _sha(a, tokens) == alone
        assert _sha(b, tokens) == alone
        # interleaved on the two contexts: neither sees the other's cells (split at n_batch: the same
        # micro-batches as one prefill, whose chunking decides the bytes)
        assert len(tokens) > CFG["n_batch"] and len(tokens) > 2 * CFG["n_ubatch"]
        with a.session(), b.session():
            a.prefill(tokens[:CFG["n_batch"]])
            b.prefill(a.tokenize(long_text(25, seed=9)))
            a.prefill(tokens[CFG["n_batch"]:])
            assert logits_sha256(a.logits()) == alone
        # fewer threads on one sibling: same bytes, same fingerprint identity
        b.set_threads(1)
        assert b.n_threads == 1 and b.fingerprint.n_threads == 1
        assert b.fingerprint.digest() == a.fingerprint.digest()
        assert _sha(b, tokens) == alone
        users = a.model_users
        a.close()
        assert b.model_users == users - 1
        assert _sha(b, tokens) == alone  # closing a sibling leaves the weights to the others
    finally:
        a.close()
        key = b._loaded.key
        left = b.model_users - 1
        b.close()
    assert (_LoadedModel._open[key].refs if key in _LoadedModel._open else 0) == left


def test_a_closed_engine_refuses_a_sibling_and_bad_threads_are_named():
    e = Engine("smollm2", CFG)
    with pytest.raises(ConfigError, match="n_threads must be >= 1"):
        e.set_threads(0)
    e.close()
    with pytest.raises(ClosedError, match="closed"):
        e.sibling()
    with pytest.raises(ConfigError, match="at least one engine"):
        threads_per_engine(0)


def test_pool_engines_size_threads_per_engine_and_keep_the_fingerprint():
    first = Engine("smollm2", CFG)
    digest = first.fingerprint.digest()
    engines = pool_engines(first, 3)
    try:
        assert len(engines) == 3 and engines[0] is first
        assert len({e.model_handle for e in engines}) == 1
        want = max(1, usable_cores() // 3)
        assert [e.n_threads for e in engines] == [want] * 3 == [threads_per_engine(3)] * 3
        assert {e.fingerprint.digest() for e in engines} == {digest}
    finally:
        for e in engines[1:]:
            e.close()
        first.close()
    # an explicit n_threads is the user's choice: kept
    first = Engine("smollm2", {**CFG, "n_threads": 1})
    engines = pool_engines(first, 2)
    try:
        assert [e.n_threads for e in engines] == [1, 1]
    finally:
        for e in engines:
            e.close()
    assert threads_per_engine(4, 2) == 1 and threads_per_engine(2, 16) == 8


def test_serve_with_two_engines_says_its_threads_and_answers(tmp_path):
    """`graftmem serve --engines 2` in its own process: its first line names the engines and the threads
    each got (sized to the cores: n_threads unset), and both contexts answer the same request alike."""
    import os
    import threading

    import openai

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "graftmem", "--home", str(tmp_path / "home"), "serve", "--port", "0",
         "--engines", "2", "--no-warm", "--no-learn"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "serving" in line, (proc.stderr.read()  # type: ignore[union-attr]
                                   if proc.poll() is not None else line)
        assert f"with 2 engine(s) x {threads_per_engine(2)} thread(s) on one loaded model" in line
        url = line.split(" at ")[1].split()[0]
        msgs = [{"role": "user", "content": "Name a fruit."}]
        got: list[str] = []

        def ask() -> None:
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
            got.append(c.chat.completions.create(model="m", messages=msgs, max_tokens=6, temperature=0)
                       .choices[0].message.content)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(got) == 2 and got[0] == got[1] and got[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_context_that_fails_to_open_gives_its_model_reference_back():
    """A quantized V cache without flash attention: llama.cpp refuses the context after the model was
    shared; the refusal is an EngineError and the loaded model's count of users is what it was."""
    from graftmem import EngineError

    with Engine("smollm2", CFG) as a:
        users = a.model_users
        with pytest.raises(EngineError, match="could not create a context"):
            Engine("smollm2", {**CFG, "type_v": "q8_0", "flash_attn": False})
        assert a.model_users == users
        assert _sha(a, a.tokenize("still usable")) == _sha(a, a.tokenize("still usable"))
