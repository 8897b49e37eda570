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
        assert [e.n_threads_batch for e in engines] == [want] * 3 == [threads_per_engine(3)] * 3
        # one-token calls keep the lone engine's count: their bytes depend on it
        assert [e.n_threads for e in engines] == [usable_cores()] * 3
        assert {e.fingerprint.digest() for e in engines} == {digest}
    finally:
        for e in engines[1:]:
            e.close()
        first.close()
    # an explicit n_threads is the user's choice: kept
    first = Engine("smollm2", {**CFG, "n_threads": 1})
    engines = pool_engines(first, 2)
    try:
        assert [(e.n_threads, e.n_threads_batch) for e in engines] == [(1, 1), (1, 1)]
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
        assert (f"with 2 engine(s) x {threads_per_engine(2)} prefill thread(s) ({usable_cores()} for one-token calls) "
                "on one loaded model") in line
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


def test_everything_an_engine_computes_runs_on_that_engine_s_one_thread(tiny_llama, tmp_path, monkeypatch):
    """llama.cpp's CPU backend keeps its OpenMP thread team per calling thread, and a decode on a thread
    that never decoded builds it (measured: 53 ms instead of 29 for one token over 2,560 SmolLM2 cells),
    so the server runs each engine's work on one thread of its own: every request's prefill and decode
    (Chat Completions, streamed or not, and a REST verb), on the same thread, never the caller's."""
    import threading

    import httpx
    import openai

    from graftmem import Memory
    from graftmem.server.pool import EnginePool

    seen: list[threading.Thread] = []  # thread objects, not idents: an ended thread's ident is reused
    prefill = tiny_llama.prefill

    def recorded(*args, **kwargs):
        seen.append(threading.current_thread())
        return prefill(*args, **kwargs)

    monkeypatch.setattr(tiny_llama, "prefill", recorded)
    with Memory(engine=tiny_llama, home=tmp_path / "home") as mem:
        block = mem.learn(long_text(40, seed=5), name="manual")
        seen.clear()  # learn() ran on this thread, as a library call does
        with mem.serve(api=True) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            for i in range(3):
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"Question {i}?"}],
                                          max_tokens=3, temperature=0, stream=i == 1)
            r = httpx.post(srv.url + "/v1/memory/ask", json={"id": block.id, "question": " Next:", "max_tokens": 2},
                           timeout=120)
            assert r.status_code == 200, r.text
    assert len(seen) >= 4
    assert all(t is seen[0] for t in seen), {t.name for t in seen}
    assert seen[0] is not threading.current_thread() and seen[0].name == "graftmem-engine-0", seen[0]
    # the pool's contract: one thread per engine, the same for each of its calls, another for another engine
    pool = EnginePool([tiny_llama, tiny_llama.sibling()])
    try:
        a = [pool.run(e, threading.current_thread).result(timeout=30) for e in pool.engines for _ in range(2)]
        assert a[0] is a[1] and a[2] is a[3] and a[0] is not a[2] and threading.current_thread() not in a
    finally:
        pool.close()
        pool.engines[1].close()
