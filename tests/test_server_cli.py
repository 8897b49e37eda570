"""The CLI as a light client of a running server: ``ls``, ``ask`` and ``search`` with ``--url`` answer
through the real HTTP API, and the client process loads no model, no server and no embedder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from graftmem.server import api_server
from graftmem.store.local import Store

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "llama_cpp", "starlette", "uvicorn", "sentence_transformers", "faiss", "pydantic", "httpx",
         "numpy", "email", "dataclasses")  # email: the stdlib's http.client (~20 ms of imports)
PROBE = ("import json, sys\nfrom graftmem.cli import main\nrc = main(sys.argv[1:])\n"
         "print('MODULES=' + json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(%r))))\n"
         "sys.exit(rc)\n") % (HEAVY,)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GRAFTMEM_URL", None)
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=env)


def test_cli_verbs_through_the_server_load_nothing_heavy(smol, tmp_path):
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [smol]) as srv:
            r = httpx.post(srv.url + "/v1/memory/learn", timeout=120, json={
                "text": "Refunds take 14 days and need the receipt.", "chat": True, "name": "refunds"})
            bid = r.json()["block"]["id"]
            ls = _cli("ls", "--url", srv.url, "--json")
            assert ls.returncode == 0, ls.stderr
            out, mods = ls.stdout.rsplit("MODULES=", 1)
            assert [b["id"] for b in json.loads(out)] == [bid]
            assert json.loads(mods) == [], mods  # no model, no server, no embedder, no pydantic, no httpx
            ask = _cli("ask", bid[:10], "How long do refunds take?", "--max-tokens", "8", "--url", srv.url, "--json")
            assert ask.returncode == 0, ask.stderr
            out, mods = ask.stdout.rsplit("MODULES=", 1)
            answer = json.loads(out)
            assert answer["receipt"]["tokens_restored"] > 0 and answer["block"]["id"] == bid
            assert json.loads(mods) == []
            # the same question asked in-process gives the same answer (the server runs Memory's path)
            from graftmem.memory.answer import ask as ask_block
            from graftmem.memory.recall import continuation_for
            block = store.get(bid)
            local = ask_block(smol, store, block, continuation_for(block, "How long do refunds take?"), max_tokens=8)
            assert answer["text"] == local.text
            # --stop goes through the server; flags it cannot honour are refused, not ignored
            word = " " + local.text.split()[1]
            stopped = _cli("ask", bid[:10], "How long do refunds take?", "--max-tokens", "8", "--url", srv.url,
                           "--json", "--stop", word)
            assert stopped.returncode == 0, stopped.stderr
            cut = json.loads(stopped.stdout.rsplit("MODULES=", 1)[0])
            assert cut["text"] == local.text[:local.text.find(word)] and cut["finish_reason"] == "stop"
            refused = _cli("ask", bid[:10], "How long?", "--url", srv.url, "--stream")
            assert refused.returncode == 2 and "--stream" in refused.stderr
            # search needs the router; this server has none: a clear one-line error, still a light process
            s = _cli("search", "refund", "--url", srv.url)
            assert s.returncode == 2 and "without a router" in s.stderr
            assert json.loads(s.stdout.rsplit("MODULES=", 1)[1]) == []
    finally:
        store.close()


def test_every_lazy_public_name_resolves():
    """The lazy maps of graftmem and graftmem.core cover __all__ exactly (a name added to one and not
    the other fails here, not in a user's import)."""
    import graftmem
    import graftmem.core

    for mod in (graftmem, graftmem.core):
        for name in mod.__all__:
            assert getattr(mod, name) is not None, (mod.__name__, name)
        lazy = set(getattr(mod, "_LAZY"))
        assert lazy <= set(mod.__all__), lazy - set(mod.__all__)


def _one_shot(reply: bytes) -> str:
    """A real socket on 127.0.0.1 that reads one request and answers ``reply`` (raw bytes), then closes."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}"


def test_the_light_http_client_reads_what_servers_send():
    from graftmem.api import RemoteJSON
    from graftmem.core.errors import TransferError

    def call(url: str, path: str, body=None):
        return RemoteJSON(url).call("GET" if body is None else "POST", path, body)

    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
               b"7\r\n{\"a\": [\r\n5\r\n1, 2]\r\n1\r\n}\r\n0\r\n\r\n")
    assert call(_one_shot(chunked), "search", {"query": "q"}) == {"a": [1, 2]}
    sized = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{\"b\": 1}"
    assert call(_one_shot(sized), "list") == {"b": 1}
    error = b'HTTP/1.1 404 Not Found\r\nContent-Length: 39\r\n\r\n{"error": {"message": "no such block"}}'
    with pytest.raises(TransferError, match="answered 404: no such block"):
        call(_one_shot(error), "get/x")
    short = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"c\":"
    with pytest.raises(TransferError, match="ended after 5 of 100 bytes"):
        call(_one_shot(short), "list")
    with pytest.raises(TransferError, match="before the response's headers ended"):
        call(_one_shot(b"HTTP/1.1 200 OK\r\nContent-Le"), "list")
    with pytest.raises(TransferError, match="not an HTTP response"):
        call(_one_shot(b"SSH-2.0-OpenSSH_9.2\r\n"), "list")
    # hostile or broken framing: a graftmem error naming the fault, never a bare ValueError or a short body
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    with pytest.raises(TransferError, match="malformed chunked body"):
        call(_one_shot(head + b"zz\r\n{}\r\n0\r\n\r\n"), "list")
    with pytest.raises(TransferError, match="ended inside a chunk of 16 bytes"):
        call(_one_shot(head + b"10\r\n{\"a\": 1}"), "list")
    with pytest.raises(TransferError, match="malformed chunked body"):
        call(_one_shot(head + b"2\r\n{}\r\n"), "list")  # no last chunk: cut short
    with pytest.raises(TransferError, match="malformed Content-Length"):
        call(_one_shot(b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n{}"), "list")
    with pytest.raises(TransferError, match="not JSON"):
        call(_one_shot(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n<html>"), "list")
