"""Portable bundles: many blocks in one file that another machine can import, verified, all or none.

A learned block is an asset worth carrying (the paper moves 8/8 blocks to a freshly built machine and
gets equal SHA-256s). Carrying it must not open a door: nothing in a bundle is trusted until checked,
and a bundle that fails anywhere leaves the store exactly as it was.

Layout: an uncompressed POSIX tar (readable with ``tar tvf``), written and read by our own strict code::

    graftmem-bundle.json       the bundle manifest (`BundleManifest`), always first
    graftmem-bundle.sig        optional: ed25519 signature over the manifest bytes (`._trust`)
    blocks/<id>.gmb            one block file per manifest entry, byte-for-byte the store's file

The manifest pins each block by id, file size, ``state_digest`` (BLAKE3 of the state) and
``manifest_digest`` (the block file's trailer: BLAKE3 of its header and manifest), so a signature over
the manifest covers every byte: the state, and every field of each block's manifest (text, tokens,
name, kind, metadata such as ``when_to_use``, ``pos_start``, ``parent`` and through it the parent
chain), since the trailer digest is checked against the announced ``manifest_digest`` before a block
is admitted (tests/test_trust.py changes each field and watches the import refuse it). Why a tar and not pickle or zip: no code runs on read, there is one
member header per file, and a plain ustar header is simple enough to check completely. Why our own
reader rather than `extractall()`: we accept only the exact names the manifest
announces, only regular files, only the announced sizes, and we refuse everything else (absolute
names, ``..``, links, devices, extended headers, duplicates, extra members) *before* a byte is written.

Import reads each member once: the bytes are hashed as they stream past (`BlockChecker`) and
written to a staging directory inside the store home; when every block has been checked, the files
are moved in under the store lock ([`Store.adopt()`][graftmem.Store.adopt]), and rolled back if any move fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import tarfile
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Optional

from ..core.blocks import FORMAT_VERSION, Block, Fingerprint
from ..core.errors import BlockCorrupted, BundleRejected, ConfigError, StoreError
from ..core.progress import progress_bar
from ..core.version import __version__
from ..store.local import atomic_file, open_regular
from ..store.protocol import BlockStore
from .admission import DEFAULT_MAX_ENTRY_BYTES, Admission, BlockCheck, Incompatible, Staging, disk_error
from .manifest import (BUNDLE_VERSION, CHUNK, MANIFEST_NAME, MAX_MANIFEST_BYTES, SIGN_DOMAIN, SIGNATURE_NAME,
                       BlockChecker, BundleManifest, ExportReport, TransferReport, listing, select)
from .trust import Signature, SigningKey, TrustPolicy, TrustResult

__all__ = ["export", "import_bundle", "import_stream"]

log = logging.getLogger("graftmem")

_BLOCK_NAME = re.compile(r"blocks/([0-9a-f]{64})\.gmb")
_TAR_BLOCK = 512


# ---------------------------------------------------------------------------------------- tar I/O
def _tar_header(name: str, size: int, mtime: float) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.type = size, int(mtime), 0o644, tarfile.REGTYPE
    ti.uname = ti.gname = ""
    return ti.tobuf(tarfile.USTAR_FORMAT)


def _pad(n: int) -> bytes:
    return b"\0" * (-n % _TAR_BLOCK)


def _read_exact(f: BinaryIO, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = f.read(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _member_problem(ti: tarfile.TarInfo) -> Optional[str]:
    """Why a member is unsafe, before its name is even compared with the manifest."""
    name = ti.name
    if ti.issym() or ti.islnk():
        return f"member {name!r} is a link (to {ti.linkname!r}); bundles contain regular files only"
    if ti.ischr() or ti.isblk() or ti.isfifo():
        return f"member {name!r} is a device or fifo; bundles contain regular files only"
    if ti.isdir():
        return f"member {name!r} is a directory; bundles contain regular files only"
    if not ti.isreg() or ti.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        return f"member {name!r} has tar type {ti.type!r} (extended or sparse header); not allowed"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return f"member {name!r} is an absolute path; it would escape the store"
    if "\\" in name or "\0" in name:
        return f"member {name!r} contains a backslash or NUL"
    if ".." in name.split("/"):
        return f"member {name!r} contains '..'; it would escape the store"
    return None


class _TarReader:
    """Sequential, strict reader of our ustar bundles from a readable stream (a socket, a pipe) or
    an mmap of a bundle file. The mmap path hands the checker and the writer views of the mapped
    page cache, saving the copy into a user buffer: one copy per byte, like a plain file copy."""

    def __init__(self, f: BinaryIO | mmap.mmap, where: str) -> None:
        self.mm = f if isinstance(f, mmap.mmap) else None
        self.f = f
        self.where = where
        self.offset = 0

    def _read(self, n: int) -> bytes:
        if self.mm is not None:
            data = self.mm[self.offset:self.offset + n]
        else:
            data = _read_exact(self.f, n)  # type: ignore[arg-type]
        self.offset += len(data)
        return data

    def next(self) -> Optional[tarfile.TarInfo]:
        hdr = self._read(_TAR_BLOCK)
        if len(hdr) < _TAR_BLOCK:
            raise BundleRejected(f"{self.where}: truncated bundle (a member header is cut after "
                                 f"{len(hdr)} bytes at offset {self.offset - len(hdr)})")
        if not any(hdr):
            return None
        try:
            return tarfile.TarInfo.frombuf(hdr, "utf-8", "strict")
        except (tarfile.HeaderError, UnicodeDecodeError) as exc:
            raise BundleRejected(f"{self.where}: damaged member header at offset "
                                 f"{self.offset - _TAR_BLOCK}: {exc}") from exc

    def read_into(self, size: int, sink: Callable[[memoryview], None], buf: bytearray) -> None:
        """Stream ``size`` data bytes (then the padding) to ``sink`` in chunks of ``len(buf)``."""
        left = size
        if self.mm is not None:
            end = min(self.offset + size, len(self.mm))
            with memoryview(self.mm) as whole:
                for pos in range(self.offset, end, CHUNK):
                    sink(whole[pos:min(pos + CHUNK, end)])
            left -= end - self.offset
            self.offset = end
            if left:
                raise BundleRejected(f"{self.where}: truncated bundle: a member ends {left} bytes early")
        else:
            view = memoryview(buf)
            while left:
                n = self.f.readinto(view[:min(left, len(view))])  # type: ignore[union-attr]
                if not n:
                    raise BundleRejected(f"{self.where}: truncated bundle: a member ends {left} bytes early")
                sink(view[:n])
                left -= n
            self.offset += size
        pad = -size % _TAR_BLOCK
        if pad and len(self._read(pad)) != pad:
            raise BundleRejected(f"{self.where}: truncated bundle (padding)")

    def read_small(self, ti: tarfile.TarInfo, limit: int) -> bytes:
        if ti.size > limit:
            raise BundleRejected(f"{self.where}: member {ti.name!r} is {ti.size} bytes, over the "
                                 f"{limit}-byte limit")
        out = bytearray()
        self.read_into(ti.size, out.extend, bytearray(min(max(ti.size, 1), CHUNK)))
        return bytes(out)


# ---------------------------------------------------------------------------------------- export
def export(store: BlockStore, path: str | os.PathLike[str], block_ids: Optional[Iterable[str]] = None, *,
           kind: Optional[str] = None, where: Optional[Callable[[Block], bool]] = None,
           sign_key: Optional[SigningKey] = None, progress: bool = False) -> ExportReport:
    """Write the selected blocks (default: all) to one bundle file at ``path``, atomically.

    Every block is re-checked while it is copied (its digests against its bytes), so a damaged block
    is never exported: the export fails and no file is left at ``path``.
    """
    t0 = time.perf_counter()
    blocks = select(store, block_ids, kind=kind, where=where)
    if not blocks:
        raise ConfigError(f"nothing to export from {store.home}: no block matches the selection")
    manifest = listing(store, blocks)
    mbytes = manifest.model_dump_json(indent=1).encode()
    sig = sign_key.sign(SIGN_DOMAIN, mbytes) if sign_key is not None else None
    path = Path(path)
    now = time.time()
    bar = progress_bar(manifest.total_bytes, f"export {path.name}", progress, unit="B")
    written = 0
    try:
        with atomic_file(path) as out:
            def small(name: str, data: bytes) -> None:
                out.write(_tar_header(name, len(data), now) + data + _pad(len(data)))

            small(MANIFEST_NAME, mbytes)
            if sig is not None:
                small(SIGNATURE_NAME, sig.model_dump_json().encode())
            for entry in manifest.blocks:
                src = store.path_of(entry.id)
                checker = BlockChecker(entry.file_size, where=str(src), expect=entry)
                out.write(_tar_header(f"blocks/{entry.id}.gmb", entry.file_size, now))
                with open_regular(src) as f:
                    # mapped, so the checker and the writer see the page cache: one copy per byte
                    size = os.fstat(f.fileno()).st_size
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
                    try:
                        with memoryview(mm if mm is not None else b"") as whole:
                            for pos in range(0, size, CHUNK):
                                piece = whole[pos:pos + CHUNK]
                                checker.feed(piece)
                                out.write(piece)
                                if bar:
                                    bar.update(len(piece))
                                del piece
                    finally:
                        if mm is not None:
                            with contextlib.suppress(BufferError):
                                mm.close()
                if size != entry.file_size:
                    raise BlockCorrupted(f"{src}: the file changed size during the export", path=str(src))
                checker.finish()
                out.write(_pad(entry.file_size))
                written += entry.file_size
            out.write(b"\0" * (2 * _TAR_BLOCK))
    except OSError as exc:
        raise StoreError(f"cannot write the bundle {path}: {exc}") from exc
    finally:
        if bar:
            bar.close()
    log.info("exported %d blocks (%d bytes) to %s", len(blocks), written, path)
    return ExportReport(path=str(path), blocks=[b.id for b in blocks], bytes=path.stat().st_size,
                        seconds=time.perf_counter() - t0,
                        signer=sign_key.public_key.key_id if sign_key else None)


# ---------------------------------------------------------------------------------------- import
def import_bundle(store: BlockStore, path: str | os.PathLike[str], *, fingerprint: Fingerprint,
                  policy: Optional[TrustPolicy] = None, incompatible: Incompatible = "refuse",
                  max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, progress: bool = False,
                  check: Optional[BlockCheck] = None) -> TransferReport:
    """Import a bundle file into ``store``: every digest checked while reading, all or nothing.

    ``fingerprint`` is the local engine's: blocks made under another one are refused
    (``incompatible="refuse"``, the default: the whole bundle is refused), kept apart in
    ``<home>/foreign/`` (``"keep-apart"``), or left out (``"skip"``); they never enter the main store.
    ``policy`` (default: ``<home>/trust.json``) decides whether a signature is required.
    ``check(block, staged_path)`` runs on every new compatible block after all bytes are checked and
    before anything is moved in; it raises to refuse the bundle (``Memory.import_bundle(rederive=
    True)`` passes a re-derivation here).
    """
    path = Path(path)
    try:
        f = open(path, "rb", buffering=0)
    except OSError as exc:
        raise ConfigError(f"cannot open the bundle {path}: {exc}") from exc
    with f:
        src: BinaryIO | mmap.mmap = f
        try:
            if os.fstat(f.fileno()).st_size:
                src = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if hasattr(src, "madvise"):
                    src.madvise(mmap.MADV_SEQUENTIAL)
        except (OSError, ValueError):  # not mappable (a pipe, a special file): stream it
            src = f
        try:
            return import_stream(store, src, where=str(path), fingerprint=fingerprint, policy=policy,
                                 incompatible=incompatible, max_entry_bytes=max_entry_bytes,
                                 progress=progress, check=check)
        finally:
            if isinstance(src, mmap.mmap):
                with contextlib.suppress(BufferError):  # a view kept alive by a traceback
                    src.close()


def import_stream(store: BlockStore, f: BinaryIO | mmap.mmap, *, where: str, fingerprint: Fingerprint,
                  policy: Optional[TrustPolicy] = None, incompatible: Incompatible = "refuse",
                  max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, progress: bool = False,
                  check: Optional[BlockCheck] = None) -> TransferReport:
    """`import_bundle()` from any readable stream (an HTTP request body) or an mmap."""
    admission = Admission(store, fingerprint, where=where, incompatible=incompatible,
                          max_entry_bytes=max_entry_bytes, check=check)
    t0 = time.perf_counter()
    policy = policy if policy is not None else TrustPolicy.load(store.home)
    tar = _TarReader(f, where)

    # 1. the manifest (first member), then the optional signature: checked before any block byte
    ti = tar.next()
    if ti is None:
        raise BundleRejected(f"{where}: empty bundle")
    if (p := _member_problem(ti)) or ti.name != MANIFEST_NAME:
        raise BundleRejected(f"{where}: {p or f'first member is {ti.name!r}, expected {MANIFEST_NAME!r}'}; "
                             "not a graftmem bundle")
    mbytes = tar.read_small(ti, MAX_MANIFEST_BYTES)
    _check_versions(mbytes, where)
    try:
        manifest = BundleManifest.model_validate_json(mbytes)
    except ValueError as exc:
        raise BundleRejected(f"{where}: the bundle manifest does not parse: {exc}") from exc
    ti = tar.next()
    sig: Optional[Signature] = None
    if ti is not None and ti.name == SIGNATURE_NAME and _member_problem(ti) is None:
        try:
            sig = Signature.model_validate_json(tar.read_small(ti, 64 << 10))
        except ValueError as exc:
            raise BundleRejected(f"{where}: the signature member does not parse: {exc}") from exc
        ti = tar.next()
    trust: TrustResult = policy.check(SIGN_DOMAIN, mbytes, sig, what=f"bundle {where}")

    # 2. what the manifest announces: limits, fingerprints, ancestors, other engines
    plan = admission.plan(manifest.blocks, manifest.fingerprints)
    entries = {e.id: e for e in plan.entries}

    # 3. the blocks: each streamed once through the checker into staging
    arrived: list[tuple[Block, Path]] = []
    seen: set[str] = set()
    buf = bytearray(CHUNK)
    bar = progress_bar(manifest.total_bytes, f"import {Path(where).name}", progress, unit="B")
    try:
        with Staging(store.home) as stage:
            while ti is not None:
                if p := _member_problem(ti):
                    raise BundleRejected(f"{where}: {p}")
                m = _BLOCK_NAME.fullmatch(ti.name)
                if m is None or m.group(1) not in entries:
                    raise BundleRejected(f"{where}: unexpected member {ti.name!r}: the manifest does not "
                                         "announce it")
                bid = m.group(1)
                if bid in seen:
                    raise BundleRejected(f"{where}: member {ti.name!r} appears twice")
                seen.add(bid)
                e = entries[bid]
                if ti.size != e.file_size:
                    raise BundleRejected(f"{where}: member {ti.name!r} is {ti.size} bytes, the manifest "
                                         f"announced {e.file_size}")
                checker = BlockChecker(e.file_size, where=f"{where}:{ti.name}", expect=e)
                keep = plan.keep(bid)
                dst = stage.path / f"{bid}.gmb"
                out = open(dst, "xb") if keep else None
                try:
                    # this member's checker and file, bound now (the closure runs within this iteration)
                    def sink(mv: memoryview, checker: BlockChecker = checker, out: BinaryIO | None = out) -> None:
                        checker.feed(mv)
                        if out is not None:
                            out.write(mv)
                        if bar:
                            bar.update(len(mv))

                    tar.read_into(ti.size, sink, buf)
                    block = checker.finish()
                finally:
                    if out is not None:
                        out.close()
                if keep:
                    arrived.append((block, dst))
                ti = tar.next()
            missing = set(entries) - seen
            if missing:
                raise BundleRejected(f"{where}: truncated bundle: {len(missing)} announced blocks are "
                                     f"missing (e.g. {sorted(missing)[0][:12]})")
            # 4. everything checked: the extra check, fsync, move in, all or none
            added, present, apart = admission.admit(plan, arrived, trust=trust)
    except OSError as exc:
        raise disk_error(store, exc, f"importing {where}") from exc
    finally:
        if bar:
            bar.close()
    log.info("imported %s: %d added, %d present, %d kept apart, %d skipped", where, len(added),
             len(present), len(apart), len(plan.skipped))
    return TransferReport(source=where, blocks=len(entries), added=added, present=present,
                          kept_apart=apart, skipped=plan.skipped,
                          bytes=manifest.total_bytes, seconds=time.perf_counter() - t0,
                          signer=trust.signer, signer_trusted=trust.trusted)


def _check_versions(mbytes: bytes, where: str) -> None:
    """Name a version mismatch plainly, before the strict model would call it a parse error."""
    try:
        head = json.loads(mbytes)
    except ValueError as exc:
        raise BundleRejected(f"{where}: the bundle manifest is not JSON: {exc}") from exc
    if not isinstance(head, dict) or head.get("format") != "graftmem-bundle":
        raise BundleRejected(f"{where}: not a graftmem bundle manifest")
    for field, ours in (("bundle_version", BUNDLE_VERSION), ("block_format_version", FORMAT_VERSION)):
        theirs = head.get(field)
        if theirs != ours:
            raise BundleRejected(f"{where}: {field} is {theirs!r}, this graftmem ({__version__}) reads "
                                 f"{ours}; the bundle was written by graftmem "
                                 f"{head.get('graftmem_version', '?')}: use a matching version")
