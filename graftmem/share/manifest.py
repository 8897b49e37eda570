"""What a bundle or a served listing announces, and the streaming check of each block against it.

`BundleManifest` lists blocks by id, file size and digests (`BundleEntry`);
`BlockChecker` hashes a block file's bytes as they stream past (from a tar member, an HTTP body,
a resumed part file) and refuses the first one that disagrees with the header, the trailer or the entry.
Every carrier (bundle files, pull, push, the server's listing) uses these, so a block is checked one
way whatever brought it.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from typing import Callable, Final, Iterable, Literal, Optional

import blake3
from pydantic import BaseModel, ConfigDict, Field

from ..core.blocks import FORMAT_VERSION, Block, Fingerprint
from ..core.errors import BlockCorrupted, BlockNotFound, StoreError
from ..core.format import HEADER, TRAILER_LEN, parse_header, parse_manifest
from ..core.identity import id_problem
from ..core.version import __version__
from ..store.protocol import BlockStore

__all__ = ["BundleEntry", "BundleManifest", "BlockChecker", "ExportReport", "TransferReport", "entry_for",
           "listing", "select", "MANIFEST_NAME", "SIGNATURE_NAME", "BUNDLE_VERSION", "SIGN_DOMAIN",
           "MAX_MANIFEST_BYTES", "CHUNK"]

log = logging.getLogger("graftmem")

MANIFEST_NAME = "graftmem-bundle.json"
SIGNATURE_NAME = "graftmem-bundle.sig"
BUNDLE_VERSION: Final = 1
SIGN_DOMAIN = "bundle-manifest-v1"
#: Largest bundle manifest or signature member (the manifest lists ids and digests, not texts).
MAX_MANIFEST_BYTES = 16 << 20
#: Largest block manifest inside a block file (it holds the text and the token ids).
MAX_BLOCK_MANIFEST_BYTES = 64 << 20
CHUNK = 4 << 20



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
    return __version__


# ---------------------------------------------------------------------------------------- checking
class BlockChecker:
    """Check one block file as its bytes stream past, in order, holding only header and manifest.

    ``feed`` the bytes as they arrive (from a tar member, a socket, a file being exported); ``finish``
    then checks the trailer over header+manifest, the state digest, the content id (recomputed from
    fingerprint, parent, tokens and the block's recorded salts: `graftmem.core.identity`) and, if an `BundleEntry` was announced, that every announced field
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

    def feed(self, data: bytes | bytearray | memoryview) -> None:
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
        why = id_problem(block)  # fingerprint, parent, tokens and the salts the block records
        if why is not None:
            raise self._corrupt(why)
        e = self.expect
        if e is not None:
            mdig = "blake3:" + bytes(self._trailer).hex()
            checks = {"id": (e.id, block.id), "state_digest": (e.state_digest, block.state_digest),
                      "manifest_digest": (e.manifest_digest, mdig),
                      "fingerprint": (e.fingerprint, block.fingerprint.digest()),
                      "parent": (e.parent, block.parent), "name": (e.name, block.name),
                      "kind": (e.kind, block.kind), "n_tokens": (e.n_tokens, block.n_tokens)}
            for field, (want, got) in checks.items():
                if want != got:
                    raise self._corrupt(f"{field} mismatch: the bundle/listing announced {str(want)[:80]!r}, "
                                        f"the block has {str(got)[:80]!r}", expected=str(want), actual=str(got))
        return block


def entry_for(store: BlockStore, block: Block) -> BundleEntry:
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


def select(store: BlockStore, block_ids: Optional[Iterable[str]] = None, *, kind: Optional[str] = None,
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


def listing(store: BlockStore, blocks: list[Block]) -> BundleManifest:
    return BundleManifest(graftmem_version=_version(),
                          fingerprints={b.fingerprint.digest(): b.fingerprint for b in blocks},
                          blocks=[entry_for(store, b) for b in blocks])
