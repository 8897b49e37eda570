"""Portable bundles: many blocks in one file that another machine can import, verified, all or none.

A learned block is an asset worth carrying (the paper moves 8/8 blocks to a freshly built machine and
gets equal SHA-256s). Carrying it must not open a door: nothing in a bundle is trusted until checked,
and a bundle that fails anywhere leaves the store exactly as it was.

Layout: an uncompressed POSIX tar (readable with ``tar tvf``), written and read by our own strict code::

    graftmem-bundle.json       the bundle manifest (:class:`BundleManifest`), always first
    graftmem-bundle.sig        optional: ed25519 signature over the manifest bytes (:mod:`._trust`)
    blocks/<id>.gmb            one block file per manifest entry, byte-for-byte the store's file

The manifest pins each block by id, file size, ``state_digest`` (BLAKE3 of the state) and
``manifest_digest`` (the block file's trailer: BLAKE3 of its header and manifest), so a signature over
the manifest covers every byte. Why a tar and not pickle or zip: no code runs on read, there is one
member header per file, and a plain ustar header is simple enough to check completely. Why our own
reader rather than :meth:`tarfile.TarFile.extractall`: we accept only the exact names the manifest
announces, only regular files, only the announced sizes, and we refuse everything else (absolute
names, ``..``, links, devices, extended headers, duplicates, extra members) *before* a byte is written.

Import reads each member once: the bytes are hashed as they stream past (:class:`BlockChecker`) and
written to a staging directory inside the store home; when every block has been checked, the files
are moved in under the store lock (:meth:`Store.adopt`), and rolled back if any move fails.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import secrets
import shutil
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Literal, Optional

import blake3
from pydantic import BaseModel, ConfigDict, Field

from ._blocks import FORMAT_VERSION, Block, Fingerprint, block_id_for
from ._errors import (BlockCorrupted, BlockNotFound, BundleRejected, ConfigError, IncompatibleBlock,
                      StoreError, StoreFull)
from ._format import HEADER, TRAILER_LEN, parse_header, parse_manifest
from ._store import Store, atomic_file, fsync_path, incompatibility, pid_alive
from ._trust import Signature, SigningKey, TrustPolicy, TrustResult

__all__ = ["BundleEntry", "BundleManifest", "BlockChecker", "ExportReport", "TransferReport",
           "export", "import_bundle", "import_stream", "entry_for", "listing", "Staging",
           "MANIFEST_NAME", "SIGNATURE_NAME", "DEFAULT_MAX_ENTRY_BYTES", "Incompatible", "fsync_all",
           "BlockCheck", "disk_error"]

log = logging.getLogger("graftmem")

MANIFEST_NAME = "graftmem-bundle.json"
SIGNATURE_NAME = "graftmem-bundle.sig"
BUNDLE_VERSION = 1
SIGN_DOMAIN = "bundle-manifest-v1"
#: Largest block file accepted in a bundle or a download unless the caller says otherwise (4 GiB:
#: a 128k-token state of a small model; raise it for bigger models).
DEFAULT_MAX_ENTRY_BYTES = 4 << 30
#: Largest bundle manifest or signature member (the manifest lists ids and digests, not texts).
MAX_MANIFEST_BYTES = 16 << 20
#: Largest block manifest inside a block file (it holds the text and the token ids).
MAX_BLOCK_MANIFEST_BYTES = 64 << 20
CHUNK = 4 << 20
_BLOCK_NAME = re.compile(r"blocks/([0-9a-f]{64})\.gmb")
_TAR_BLOCK = 512

Incompatible = Literal["refuse", "keep-apart", "skip"]
#: An extra check of a verified, staged block file before it is moved in (raise to refuse).
BlockCheck = Callable[[Block, Path], None]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BundleEntry(_Strict):
    """One block as a bundle or a listing announces it; every field is checked against the bytes."""

    id: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str
    kind: str
    n_tokens: int = Field(ge=0)
    state_size: int = Field(ge=0)
    file_size: int = Field(ge=HEADER.size + TRAILER_LEN)
    state_digest: str = Field(pattern=r"^blake3:[0-9a-f]{64}$")
    manifest_digest: str = Field(pattern=r"^blake3:[0-9a-f]{64}$")
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    parent: Optional[str] = Field(None, pattern=r"^[0-9a-f]{64}$")

    @property
    def etag(self) -> str:
        """HTTP validator: the trailer digest changes whenever any byte of the file does."""
        return self.manifest_digest.split(":", 1)[-1][:32]


class BundleManifest(_Strict):
    """What a bundle (or a served store listing) contains: versions, fingerprints, blocks."""

    format: Literal["graftmem-bundle"] = "graftmem-bundle"
    bundle_version: Literal[1] = BUNDLE_VERSION
    block_format_version: int = Field(FORMAT_VERSION, ge=FORMAT_VERSION, le=FORMAT_VERSION)
    graftmem_version: str
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    fingerprints: dict[str, Fingerprint]
    blocks: list[BundleEntry]

    @property
    def total_bytes(self) -> int:
        return sum(e.file_size for e in self.blocks)


class ExportReport(_Strict):
    path: str
    blocks: list[str]
    bytes: int
    seconds: float
    signer: Optional[str] = None


class TransferReport(_Strict):
    """What an import, pull or push did. ``added`` are new in the store; ``present`` were already
    there (deduplicated by content id); ``kept_apart`` went to the foreign area (another fingerprint,
    never grafted); ``skipped`` were incompatible and left out on request."""

    source: str
    blocks: int
    added: list[str]
    present: list[str]
    kept_apart: list[str] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)
    bytes: int
    seconds: float
    signer: Optional[str] = None
    signer_trusted: bool = False


def _version() -> str:
    from . import __version__

    return __version__


def _digest_hex(tag_digest: str) -> str:
    return tag_digest.split(":", 1)[-1]


# ---------------------------------------------------------------------------------------- checking
class BlockChecker:
    """Check one block file as its bytes stream past, in order, holding only header and manifest.

    ``feed`` the bytes as they arrive (from a tar member, a socket, a file being exported); ``finish``
    then checks the trailer over header+manifest, the state digest, the content id (recomputed from
    fingerprint and tokens) and, if an :class:`BundleEntry` was announced, that every announced field
    matches. Header inconsistencies (wrong magic, wrong size) are raised on the first 64 bytes, before
    the rest is read.
    """

    def __init__(self, file_size: int, *, where: str, expect: Optional[BundleEntry] = None) -> None:
        self.file_size = file_size
        self.where = where
        self.expect = expect
        self.pos = 0
        self._prefix = bytearray()
        self._soff: Optional[int] = None
        self._slen = 0
        self._trailer = bytearray()
        self._hash = blake3.blake3(max_threads=blake3.blake3.AUTO)

    def _corrupt(self, msg: str, **kw: str) -> BlockCorrupted:
        return BlockCorrupted(f"{self.where}: {msg}", path=self.where, **kw)

    def feed(self, data: bytes | memoryview) -> None:
        mv = memoryview(data).cast("B")
        if self.pos + len(mv) > self.file_size:
            raise self._corrupt(f"more bytes than the announced {self.file_size}")
        while len(mv):
            if self._soff is None or self.pos < self._soff:
                want = (HEADER.size if self._soff is None else self._soff) - self.pos
                take, mv = mv[:want], mv[want:]
                self._prefix += take
                self.pos += len(take)
                if self._soff is None and self.pos == HEADER.size:
                    mlen, self._soff, self._slen = parse_header(bytes(self._prefix), where=self.where,
                                                                file_size=self.file_size)
                    if mlen > MAX_BLOCK_MANIFEST_BYTES:
                        raise self._corrupt(f"block manifest of {mlen} bytes exceeds the "
                                            f"{MAX_BLOCK_MANIFEST_BYTES}-byte limit")
                    if self.expect is not None and self._slen != self.expect.state_size:
                        raise self._corrupt(f"header says {self._slen} state bytes, the manifest "
                                            f"announced {self.expect.state_size}")
            elif self.pos < self._soff + self._slen:
                want = self._soff + self._slen - self.pos
                take, mv = mv[:want], mv[want:]
                self._hash.update(take)
                self.pos += len(take)
            else:
                self._trailer += mv
                self.pos += len(mv)
                mv = mv[len(mv):]

    def finish(self) -> Block:
        if self.pos != self.file_size or self._soff is None:
            raise self._corrupt(f"truncated: {self.pos} of {self.file_size} bytes",
                                expected=str(self.file_size), actual=str(self.pos))
        block = parse_manifest(bytes(self._prefix), bytes(self._trailer), where=self.where)
        actual = "blake3:" + self._hash.hexdigest()
        if actual != block.state_digest:
            raise self._corrupt(f"state digest mismatch: expected {block.state_digest}, actual {actual}",
                                expected=block.state_digest, actual=actual)
        if block.state_size != self._slen or block.n_tokens != len(block.tokens):
            raise self._corrupt("manifest sizes do not match the file")
        if block_id_for(block.fingerprint, block.tokens, block.parent) != block.id:
            raise self._corrupt(f"block id {block.short_id} is not the content address of its "
                                "fingerprint and tokens: the manifest was forged or damaged")
        e = self.expect
        if e is not None:
            mdig = "blake3:" + bytes(self._trailer).hex()
            checks = {"id": (e.id, block.id), "state_digest": (e.state_digest, block.state_digest),
                      "manifest_digest": (e.manifest_digest, mdig),
                      "fingerprint": (e.fingerprint, block.fingerprint.digest()),
                      "parent": (e.parent, block.parent)}
            for field, (want, got) in checks.items():
                if want != got:
                    raise self._corrupt(f"{field} mismatch: the bundle/listing announced {want}, "
                                        f"the block has {got}", expected=want, actual=got)
        return block


def entry_for(store: Store, block: Block) -> BundleEntry:
    """The entry announcing ``block`` (reads the 32-byte trailer of its file)."""
    path = store.path_of(block.id)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TRAILER_LEN))
            trailer = f.read(TRAILER_LEN)
    except FileNotFoundError as exc:
        raise StoreError(f"block {block.short_id} is indexed but its file {path} is missing; "
                         "run `graftmem doctor`") from exc
    return BundleEntry(id=block.id, name=block.name, kind=block.kind, n_tokens=block.n_tokens,
                       state_size=block.state_size, file_size=size, state_digest=block.state_digest,
                       manifest_digest="blake3:" + trailer.hex(), fingerprint=block.fingerprint.digest(),
                       parent=block.parent)


def select(store: Store, block_ids: Optional[Iterable[str]] = None, *, kind: Optional[str] = None,
           where: Optional[Callable[[Block], bool]] = None) -> list[Block]:
    """Blocks by id (or unique prefix), else all (of ``kind``), then filtered by ``where``; then
    every ancestor of a chained block is added (before it), since a child cannot be grafted
    without its parent."""
    if block_ids is not None:
        blocks = [store.get(store.resolve(b)) for b in dict.fromkeys(block_ids)]
        if kind is not None:
            blocks = [b for b in blocks if b.kind == kind]
    else:
        blocks = store.list(kind=kind)
    blocks = [b for b in blocks if where is None or where(b)]
    out: dict[str, Block] = {}

    def add(b: Block) -> None:
        if b.id in out:
            return
        if b.parent is not None:
            try:
                add(store.get(b.parent))
            except BlockNotFound as exc:
                raise StoreError(f"block {b.short_id} continues block {b.parent[:12]}, which is not in "
                                 f"{store.home}: it cannot be carried without it") from exc
        out[b.id] = b

    for b in blocks:
        add(b)
    return list(out.values())


def listing(store: Store, blocks: list[Block]) -> BundleManifest:
    return BundleManifest(graftmem_version=_version(),
                          fingerprints={b.fingerprint.digest(): b.fingerprint for b in blocks},
                          blocks=[entry_for(store, b) for b in blocks])


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


# ---------------------------------------------------------------------------------------- staging
class Staging:
    """A private directory inside the store home (same filesystem, so moves are renames), removed on
    exit; directories left by dead processes are removed the next time one is made."""

    ROOT = ".staging"

    def __init__(self, home: Path) -> None:
        root = home / self.ROOT
        root.mkdir(parents=True, exist_ok=True)
        for old in root.iterdir():
            try:
                pid = int(old.name.split("-")[0])
            except ValueError:
                continue
            if pid != os.getpid() and not pid_alive(pid):
                shutil.rmtree(old, ignore_errors=True)
        self.path = root / f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path.mkdir()

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def fsync_all(paths: list[Path]) -> None:
    """fsync many files at once: concurrent fsyncs share journal commits (ext4, xfs), so N files
    cost about as much as one instead of N times as much."""
    if len(paths) <= 1:
        for p in paths:
            fsync_path(p)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:
        list(pool.map(fsync_path, paths))


def foreign_store(store: Store, fp_digest: str) -> Store:
    """The store that keeps blocks of another fingerprint apart: ``<home>/foreign/<digest[:16]>``.
    The main store never indexes it, so its blocks can never be grafted here; export it from there to
    a machine whose engine matches."""
    return Store(store.home / "foreign" / fp_digest[:16], lock_timeout=store.lock_timeout)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


# ---------------------------------------------------------------------------------------- export
def export(store: Store, path: str | os.PathLike[str], block_ids: Optional[Iterable[str]] = None, *,
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
    bar = _progress(manifest.total_bytes, f"export {path.name}", progress)
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
                with open(src, "rb", buffering=0) as f:
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
def import_bundle(store: Store, path: str | os.PathLike[str], *, fingerprint: Fingerprint,
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


def import_stream(store: Store, f: BinaryIO | mmap.mmap, *, where: str, fingerprint: Fingerprint,
                  policy: Optional[TrustPolicy] = None, incompatible: Incompatible = "refuse",
                  max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, progress: bool = False,
                  check: Optional[BlockCheck] = None) -> TransferReport:
    """:func:`import_bundle` from any readable stream (an HTTP request body) or an mmap."""
    if incompatible not in ("refuse", "keep-apart", "skip"):
        raise ConfigError(f"incompatible={incompatible!r}: use 'refuse', 'keep-apart' or 'skip'")
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

    # 2. what the manifest announces: limits, fingerprints, duplicates
    local_fp = fingerprint.digest()
    entries: dict[str, BundleEntry] = {}
    for e in manifest.blocks:
        if e.id in entries:
            raise BundleRejected(f"{where}: block {e.id[:12]} is listed twice")
        if e.file_size > max_entry_bytes:
            raise BundleRejected(f"{where}: block {e.id[:12]} is {e.file_size} bytes, over the "
                                 f"{max_entry_bytes}-byte limit (pass max_entry_bytes to allow it)")
        if e.fingerprint not in manifest.fingerprints:
            raise BundleRejected(f"{where}: block {e.id[:12]} names a fingerprint the manifest lacks")
        entries[e.id] = e
    for digest, fp in manifest.fingerprints.items():
        if fp.digest() != digest:
            raise BundleRejected(f"{where}: fingerprint {digest[:12]} does not hash to its key")
    for e in entries.values():
        if e.parent is not None and e.parent not in entries and not store.contains(e.parent):
            raise BundleRejected(f"{where}: block {e.id[:12]} continues block {e.parent[:12]}, which is "
                                 "neither in the bundle nor in this store; export it with its parent")
    foreign = {i for i, e in entries.items() if e.fingerprint != local_fp}
    if foreign and incompatible == "refuse":
        e = entries[sorted(foreign)[0]]
        stub = incompatibility(_stub(e, manifest.fingerprints[e.fingerprint]), fingerprint)
        raise IncompatibleBlock(f"{where}: {len(foreign)} of {len(entries)} blocks were made by another "
                                f"engine; {stub}. Nothing was imported; import with "
                                "incompatible='keep-apart' (CLI: --incompatible keep-apart) to keep "
                                "them apart",
                                fields=stub.fields if stub else {})

    # 3. the blocks: each streamed once through the checker into staging
    staged: list[tuple[Block, Path]] = []
    apart: list[tuple[Block, Path]] = []
    present: list[str] = []
    skipped: list[str] = []
    seen: set[str] = set()
    buf = bytearray(CHUNK)
    bar = _progress(manifest.total_bytes, f"import {Path(where).name}", progress)
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
                keep = not (bid in foreign and incompatible == "skip") and not (
                    bid not in foreign and store.contains(bid))
                dst = stage.path / f"{bid}.gmb"
                out = open(dst, "xb") if keep else None
                try:
                    def sink(mv: memoryview) -> None:
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
                if bid in foreign:
                    if keep:
                        apart.append((block, dst))
                    else:
                        skipped.append(bid)
                elif keep:
                    staged.append((block, dst))
                else:
                    present.append(bid)
                ti = tar.next()
            missing = set(entries) - seen
            if missing:
                raise BundleRejected(f"{where}: truncated bundle: {len(missing)} announced blocks are "
                                     f"missing (e.g. {sorted(missing)[0][:12]})")
            if check is not None:
                for b, pth in staged:
                    check(b, pth)
            fsync_all([p for _, p in staged + apart])
            # 4. everything checked and on disk: move in, all or none
            by_fp: dict[str, list[tuple[Block, Path]]] = {}
            for b, pth in apart:
                by_fp.setdefault(b.fingerprint.digest(), []).append((b, pth))
            for digest, items in by_fp.items():
                fstore = foreign_store(store, digest)
                try:
                    _adopt(fstore, items)
                finally:
                    fstore.close()
            added = _adopt(store, staged)
    except OSError as exc:
        raise disk_error(store, exc, f"importing {where}") from exc
    finally:
        if bar:
            bar.close()
    present += [b.id for b, _ in staged if b.id not in added]
    log.info("imported %s: %d added, %d present, %d kept apart, %d skipped", where, len(added),
             len(present), len(apart), len(skipped))
    return TransferReport(source=where, blocks=len(entries), added=added, present=present,
                          kept_apart=[b.id for b, _ in apart], skipped=skipped,
                          bytes=manifest.total_bytes, seconds=time.perf_counter() - t0,
                          signer=trust.signer, signer_trusted=trust.trusted)


def _check_versions(mbytes: bytes, where: str) -> None:
    """Name a version mismatch plainly, before the strict model would call it a parse error."""
    import json

    try:
        head = json.loads(mbytes)
    except ValueError as exc:
        raise BundleRejected(f"{where}: the bundle manifest is not JSON: {exc}") from exc
    if not isinstance(head, dict) or head.get("format") != "graftmem-bundle":
        raise BundleRejected(f"{where}: not a graftmem bundle manifest")
    from . import __version__

    for field, ours in (("bundle_version", BUNDLE_VERSION), ("block_format_version", FORMAT_VERSION)):
        theirs = head.get(field)
        if theirs != ours:
            raise BundleRejected(f"{where}: {field} is {theirs!r}, this graftmem ({__version__}) reads "
                                 f"{ours}; the bundle was written by graftmem "
                                 f"{head.get('graftmem_version', '?')}: use a matching version")


def _stub(e: BundleEntry, fp: Fingerprint) -> Block:
    """A manifest-only Block for error messages about an announced (not yet read) block."""
    return Block(id=e.id, name=e.name, kind=e.kind, text="", tokens=[], n_tokens=e.n_tokens,
                 fingerprint=fp, state_size=e.state_size, state_digest=e.state_digest)


def disk_error(store: Store, exc: OSError, doing: str) -> StoreError:
    """Our error for an OSError while staging or moving in (nothing reached the store)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"disk full while {doing} into {store.home}; nothing was imported: free "
                         "space and retry")
    return StoreError(f"{doing} into {store.home} failed: {exc}; nothing was imported")


def _adopt(store: Store, items: list[tuple[Block, Path]]) -> list[str]:
    if not items:
        return []
    try:
        return store.adopt(items)
    except OSError as exc:
        raise StoreError(f"cannot move verified blocks into {store.home}: {exc}; nothing was "
                         "imported") from exc


