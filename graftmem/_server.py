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
arrives (:class:`~graftmem._bundle.BlockChecker`) against the digests the listing announced, and
only move blocks into their store once every selected block has arrived and checked. An interrupted
download leaves its bytes in ``<home>/.incoming`` and the next pull resumes it with a Range request
(the bytes already there are re-hashed first, so a resumed file is checked end to end).

Pushes are off unless a token is set, the token is compared in constant time, and a pushed bundle
goes through the same import as a file: digests, strict member checks, the server's engine
fingerprint (required to enable pushes) and its trust policy.
"""

from __future__ import annotations

import fcntl
import hmac
import json
import logging
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional
from urllib.parse import parse_qs, urlsplit

import httpx

from . import _errors
from ._blocks import Block, Fingerprint
from ._bundle import (CHUNK, DEFAULT_MAX_ENTRY_BYTES, MAX_MANIFEST_BYTES, BlockCheck, BlockChecker,
                      BundleEntry, BundleManifest, Incompatible, Staging, TransferReport, _adopt,
                      _progress, disk_error, export, foreign_store, fsync_all, import_stream, listing,
                      select)
from ._errors import (AccessDenied, BlockCorrupted, BlockNotFound, ConfigError, GraftmemError,
                      IncompatibleBlock, TransferError)
from ._store import Store, incompatibility
from ._trust import Signature, SigningKey, TrustPolicy

__all__ = ["BlockServer", "pull", "push", "SIGNATURE_HEADER", "LISTING_DOMAIN"]

log = logging.getLogger("graftmem")

SIGNATURE_HEADER = "X-Graftmem-Signature"
LISTING_DOMAIN = "listing-v1"
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
                s = app.store.summary()
                from . import __version__

                info = {"graftmem": __version__, "api": 1, "blocks": s["blocks"], "bytes": s["bytes"],
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


# ============================================================================================ client
def _base(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{url!r} is not an http(s) URL")
    return url


def _raise_for(resp: httpx.Response, what: str) -> None:
    """Turn an error response into our exception (by the class name the server sent)."""
    if resp.status_code < 400:
        return
    try:
        resp.read()
        data = resp.json()
        name, msg = data["error"], data["message"]
    except (ValueError, KeyError, TypeError, httpx.HTTPError):
        name, msg = "TransferError", resp.text[:200] if resp.is_closed else ""
    cls = getattr(_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, GraftmemError)):
        cls = TransferError
    if resp.status_code in (401, 403) and not issubclass(cls, AccessDenied):
        cls = AccessDenied
    raise cls(f"{what}: server answered {resp.status_code}: {msg}")


def _client(timeout: float) -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=False)


def fetch_listing(client: httpx.Client, url: str, policy: TrustPolicy,
                  kind: Optional[str] = None) -> tuple[BundleManifest, Optional[str], bool]:
    """The server's listing, checked against the trust policy; returns (listing, signer, trusted)."""
    body = bytearray()
    try:
        with client.stream("GET", f"{url}/v1/blocks", params={"kind": kind} if kind else None) as resp:
            _raise_for(resp, f"listing {url}")
            for chunk in resp.iter_raw():  # bounded: a hostile server cannot exhaust our memory
                body += chunk
                if len(body) > MAX_MANIFEST_BYTES:
                    raise _errors.BundleRejected(f"the listing of {url} is over {MAX_MANIFEST_BYTES} "
                                                 "bytes; refusing it")
    except httpx.HTTPError as exc:
        raise TransferError(f"cannot reach {url}: {exc}; is `graftmem serve` running there?") from exc
    hdr = resp.headers.get(SIGNATURE_HEADER)
    sig = Signature.from_header(hdr) if hdr else None
    trust = policy.check(LISTING_DOMAIN, bytes(body), sig, what=f"the listing of {url}")
    try:
        return BundleManifest.model_validate_json(body), trust.signer, trust.trusted
    except ValueError as exc:
        raise _errors.BundleRejected(f"the listing of {url} does not parse: {exc}") from exc


def _download(client: httpx.Client, url: str, e: BundleEntry, part: Path, bar) -> Block:
    """Fetch one block file into ``part`` (resuming what is there), checking every byte. The part
    file is flock'ed for the duration, so two pulls into one store never interleave their bytes."""
    lock_fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TransferError(f"another pull is downloading block {e.id[:12]} into this store right "
                                "now; retry when it has finished") from None
        return _download_locked(client, url, e, part, bar)
    finally:
        os.close(lock_fd)


def _download_locked(client: httpx.Client, url: str, e: BundleEntry, part: Path, bar) -> Block:
    where = f"{url}/v1/blocks/{e.id[:12]}"

    def fresh() -> BlockChecker:
        return BlockChecker(e.file_size, where=where, expect=e)

    checker = fresh()
    have = part.stat().st_size if part.exists() else 0
    if have > e.file_size:
        part.unlink()
        have = 0
    if have:  # re-hash what an earlier, interrupted pull left
        try:
            with open(part, "rb", buffering=0) as f:
                buf = bytearray(CHUNK)
                view = memoryview(buf)
                left = have
                while left:
                    n = f.readinto(view[:min(left, CHUNK)])
                    if not n:
                        break
                    checker.feed(view[:n])
                    left -= n
        except BlockCorrupted:
            part.unlink()
            checker, have = fresh(), 0
        if bar:
            bar.update(have)
        log.info("resuming %s at byte %d of %d", where, have, e.file_size)
    if have < e.file_size:
        headers = {"Range": f"bytes={have}-", "If-Range": f'"{e.etag}"'} if have else {}
        got = have
        try:
            with client.stream("GET", f"{url}/v1/blocks/{e.id}", headers=headers) as resp:
                if resp.status_code == 200 and have:  # the server ignored the range: start over
                    bar and bar.update(-have)
                    checker, have, got = fresh(), 0, 0
                elif resp.status_code == 206:
                    cr = resp.headers.get("Content-Range", "")
                    if not cr.startswith(f"bytes {have}-"):
                        raise TransferError(f"{where}: the server answered range {cr!r}, asked for {have}-")
                else:
                    _raise_for(resp, f"download {where}")
                with open(part, "ab" if have else "wb") as out:
                    pending = bytearray()  # hash and write in ~1 MiB steps (blake3 likes big updates)

                    def flush() -> None:
                        nonlocal got
                        if not pending:
                            return
                        try:
                            checker.feed(pending)
                        except BlockCorrupted:
                            out.close()
                            part.unlink(missing_ok=True)
                            raise
                        out.write(pending)
                        got += len(pending)
                        if bar:
                            bar.update(len(pending))
                        pending.clear()

                    try:
                        for chunk in resp.iter_raw():
                            pending += chunk
                            if len(pending) >= 1 << 20:
                                flush()
                    finally:
                        flush()  # keep every byte that arrived, so the next pull resumes after it
        except httpx.HTTPError as exc:
            raise TransferError(f"download of block {e.id[:12]} from {url} was cut after {got} of "
                                f"{e.file_size} bytes ({exc}); nothing was added to the store; "
                                "pull again to resume") from exc
    try:
        return checker.finish()
    except BlockCorrupted:
        part.unlink(missing_ok=True)
        raise


def _with_ancestors(entries: list[BundleEntry], by_id: dict[str, BundleEntry], store: Store,
                    url: str) -> list[BundleEntry]:
    """``entries`` plus every ancestor a chained block needs (parents first), unless already here."""
    out: dict[str, BundleEntry] = {}

    def add(e: BundleEntry) -> None:
        if e.id in out:
            return
        if e.parent is not None and not store.contains(e.parent):
            if e.parent not in by_id:
                raise _errors.BundleRejected(f"block {e.id[:12]} on {url} continues block "
                                             f"{e.parent[:12]}, which neither {url} nor this store has")
            add(by_id[e.parent])
        out[e.id] = e

    for e in entries:
        add(e)
    return list(out.values())


def pull(store: Store, url: str, block_ids: Optional[Iterable[str]] = None, *,
         fingerprint: Fingerprint, kind: Optional[str] = None, policy: Optional[TrustPolicy] = None,
         incompatible: Incompatible = "refuse", progress: bool = False, timeout: float = 60.0,
         max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
         check: Optional[BlockCheck] = None) -> TransferReport:
    """Copy blocks (by id or prefix; default all, or all of ``kind``) from a ``graftmem serve`` at
    ``url`` into ``store``. Every byte is checked as it arrives; nothing enters the store until all
    selected blocks have arrived and checked; an interrupted pull resumes where it stopped.
    ``check(block, path)`` runs on each new compatible block before anything is moved in."""
    if incompatible not in ("refuse", "keep-apart", "skip"):
        raise ConfigError(f"incompatible={incompatible!r}: use 'refuse', 'keep-apart' or 'skip'")
    t0 = time.perf_counter()
    url = _base(url)
    policy = policy if policy is not None else TrustPolicy.load(store.home)
    with _client(timeout) as client:
        man, signer, trusted = fetch_listing(client, url, policy)
        by_id = {e.id: e for e in man.blocks}
        entries = man.blocks
        if block_ids is not None:
            chosen = []
            for want in dict.fromkeys(block_ids):
                hits = [e for e in entries if e.id.startswith(want)]
                if len(hits) != 1:
                    raise (BlockNotFound if not hits else ConfigError)(
                        f"{'no' if not hits else 'more than one'} block {want!r} on {url}")
                chosen.append(hits[0])
            entries = chosen
        if kind is not None:
            entries = [e for e in entries if e.kind == kind]
        entries = _with_ancestors(entries, by_id, store, url)
        local = fingerprint.digest()
        for e in entries:
            if e.file_size > max_entry_bytes:
                raise _errors.BundleRejected(f"block {e.id[:12]} on {url} is {e.file_size} bytes, over "
                                             f"the {max_entry_bytes}-byte limit")
            fp = man.fingerprints.get(e.fingerprint)
            if fp is None or fp.digest() != e.fingerprint:
                raise _errors.BundleRejected(f"the listing of {url} names fingerprint "
                                             f"{e.fingerprint[:12]} without a matching record")
        foreign = [e for e in entries if e.fingerprint != local]
        if foreign and incompatible == "refuse":
            from ._bundle import _stub

            err = incompatibility(_stub(foreign[0], man.fingerprints[foreign[0].fingerprint]), fingerprint)
            raise IncompatibleBlock(f"{url}: {len(foreign)} of {len(entries)} selected blocks were made by "
                                    f"another engine; {err}. Nothing was pulled; select compatible "
                                    "blocks, or pass incompatible='skip' or 'keep-apart'",
                                    fields=err.fields if err else {})
        skipped = [e.id for e in foreign] if incompatible == "skip" else []
        todo = [e for e in entries if e.id not in skipped]
        present = [e.id for e in todo if e.fingerprint == local and store.contains(e.id)]
        todo = [e for e in todo if e.id not in present]
        incoming = store.home / ".incoming"
        incoming.mkdir(exist_ok=True)
        bar = _progress(sum(e.file_size for e in todo), f"pull {urlsplit(url).netloc}", progress)
        got: list[tuple[Block, Path]] = []
        try:
            for e in todo:
                part = incoming / f"{e.id}.{e.etag[:16]}.part"
                got.append((_download(client, url, e, part, bar), part))
        except OSError as exc:
            raise disk_error(store, exc, f"pulling from {url}") from exc
        finally:
            if bar:
                bar.close()
    mine = [(b, p) for b, p in got if b.fingerprint.digest() == local]
    if check is not None:
        for b, p in mine:
            try:
                check(b, p)
            except BlockCorrupted:
                p.unlink(missing_ok=True)  # its bytes arrived intact but are not what they claim
                raise
    try:
        fsync_all([p for _, p in got])
    except OSError as exc:
        raise disk_error(store, exc, f"pulling from {url}") from exc
    apart = [(b, p) for b, p in got if b.fingerprint.digest() != local]
    for digest in {b.fingerprint.digest() for b, _ in apart}:
        fstore = foreign_store(store, digest)
        try:
            _adopt(fstore, [(b, p) for b, p in apart if b.fingerprint.digest() == digest])
        finally:
            fstore.close()
    added = _adopt(store, mine)
    present += [b.id for b, _ in mine if b.id not in added]
    for _, p in got:  # parts of blocks that were already present
        p.unlink(missing_ok=True)
    log.info("pulled %d blocks from %s (%d already present)", len(added), url, len(present))
    return TransferReport(source=url, blocks=len(entries), added=added, present=present,
                          kept_apart=[b.id for b, _ in apart], skipped=skipped,
                          bytes=sum(e.file_size for e in todo), seconds=time.perf_counter() - t0,
                          signer=signer, signer_trusted=trusted)


def push(store: Store, url: str, block_ids: Optional[Iterable[str]] = None, *, token: str,
         kind: Optional[str] = None, sign_key: Optional[SigningKey] = None, progress: bool = False,
         timeout: float = 60.0) -> TransferReport:
    """Send blocks (default all, or all of ``kind``) to a ``graftmem serve`` that accepts pushes, as
    one bundle; the server imports it all or nothing and returns its report."""
    url = _base(url)
    auth = {"Authorization": f"Bearer {token}"}
    blocks = select(store, block_ids, kind=kind)
    with _client(timeout) as client, Staging(store.home) as stage:
        try:
            _raise_for(client.post(f"{url}/v1/push", headers=auth), f"push to {url}")
        except httpx.HTTPError as exc:
            raise TransferError(f"cannot reach {url}: {exc}") from exc
        path = stage.path / "push.gmbundle"
        export(store, path, [b.id for b in blocks], sign_key=sign_key)
        size = path.stat().st_size
        bar = _progress(size, f"push {urlsplit(url).netloc}", progress)

        def body() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    if bar:
                        bar.update(len(chunk))
                    yield chunk

        try:
            resp = client.post(f"{url}/v1/bundles", content=body(),
                               headers={**auth, "Content-Length": str(size),
                                        "Content-Type": "application/x-tar"})
        except httpx.HTTPError as exc:
            raise TransferError(f"push to {url} failed: {exc}; nothing was added there unless the "
                                "server reports otherwise: push again") from exc
        finally:
            if bar:
                bar.close()
        _raise_for(resp, f"push to {url}")
        return TransferReport.model_validate_json(resp.content)
