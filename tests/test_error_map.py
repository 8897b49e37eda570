"""One error map for every door (`graftmem.server.http.status_of` / `as_http`): a graftmem error keeps its
class on the wire, with its own status, in each protocol's error shape, and the client turns it back into
the same class. Before the map, the memory routes turned a read-only store into a bare 500 and the chat
doors turned every graftmem error into a 500 whatever its kind."""

from __future__ import annotations

import json
import subprocess

import pytest

from graftmem import Memory, RemoteMemory
from graftmem.core import errors
from graftmem.core.errors import GraftmemError, StoreReadOnly, from_response
from graftmem.server.http import HTTPError, as_http, error_response, status_of

from .test_trust_store import tmpfs

#: what the caller does next decides the status: the caller's mistakes are 4xx, the server's state 5xx
EXPECTED = {
    "ConfigError": 400, "UnsupportedFeature": 400, "IncompatibleBlock": 400, "UnverifiedBlock": 400,
    "BlockNotFound": 404, "AccessDenied": 403, "BundleRejected": 422, "UntrustedBundle": 422,
    "StoreLocked": 503, "StoreReadOnly": 503, "ClosedError": 503, "StoreFull": 507,
    "TransferError": 502, "BlockCorrupted": 500, "BlockRejected": 500, "EngineError": 500, "ModelNotFound": 500,
    "StoreError": 500, "GraftmemError": 500,
}

PATHS = {"block": "/v1/blocks/abc", "openai": "/v1/chat/completions", "anthropic": "/v1/messages",
         "memory": "/v1/memory/learn", "responses": "/v1/responses"}


def _classes() -> list[type[GraftmemError]]:
    return [c for c in (getattr(errors, n) for n in errors.__all__)
            if isinstance(c, type) and issubclass(c, GraftmemError)]


def test_every_error_class_has_a_status_and_travels_by_name():
    assert {c.__name__ for c in _classes()} == set(EXPECTED), "a new error class needs its row in the map"
    for cls in _classes():
        exc = cls(f"the {cls.__name__} at /srv/home/blocks/x")
        err = as_http(exc, "/srv/home")
        assert (cls.__name__, err.status) == (cls.__name__, EXPECTED[cls.__name__])
        assert err.code == err.name == cls.__name__ and "/srv/home" not in err.message
        for door, path in PATHS.items():
            resp = error_response(path, as_http(cls("boom"), None))
            assert resp.status_code == EXPECTED[cls.__name__], (door, cls)
            body = json.loads(bytes(resp.body))
            if door == "anthropic":  # Anthropic's shape has no code: the type says 4xx or 5xx
                kind = body["error"]["type"]
                assert (kind in ("api_error", "overloaded_error")) == (resp.status_code >= 500), (cls, kind)
                continue
            back = from_response(resp.status_code, bytes(resp.body), "x")
            want = errors.AccessDenied if resp.status_code in (401, 403) else cls
            assert type(back) is want, (door, cls, type(back))


def test_a_foreign_failure_is_a_500_that_names_only_its_class():
    err = as_http(KeyError("/srv/home/secret"), "/srv/home")
    assert err.status == 500 and err.code == "internal_error" and "secret" not in err.message
    mine = HTTPError(429, "queue full at /srv/home")
    assert as_http(mine, "/srv/home") is mine and "<home>" in mine.message
    assert status_of(errors.BlockNotFound("x")) == 404


def test_a_read_only_store_is_503_store_read_only_at_the_rest_door(tiny_llama, tmp_path):
    """Learning on a server whose home went read-only: a 503 the client reads as `StoreReadOnly` (it was a
    500 ``StoreReadOnly`` with no status of its own), and the blocks it has are still served."""
    mnt = tmp_path / "ro"
    with tmpfs(mnt, "64m"):
        home = mnt / "home"
        with Memory(engine=tiny_llama, home=home) as mem:
            block = mem.learn("A rule to keep: refunds within 30 days of purchase, with the receipt. " * 3)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with Memory(engine=tiny_llama, home=home) as mem:
            srv = mem.serve(api=True, warm=False).start()
            try:
                with RemoteMemory(srv.url) as remote:
                    assert remote.get(block.id).id == block.id
                    with pytest.raises(StoreReadOnly, match="503.*read-only"):
                        remote.learn("another rule to learn, which this store cannot keep")
            finally:
                srv.close()
