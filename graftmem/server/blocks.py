"""Sharing a store over HTTP: a small read-only server, and the pull / push client (httpx).

Server (:class:`BlockServer`, stdlib ``ThreadingHTTPServer``, bound to 127.0.0.1 unless told
otherwise)::

    GET  /v1/info                     version, block count, whether pushes are accepted
    GET  /v1/blocks[?kind=K]          listing: a BundleManifest (ids, sizes, digests, fingerprints),
                                      signed in the X-Graftmem-Signature header when a key is given
    GET  /v1/blocks/<id>/manifest     one block's manifest (text, tokens, fingerprint)
    GET  /v1/blocks/<id>              the block file; Range (one range) and If-Range are honoured,
                                      the ETag is the block file's trailer digest
    POST /v1/push                     auth check only (Authorization: Bearer <token>): 204 or 401/403
    POST /v1/bundles                  a pushed bundle (needs the token); imported all or nothing

The server never trusts what it serves to be checked by itself: clients verify every byte as it
arrives (:class:`~graftmem.share.bundle.BlockChecker`) against the digests the listing announced, and
only move blocks into their store once every selected block has arrived and checked. An interrupted
download leaves its bytes in ``<home>/.incoming`` and the next pull resumes it with a Range request
(the bytes already there are re-hashed first, so a resumed file is checked end to end).

Pushes are off unless a token is set, the token is compared in constant time, and a pushed bundle
goes through the same import as a file: digests, strict member checks, the server's engine
fingerprint (required to enable pushes) and its trust policy.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO, Optional
from urllib.parse import parse_qs, urlsplit

from ..core import errors as _errors
from ..core.blocks import Fingerprint
from ..core.errors import AccessDenied, BlockNotFound, ConfigError, GraftmemError
from ..core.version import __version__
from ..share.admission import DEFAULT_MAX_ENTRY_BYTES, BlockCheck
from ..share.bundle import import_stream
from ..share.client import LISTING_DOMAIN, SIGNATURE_HEADER
from ..share.manifest import listing
from ..share.trust import SigningKey, TrustPolicy
from ..store.local import Store

__all__ = ["BlockServer"]

log = logging.getLogger("graftmem")

_ID_PATH = re.compile(r"/v1/blocks/([0-9a-f]{64})(/manifest)?")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


# ============================================================================================ server
class _Handler(BaseHTTPRequestHandler):
    """One request. ``send_file`` is the only place block bytes leave the server."""

    protocol_version = "HTTP/1.1"
    server_version = "graftmem"
    server: "_HTTPServer"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        log.debug("serve %s: " + format, self.client_address[0], *args)

    # ------------------------------------------------------------------ helpers
    def _send(self, status: int, body: bytes, ctype: str = "application/json",
              headers: Optional[dict[str, str]] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, exc: GraftmemError | str, *, close: bool = False) -> None:
        name = type(exc).__name__ if isinstance(exc, GraftmemError) else "TransferError"
        if close:
            self.close_connection = True
        self._send(status, json.dumps({"error": name, "message": str(exc)}).encode(),
                   headers={"Connection": "close"} if close else None)

    def send_file(self, f: BinaryIO, offset: int, count: int) -> None:
        """Send ``count`` bytes of ``f`` from ``offset`` (zero-copy with sendfile where possible)."""
        self.connection.sendfile(f, offset, count)

    # ------------------------------------------------------------------ GET / HEAD
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        app = self.server.app
        url = urlsplit(self.path)
        try:
            if url.path == "/v1/info":
                st = app.store.stats()
                info = {"graftmem": __version__, "api": 1, "blocks": st.blocks, "bytes": st.bytes_on_disk,
                        "push": app.push_token is not None,
                        "signed": app.sign_key is not None}
                return self._send(200, json.dumps(info).encode())
            if url.path == "/v1/blocks":
                kind = parse_qs(url.query).get("kind", [None])[0]
                body = listing(app.store, app.store.list(kind=kind)).model_dump_json().encode()
                headers = {}
                if app.sign_key is not None:
                    headers[SIGNATURE_HEADER] = app.sign_key.sign(LISTING_DOMAIN, body).to_header()
                return self._send(200, body, headers=headers)
            m = _ID_PATH.fullmatch(url.path)
            if m is None:
                return self._error(404, f"no such endpoint {url.path!r}")
            bid = m.group(1)
            if not app.store.contains(bid):
                return self._error(404, BlockNotFound(f"no block {bid[:12]} on this server"))
            if m.group(2):
                return self._send(200, app.store.get(bid).model_dump_json().encode())
            return self._get_block(bid)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except GraftmemError as exc:
            return self._error(500, exc)
        except FileNotFoundError:  # deleted between the index lookup and the open
            gone = url.path.rsplit("/", 1)[-1][:12]
            return self._error(404, BlockNotFound(f"block {gone} was just deleted"))
        except OSError as exc:
            log.warning("serve: %s failed: %s", url.path, exc)
            return self._error(500, f"cannot read {url.path}: {exc.strerror}", close=True)

    def _get_block(self, bid: str) -> None:
        app = self.server.app
        entry = listing(app.store, [app.store.get(bid)]).blocks[0]
        etag = f'"{entry.etag}"'
        size = entry.file_size
        start, end = 0, size - 1
        status = 200
        rng = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        if rng and (if_range is None or if_range == etag):
            m = _RANGE.fullmatch(rng.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                return self._send(416, b"", headers={"Content-Range": f"bytes */{size}"})
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:  # suffix range: the last N bytes
                start = max(0, size - int(m.group(2)))
            if start >= size or start > end:
                return self._send(416, b"", headers={"Content-Range": f"bytes */{size}"})
            status = 206
        with open(app.store.path_of(bid), "rb") as f:
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", etag)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if self.command != "HEAD":
                self.send_file(f, start, end - start + 1)

    # ------------------------------------------------------------------ POST (push)
    def _authorized(self) -> bool:
        app = self.server.app
        if app.push_token is None:
            self._error(403, AccessDenied("this server does not accept pushes (start it with a push "
                                          "token)"), close=True)
            return False
        auth = self.headers.get("Authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else ""
        if not given or not hmac.compare_digest(given.encode(), app.push_token.encode()):
            self._error(401, AccessDenied("push refused: " + ("wrong token" if given else "no token")
                                          + "; pass the server's push token"), close=True)
            return False
        return True

    def do_POST(self) -> None:
        app = self.server.app
        path = urlsplit(self.path).path
        if path not in ("/v1/push", "/v1/bundles"):
            return self._error(404, f"no such endpoint {path!r}", close=True)
        if not self._authorized():
            return
        if path == "/v1/push":
            return self._send(204, b"")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self._error(411, "a pushed bundle needs a Content-Length", close=True)
        if length > app.max_push_bytes:
            return self._error(413, _errors.BundleRejected(
                f"pushed bundle of {length} bytes is over this server's {app.max_push_bytes}-byte limit"),
                close=True)
        body = _Limited(self.rfile, length)
        try:
            report = import_stream(app.store, body, where=f"push from {self.client_address[0]}",
                                   fingerprint=app.fingerprint, policy=app.policy,
                                   incompatible="refuse", max_entry_bytes=app.max_push_bytes,
                                   check=app.check)
        except GraftmemError as exc:
            log.warning("refused a push from %s: %s", self.client_address[0], exc)
            return self._error(422, exc, close=body.left > 0)
        self._send(200, report.model_dump_json().encode())


class _Limited:
    """A request body: at most ``n`` bytes of the socket, then EOF."""

    def __init__(self, f: BinaryIO, n: int) -> None:
        self.f, self.left = f, n

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n) if n else b""
        self.left -= len(data)
        return data

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), self.left)
        got = self.f.readinto(view[:n]) if n else 0  # type: ignore[attr-defined]
        self.left -= got or 0
        return got or 0


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: "BlockServer"


class BlockServer:
    """Serve a store over HTTP (read-only unless ``push_token`` is set).

    ``fingerprint`` is required to accept pushes: a pushed block must match the engine that will
    graft it here. ``sign_key`` signs every listing so clients that require signatures can pull.
    ``check(block, staged_path)`` runs on every new pushed block before it is moved in
    (``Memory.serve(rederive=True)`` re-derives each one).
    Use as a context manager, or :meth:`start` (background thread) / :meth:`serve_forever`.
    """

    def __init__(self, store: Store | str | os.PathLike[str], *, host: str = "127.0.0.1",
                 port: int = 0, push_token: Optional[str] = None,
                 fingerprint: Optional[Fingerprint] = None, policy: Optional[TrustPolicy] = None,
                 sign_key: Optional[SigningKey] = None, max_push_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                 check: Optional[BlockCheck] = None,
                 handler: type[BaseHTTPRequestHandler] = _Handler) -> None:
        if push_token is not None and fingerprint is None:
            raise ConfigError("accepting pushes needs the engine fingerprint of this store "
                              "(Memory.serve passes it; the CLI loads the model)")
        if push_token is not None and len(push_token) < 8:
            raise ConfigError("the push token is too short: use at least 8 characters")
        self._owns_store = not isinstance(store, Store)
        self.store = store if isinstance(store, Store) else Store(store)
        self.push_token = push_token
        self.fingerprint = fingerprint
        self.policy = policy if policy is not None else TrustPolicy.load(self.store.home)
        self.sign_key = sign_key
        self.max_push_bytes = max_push_bytes
        self.check = check
        try:
            self._httpd = _HTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
        self._httpd.app = self
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "BlockServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="graftmem-serve",
                                        daemon=True)
        self._thread.start()
        log.info("serving %s at %s", self.store.home, self.url)
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "BlockServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
