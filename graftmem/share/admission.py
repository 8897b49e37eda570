"""The one admission path for blocks that come from elsewhere: a bundle file, a pull, a push.

Whatever carried the bytes, a foreign block enters a store the same way, in two steps:

1. `plan()`, before any block byte is read: the announced entries (a bundle manifest or
   a server listing) are held to the limits (size per block), each must name a fingerprint record that
   hashes to its key, every chained block must come with its ancestors (or find them in the store),
   and blocks of another engine are refused as a whole (``incompatible="refuse"``), kept apart under
   ``<home>/foreign/`` or skipped. The plan says which blocks' bytes to keep.
2. `admit()`, after every kept block has arrived and passed the streaming checker: the
   labels are bound to the content (positions always; the text must tokenize to the stored tokens
   when the caller's `Vetting` can tokenize), each new compatible block gets its provenance
   (``signed:<key>`` when a trusted key signed the manifest that pins it, ``rederived`` when the
   vetting re-prefilled it here and the state bytes are equal, else ``unverified``), all files are
   fsynced, then blocks of other engines move into their foreign stores and the rest into the store,
   all or none.

share never runs the engine: the checks that need it (tokenize, prefill) come in a `Vetting`
that [`Memory`][graftmem.Memory] builds. docs/security.md has the threat and the policy.

Keeping it in one place means a fix to this security-critical path is made once; the carriers
(`graftmem.share.bundle`, `graftmem.share.client`, the server's push route) only move bytes.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
import time
from typing import Callable, Literal, Mapping, Optional, Union

from ..core import statefmt as _statefmt
from ..core.blocks import PROVENANCE_REDERIVED, PROVENANCE_UNVERIFIED, Block, Fingerprint
from ..core.errors import BlockCorrupted, BundleRejected, ConfigError, IncompatibleBlock, StoreError, StoreFull
from ..core.format import state_digest
from ..core.progress import progress_bar
from ..store.chain import MAX_DEPTH, calls_of, chain_of, full_state, segments
from ..store.home import Home
from ..core.identity import incompatibility
from ..store.local import TEMP_MAX_AGE, Store, fsync_path, pid_alive, read_block_file
from ..store.protocol import BlockStore
from .manifest import BundleEntry
from .trust import TrustResult

__all__ = ["Admission", "AdmissionPlan", "BlockCheck", "Incompatible", "DEFAULT_MAX_ENTRY_BYTES",
           "Staging", "Vetting", "foreign_store", "fsync_all", "disk_error"]

log = logging.getLogger("graftmem")

Incompatible = Literal["refuse", "keep-apart", "skip"]


@dataclass(frozen=True)
class Vetting:
    """The engine's checks of foreign blocks, built by ``Memory`` (share never imports the engine).

    ``tokenize(block)`` returns the token ids the block's text has in this engine (the same call
    ``learn`` makes): a text that does not give the stored tokens is a spoofed label and the transfer
    is refused. ``rederive(block, full_state, segments)`` re-prefills ``segments`` (the token ids of
    every block of the chain, root first, each in its own call) and raises [`BlockCorrupted`][graftmem.BlockCorrupted]
    unless the captured state equals ``full_state`` byte for byte; None means "land unverified"
    (the caller opted out). ``progress`` shows a bar over the tokens re-prefilled.
    """

    tokenize: Optional[Callable[[Block], list[int]]] = None
    rederive: Optional[Callable[[Block, memoryview, list[list[int]]], None]] = None
    progress: bool = False


#: check(block, staged_path) on every new compatible block, after its bytes are checked and before
#: anything is moved in; it raises to refuse the whole transfer and may return the provenance it
#: proved (``"rederived"``); None lands the block ``unverified``. A `Vetting` is the
#: engine-backed check Memory passes (chains, label binding and provenance handled by the admission).
BlockCheck = Union[Vetting, Callable[[Block, Path], Optional[str]]]
#: Largest block file accepted in a bundle or a download unless the caller says otherwise (4 GiB:
#: a 128k-token state of a small model; raise it for bigger models).
DEFAULT_MAX_ENTRY_BYTES = 4 << 30


class Staging:
    """A private directory inside the store home (same filesystem, so moves are renames), removed on
    exit; directories left by dead processes are removed the next time one is made."""

    def __init__(self, home: Path) -> None:
        root = Home(home).staging
        root.mkdir(parents=True, exist_ok=True)
        for old in root.iterdir():
            try:
                pid = int(old.name.split("-")[0])
            except ValueError:
                pid = -1
            try:  # by age too: a pid can be reused, a name can be junk
                old_age = time.time() - old.lstat().st_mtime
            except OSError:
                continue
            if old_age > TEMP_MAX_AGE or (pid > 0 and pid != os.getpid() and not pid_alive(pid)):
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
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
    with ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:
        list(pool.map(fsync_path, paths))


def foreign_store(store: BlockStore, fp_digest: str) -> Store:
    """The store that keeps blocks of another fingerprint apart: ``<home>/foreign/<digest[:16]>``.
    The main store never indexes it, so its blocks can never be grafted here; export it from there to
    a machine whose engine matches."""
    return Store(store.layout.foreign(fp_digest), lock_timeout=store.lock_timeout)


def disk_error(store: BlockStore, exc: OSError, doing: str) -> StoreError:
    """Our error for an OSError while staging or moving in (nothing reached the store)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"disk full while {doing} into {store.home}; nothing was imported: free "
                         "space and retry")
    return StoreError(f"{doing} into {store.home} failed: {exc}; nothing was imported")


def stub_block(e: BundleEntry, fp: Fingerprint) -> Block:
    """A manifest-only Block for error messages about an announced (not yet read) block."""
    return Block(id=e.id, name=e.name, kind=e.kind, text="", tokens=[], n_tokens=e.n_tokens,
                 fingerprint=fp, state_size=e.state_size, state_digest=e.state_digest)


def _adopt(store: BlockStore, items: list[tuple[Block, Path]]) -> list[str]:
    if not items:
        return []
    try:
        return store.adopt(items)
    except OSError as exc:
        raise StoreError(f"cannot move verified blocks into {store.home}: {exc}; nothing was "
                         "imported") from exc


@dataclass
class AdmissionPlan:
    """What `plan()` decided for the announced entries."""

    entries: list[BundleEntry]                             # selected + ancestors, parents first
    foreign: set[str] = field(default_factory=set)         # made by another engine
    skipped: list[str] = field(default_factory=list)       # foreign, left out (incompatible="skip")
    present: list[str] = field(default_factory=list)       # compatible and already in the store

    def keep(self, block_id: str) -> bool:
        """Whether this block's bytes must be kept (not skipped, not already stored)."""
        return block_id not in self.skipped and block_id not in self.present

    @property
    def todo(self) -> list[BundleEntry]:
        return [e for e in self.entries if self.keep(e.id)]


class Admission:
    """The admission of foreign blocks into ``store`` for an engine with ``fingerprint``.

    ``where`` names the source in every message (a bundle path, a URL). ``check`` is the optional
    extra check of `BlockCheck`.
    """

    def __init__(self, store: BlockStore, fingerprint: Fingerprint, *, where: str,
                 incompatible: Incompatible = "refuse", max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                 check: Optional[BlockCheck] = None) -> None:
        if not isinstance(max_entry_bytes, int) or isinstance(max_entry_bytes, bool) or max_entry_bytes < 1:
            raise ConfigError(f"max_entry_bytes={max_entry_bytes!r}: give a positive number of bytes")
        if incompatible not in ("refuse", "keep-apart", "skip"):
            raise ConfigError(f"incompatible={incompatible!r}: use 'refuse', 'keep-apart' or 'skip'")
        self.store = store
        self.fingerprint = fingerprint
        self.where = where
        self.incompatible = incompatible
        self.max_entry_bytes = max_entry_bytes
        self.check = check

    # ------------------------------------------------------------------ 1. before any byte
    def plan(self, selected: list[BundleEntry], fingerprints: Mapping[str, Fingerprint],
             available: Optional[Mapping[str, BundleEntry]] = None) -> AdmissionPlan:
        """Check what is announced and decide what to keep. ``available`` is everything the source
        offers (a server's listing), from which the ancestors of ``selected`` are added; by default
        the selection itself (a bundle must carry the ancestors the store lacks)."""
        where = self.where
        for digest, fp in fingerprints.items():
            if fp.digest() != digest:
                raise BundleRejected(f"{where}: fingerprint {digest[:12]} does not hash to its key")
        seen: set[str] = set()
        for e in selected:
            if e.id in seen:
                raise BundleRejected(f"{where}: block {e.id[:12]} is listed twice")
            seen.add(e.id)
        pool = dict(available) if available is not None else {e.id: e for e in selected}
        entries = self._with_ancestors(selected, pool)
        for e in entries:
            if e.file_size > self.max_entry_bytes:
                raise BundleRejected(f"{where}: block {e.id[:12]} is {e.file_size} bytes, over the "
                                     f"{self.max_entry_bytes}-byte limit (pass max_entry_bytes to allow it)")
            if e.fingerprint not in fingerprints:
                raise BundleRejected(f"{where}: block {e.id[:12]} names a fingerprint the manifest lacks")
        local = self.fingerprint.digest()
        plan = AdmissionPlan(entries=entries, foreign={e.id for e in entries if e.fingerprint != local})
        if plan.foreign and self.incompatible == "refuse":
            e = next(x for x in entries if x.id in plan.foreign)
            err = incompatibility(stub_block(e, fingerprints[e.fingerprint]), self.fingerprint)
            raise IncompatibleBlock(f"{where}: {len(plan.foreign)} of {len(entries)} blocks were made by "
                                    f"another engine; {err}. Nothing was imported; keep them apart or skip them (CLI: "
                                    "--incompatible keep-apart / skip; Python: incompatible='keep-apart' / "
                                    "'skip')", fields=err.fields if err else {})
        if self.incompatible == "skip":
            plan.skipped = [e.id for e in entries if e.id in plan.foreign]
        # a block already here counts as present unless it is unverified: then its bytes are fetched
        # again and, if this transfer proves them, they replace it (provenance only goes up)
        plan.present = [e.id for e in entries if e.id not in plan.foreign and self.store.contains(e.id)
                        and self.store.provenance(e.id) != PROVENANCE_UNVERIFIED]
        return plan

    def _with_ancestors(self, selected: list[BundleEntry], pool: Mapping[str, BundleEntry]) -> list[BundleEntry]:
        out: dict[str, BundleEntry] = {}

        def add(e: BundleEntry) -> None:
            if e.id in out:
                return
            if e.parent is not None and not self.store.contains(e.parent):
                if e.parent not in pool:
                    raise BundleRejected(f"{self.where}: block {e.id[:12]} continues block {e.parent[:12]}, "
                                         "which is neither in the bundle nor in this store; export it "
                                         "with its parent")
                add(pool[e.parent])
            out[e.id] = e

        for e in selected:
            add(e)
        return list(out.values())

    # ------------------------------------------------------------------ 2. after every byte checked
    def _parent_of(self, b: Block, staged: Mapping[str, Block]) -> Block:
        if b.parent is not None and b.parent in staged:
            return staged[b.parent]
        try:
            return self.store.get(b.parent)  # type: ignore[arg-type]
        except StoreError as exc:
            raise BundleRejected(f"{self.where}: block {b.short_id} continues {str(b.parent)[:12]}, which "
                                 "arrived neither with it nor is in this store") from exc

    def bind_labels(self, arrived: list[tuple[Block, Path]]) -> None:
        """Labels bound to content, before anything is moved in: a root starts at position 0, a child
        where its parent ends, and (when a tokenizer was given) the text is exactly what gives the
        stored tokens. Raises [`BundleRejected`][graftmem.BundleRejected] naming the block; nothing is moved in."""
        staged = {b.id: b for b, _ in arrived}
        for b, p in arrived:
            try:
                self._bind_one(b, staged)
            except BundleRejected:
                p.unlink(missing_ok=True)  # intact bytes, refused content: not kept to resume
                raise

    def _bind_one(self, b: Block, staged: Mapping[str, Block]) -> None:
        tokenize = self.check.tokenize if isinstance(self.check, Vetting) else None
        local = self.fingerprint.digest()
        if b.parent is None:
            if b.pos_start != 0:
                raise BundleRejected(f"{self.where}: root block {b.short_id} ({b.name!r}) claims to start at "
                                     f"position {b.pos_start}; a root starts at 0: refusing the transfer")
        else:
            parent = self._parent_of(b, staged)
            if b.pos_start != parent.pos_end:
                raise BundleRejected(f"{self.where}: block {b.short_id} ({b.name!r}) claims to start at "
                                     f"position {b.pos_start}, its parent {parent.short_id} ends at "
                                     f"{parent.pos_end}: refusing the transfer")
        if tokenize is not None and b.fingerprint.digest() == local:
            got = tokenize(b)
            if list(got) != list(b.tokens):
                first = next((i for i, (x, y) in enumerate(zip(got, b.tokens)) if x != y),
                             min(len(got), len(b.tokens)))
                raise BundleRejected(
                    f"{self.where}: block {b.short_id} ({b.name!r}): its text does not tokenize to its "
                    f"{b.n_tokens} stored tokens (they differ from token {first}): the text is a label "
                    "that does not belong to the state; refusing the transfer")

    def _full_states(self, mine: list[tuple[Block, Path]]):
        """Yield ``(block, path, full state, segments)`` for each block, parents first; a staged child's
        delta is merged with its parent's full state (staged here or read from the store) and checked
        against its ``full_state_digest``. Parents' states are kept only while a child needs them."""
        staged = {b.id: b for b, _ in mine}
        need = {b.parent for b, _ in mine if b.parent in staged}
        fulls: dict[str, bytes] = {}
        segs_of: dict[str, list[list[int]]] = {}
        depth_of: dict[str, int] = {}  # blocks in the chain (its segments are its prefill calls: more)
        for b, p in mine:
            _, view = read_block_file(p, lambda n: memoryview(bytearray(n)), expect_id=b.id)
            if b.parent is None:
                full: bytes | memoryview = view
                segs, depth = calls_of(b), 1
            else:
                if b.parent in staged:
                    pfull, psegs, pdepth = fulls[b.parent], segs_of[b.parent], depth_of[b.parent]
                else:
                    parent = self.store.get(b.parent)
                    pfull, psegs = full_state(self.store, parent), segments(self.store, parent)
                    pdepth = len(chain_of(self.store, parent))
                depth = pdepth + 1
                if pdepth >= MAX_DEPTH:
                    raise BundleRejected(f"{self.where}: block {b.short_id} is chained more than {MAX_DEPTH} deep")
                segs = psegs + calls_of(b)
                if b.storage == "full":
                    full = view
                else:
                    if b.full_state_digest is None or b.full_state_size is None:
                        raise BlockCorrupted(f"{self.where}: block {b.short_id} is a delta without a full digest",
                                             path=str(p))
                    try:
                        full = _statefmt.merge(pfull, view)
                    except _statefmt.StateLayoutError as exc:
                        raise BlockCorrupted(f"{self.where}: block {b.short_id}: its delta does not merge "
                                             f"with its parent: {exc}", path=str(p)) from exc
                    if state_digest(full) != b.full_state_digest:
                        raise BlockCorrupted(f"{self.where}: block {b.short_id}: rebuilt state digest "
                                             "mismatch", path=str(p))
            if b.id in need:
                fulls[b.id], segs_of[b.id], depth_of[b.id] = bytes(full), segs, depth
            yield b, p, memoryview(full), segs

    def vet(self, arrived: list[tuple[Block, Path]], trust: Optional[TrustResult]) -> list[tuple[Block, Path]]:
        """Bind the labels, then give each block of this engine its provenance (see the module doc);
        raises to refuse the whole transfer. Returns ``arrived`` with ``provenance`` and
        ``labels_trusted`` set on each block."""
        self.bind_labels(arrived)
        local = self.fingerprint.digest()
        signed = trust is not None and trust.trusted and trust.signer is not None
        out: dict[str, Block] = {}
        for b, _ in arrived:  # defaults: other engines' blocks, and this engine's before a proof
            out[b.id] = b.model_copy(update={"provenance": f"signed:{trust.signer}" if signed  # type: ignore[union-attr]
                                             else PROVENANCE_UNVERIFIED, "labels_trusted": signed})
        mine = [(b, p) for b, p in arrived if b.fingerprint.digest() == local]
        check = self.check
        if signed or check is None or not mine:
            return [(out[b.id], p) for b, p in arrived]
        if isinstance(check, Vetting):
            if check.rederive is not None:
                bar = progress_bar(sum(b.pos_end for b, _ in mine), "re-derive", check.progress)
                try:
                    for b, p, full, segs in self._full_states(mine):
                        try:
                            check.rederive(b, full, segs)
                        except BlockCorrupted:
                            p.unlink(missing_ok=True)  # its bytes arrived intact but are not what they claim
                            raise
                        out[b.id] = out[b.id].model_copy(update={"provenance": PROVENANCE_REDERIVED})
                        if bar:
                            bar.update(b.pos_end)
                finally:
                    if bar:
                        bar.close()
        else:
            for b, p in mine:
                try:
                    proved = check(b, p)
                except BlockCorrupted:
                    p.unlink(missing_ok=True)
                    raise
                if isinstance(proved, str):
                    out[b.id] = out[b.id].model_copy(update={"provenance": proved})
        return [(out[b.id], p) for b, p in arrived]

    def admit(self, plan: AdmissionPlan, arrived: list[tuple[Block, Path]], *,
              trust: Optional[TrustResult] = None) -> tuple[list[str], list[str], list[str]]:
        """Vet (`vet()`) and move the checked files in, all or none; returns (added, present,
        kept_apart) ids. ``trust`` is what the trust policy said of the manifest or listing that pinned
        these blocks (a trusted signer makes them ``signed:<key>`` without a re-derivation).

        ``arrived`` holds every kept block of ``plan`` with the path of its checked file, on the
        store's filesystem (staging or ``.incoming``), which the move consumes.
        """
        order = {e.id: i for i, e in enumerate(plan.entries)}
        arrived = sorted(arrived, key=lambda bp: order.get(bp[0].id, len(order)))  # parents first
        arrived = self.vet(arrived, trust)
        local = self.fingerprint.digest()
        mine = [(b, p) for b, p in arrived if b.fingerprint.digest() == local]
        apart = [(b, p) for b, p in arrived if b.fingerprint.digest() != local]
        try:
            fsync_all([p for _, p in arrived])
            for digest in sorted({b.fingerprint.digest() for b, _ in apart}):
                fstore = foreign_store(self.store, digest)
                try:
                    _adopt(fstore, [(b, p) for b, p in apart if b.fingerprint.digest() == digest])
                finally:
                    fstore.close()
            added = _adopt(self.store, mine)
        except OSError as exc:
            raise disk_error(self.store, exc, f"importing {self.where}") from exc
        present = plan.present + [b.id for b, _ in mine if b.id not in added]
        return added, present, [b.id for b, _ in apart]
