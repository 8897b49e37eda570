"""The server's HTTP foundation on a real uvicorn socket: API key, strict request bodies, deleted block
files, and error messages that never carry a local path. All plumbing: the blocks are learned on the tiny
random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`), ~1/100th of SmolLM2's prefill."""

from __future__ import annotations

import http.client
import logging
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from graftmem import Memory
from graftmem.server import BlockServer

from .conftest import long_text

KEY = "server-api-key-for-tests"
TOKEN = "push-token-for-tests"


@pytest.fixture(scope="module")
def home(tiny_llama, tmp_path_factory):
    """A store with two blocks (module-scoped: the tests below only read it, except the deletion test,
    which uses its own)."""
    h = tmp_path_factory.mktemp("http") / "store"
    with Memory(engine=tiny_llama, home=h) as m:
        a = m.learn(long_text(30, seed=21), name="a")
        b = m.learn(long_text(25, seed=22), name="b")
    return h, a.id, b.id


def _raw(url: str, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
    """One request sent exactly as written (no client-side fixing of the headers)."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(head.encode() + b"\r\n" + body)
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, r.read()


def test_binds_loopback_by_default_and_api_key_guards_every_route(home):
    h, a, _ = home
    with BlockServer(h, api_key=KEY) as srv:
        assert urlsplit(srv.url).hostname == "127.0.0.1"
        for path in ("/v1/info", "/v1/blocks", f"/v1/blocks/{a}", "/v1/models"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401, path
        assert httpx.get(srv.url + "/v1/blocks", headers={"Authorization": "Bearer wrong-key-xx"}).status_code == 401
        assert httpx.get(srv.url + "/v1/info", headers={"Authorization": f"Bearer {KEY}"}).json()["blocks"] == 2
        assert httpx.get(srv.url + f"/v1/blocks/{a}/manifest", headers={"X-Api-Key": KEY}).json()["id"] == a
        # an OpenAI path gets OpenAI's error shape, a block path graftmem's
        assert httpx.post(srv.url + "/v1/chat/completions", json={}).json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/info").json()["error"] == "AccessDenied"


@pytest.mark.parametrize("headers,status", [
    ({}, 411),                                              # no Content-Length (and not chunked)
    ({"Content-Length": "abc"}, 400),
    ({"Content-Length": "-5"}, 400),
    ({"Content-Length": "1e3"}, 400),
    ({"Transfer-Encoding": "chunked"}, 411),                # chunked bodies are not accepted
])
def test_push_body_needs_a_sane_content_length(tiny_llama, tmp_path, headers, status):
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub, hub.serve(push_token=TOKEN) as srv:
        body = b"0\r\n\r\n" if "Transfer-Encoding" in headers else b""
        got, raw = _raw(srv.url, "POST", "/v1/bundles", {"Authorization": f"Bearer {TOKEN}", **headers}, body)
        assert got == status, raw
        assert hub.get_all() == []


def test_body_over_the_limit_is_413_before_it_is_read(tiny_llama, tmp_path):
    """The server answers 413 from the announced length: the client has sent none of the body yet."""
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub:
        srv = BlockServer(hub.store, push_token=TOKEN, fingerprint=tiny_llama.fingerprint, max_push_bytes=1000)
        with srv:
            status, raw = _raw(srv.url, "POST", "/v1/bundles",
                               {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(10 ** 9)})
            assert status == 413 and b"over this server" in raw
        assert hub.get_all() == []


def test_a_garbage_push_is_refused_in_the_block_error_shape(tiny_llama, tmp_path):
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub, hub.serve(push_token=TOKEN) as srv:
        status, raw = _raw(srv.url, "POST", "/v1/bundles",
                           {"Authorization": f"Bearer {TOKEN}", "Content-Length": "10"}, b"y" * 10)
        assert status == 422 and b"BundleRejected" in raw
        assert hub.get_all() == []


def test_deleted_block_file_is_a_404_and_left_out_of_the_listing(tiny_llama, tmp_path, caplog):
    with Memory(engine=tiny_llama, home=tmp_path / "s") as m:
        keep = m.learn(long_text(20, seed=31), name="keep")
        gone = m.learn(long_text(20, seed=32), name="gone")
        with m.serve() as srv:
            m.store.path_of(gone.id).unlink()  # behind the index's back
            with caplog.at_level(logging.WARNING, logger="graftmem"):
                r = httpx.get(f"{srv.url}/v1/blocks/{gone.id}")
                assert r.status_code == 404 and r.json()["error"] == "BlockNotFound"
                listing = httpx.get(f"{srv.url}/v1/blocks")
            assert listing.status_code == 200
            assert [e["id"] for e in listing.json()["blocks"]] == [keep.id]
            assert any(gone.id[:12] in rec.getMessage() and "missing" in rec.getMessage()
                       for rec in caplog.records)
            for resp in (r, listing):
                assert str(m.store.home) not in resp.text


def test_errors_never_carry_a_local_path(home):
    h, _, _ = home
    with BlockServer(h) as srv:
        answers = [httpx.get(f"{srv.url}/v1/blocks/{'0' * 64}"), httpx.get(f"{srv.url}/v1/blocks/{'0' * 64}/manifest"),
                   httpx.get(f"{srv.url}/nope"), httpx.post(f"{srv.url}/v1/bundles", content=b"x")]
        for r in answers:
            assert r.status_code >= 400
            assert str(h) not in r.text and "/tmp" not in r.text, r.text


def test_close_is_graceful_and_idempotent(home):
    h, a, _ = home
    srv = BlockServer(h).start()
    url = srv.url
    assert httpx.get(f"{url}/v1/blocks/{a}").status_code == 200
    srv.close()
    srv.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/info", timeout=2)


def test_kept_alive_responses_do_not_wait_for_delayed_acks(home):
    """A response's headers and body go out at once: TCP_NODELAY is set on the listening socket, and
    Linux's accepted connections inherit it. Before, on a kept-alive connection every JSON response
    after the first waited ~40 ms for the client's delayed ACK (Nagle) for about 1 ms of work. The
    option is read back from the socket (a timing assert would measure the machine's load instead)."""
    import socket

    h, _, _ = home
    with BlockServer(h) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        sock = srv._server._sock  # the listening socket the server accepts on
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        for _ in range(2):  # kept alive: the second response comes on the same connection
            c.get("/v1/info").raise_for_status()
