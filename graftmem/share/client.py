"""The HTTP client of block sharing: pull blocks from a ``graftmem serve``, push a bundle to one (httpx).

A pull checks every byte as it arrives (`BlockChecker`) against the
digests the listing announced, keeps an interrupted download in ``<home>/.incoming`` and resumes it
with a Range request (the bytes already there are re-hashed first, so a resumed file is checked end to
end), and moves nothing into the store until every selected block has arrived: the admission of
`graftmem.share.admission`, the same as for a bundle file. A push sends one bundle, which the
server imports through that same admission.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional
from urllib.parse import urlsplit

import httpx

from ..core import errors as _errors
from ..core.blocks import Block, Fingerprint
from ..core.errors import BlockCorrupted, BlockNotFound, ConfigError, TransferError
from ..core.progress import progress_bar
from ..store.protocol import BlockStore
from .admission import DEFAULT_MAX_ENTRY_BYTES, Admission, BlockCheck, Incompatible, Staging, disk_error
from .bundle import export
from .manifest import CHUNK, MAX_MANIFEST_BYTES, BlockChecker, BundleEntry, BundleManifest, TransferReport, select
from .trust import Signature, SigningKey, TrustPolicy, TrustResult

__all__ = ["pull", "push", "fetch_listing", "SIGNATURE_HEADER", "LISTING_DOMAIN"]

log = logging.getLogger("graftmem")

#: the response header that carries the listing's signature, and the signature's domain
SIGNATURE_HEADER = "X-Graftmem-Signature"
LISTING_DOMAIN = "listing-v1"


def _base(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{url!r} is not an http(s) URL")
    return url


def _raise_for(resp: httpx.Response, what: str) -> None:
    """Turn an error response into our exception (`graftmem.core.errors.from_response`: the class the
    server named)."""
    if resp.status_code < 400:
        return
    try:
        body = resp.read()
    except httpx.HTTPError:
        body = b""
    raise _errors.from_response(resp.status_code, body, what)


def _client(timeout: float, api_key: Optional[str] = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=False, headers=headers)


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


def pull(store: BlockStore, url: str, block_ids: Optional[Iterable[str]] = None, *,
         fingerprint: Fingerprint, kind: Optional[str] = None, policy: Optional[TrustPolicy] = None,
         incompatible: Incompatible = "refuse", progress: bool = False, timeout: float = 60.0,
         max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
         check: Optional[BlockCheck] = None, api_key: Optional[str] = None) -> TransferReport:
    """Copy blocks (by id or prefix; default all, or all of ``kind``) from a ``graftmem serve`` at
    ``url`` into ``store``. Every byte is checked as it arrives; nothing enters the store until all
    selected blocks have arrived and checked; an interrupted pull resumes where it stopped.
    ``check(block, path)`` runs on each new compatible block before anything is moved in.
    ``api_key``: the server's key (``serve --api-key`` / ``--api-key-file``): with tenants, the blocks
    of that key's tenant and the shared ones are listed, never another tenant's."""
    t0 = time.perf_counter()
    url = _base(url)
    admission = Admission(store, fingerprint, where=url, incompatible=incompatible,
                          max_entry_bytes=max_entry_bytes, check=check)
    policy = policy if policy is not None else TrustPolicy.load(store.home)
    with _client(timeout, api_key) as client:
        man, signer, trusted = fetch_listing(client, url, policy)
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
        plan = admission.plan(entries, man.fingerprints, available={e.id: e for e in man.blocks})
        todo = plan.todo
        incoming = store.layout.incoming
        incoming.mkdir(exist_ok=True)
        bar = progress_bar(sum(e.file_size for e in todo), f"pull {urlsplit(url).netloc}", progress, unit="B")
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
    added, present, apart = admission.admit(plan, got, trust=TrustResult(signer=signer, trusted=trusted))
    for _, p in got:  # parts of blocks that were already present
        p.unlink(missing_ok=True)
    log.info("pulled %d blocks from %s (%d already present)", len(added), url, len(present))
    return TransferReport(source=url, blocks=len(plan.entries), added=added, present=present,
                          kept_apart=apart, skipped=plan.skipped,
                          bytes=sum(e.file_size for e in todo), seconds=time.perf_counter() - t0,
                          signer=signer, signer_trusted=trusted)


def push(store: BlockStore, url: str, block_ids: Optional[Iterable[str]] = None, *, token: str,
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
        bar = progress_bar(size, f"push {urlsplit(url).netloc}", progress, unit="B")

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
