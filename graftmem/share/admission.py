"""The one admission path for blocks that come from elsewhere: a bundle file, a pull, a push.

Whatever carried the bytes, a foreign block enters a store the same way, in two steps:

1. :meth:`Admission.plan`, before any block byte is read: the announced entries (a bundle manifest or
   a server listing) are held to the limits (size per block), each must name a fingerprint record that
   hashes to its key, every chained block must come with its ancestors (or find them in the store),
   and blocks of another engine are refused as a whole (``incompatible="refuse"``), kept apart under
   ``<home>/foreign/`` or skipped. The plan says which blocks' bytes to keep.
2. :meth:`Admission.admit`, after every kept block has arrived and passed the streaming checker: the
   caller's extra ``check`` (re-derivation) runs on each new compatible block, all files are fsynced,
   then blocks of other engines move into their foreign stores and the rest into the store, all or none.

Keeping it in one place means a fix to this security-critical path is made once; the carriers
(:mod:`graftmem.share.bundle`, :mod:`graftmem.share.client`, the server's push route) only move bytes.
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
from typing import Callable, Literal, Mapping, Optional

from ..core.blocks import Block, Fingerprint
from ..core.errors import BlockCorrupted, BundleRejected, ConfigError, IncompatibleBlock, StoreError, StoreFull
from ..store.home import Home
from ..store.local import Store, fsync_path, incompatibility, pid_alive
from .manifest import BundleEntry

__all__ = ["Admission", "AdmissionPlan", "BlockCheck", "Incompatible", "DEFAULT_MAX_ENTRY_BYTES",
           "Staging", "foreign_store", "fsync_all", "disk_error"]

log = logging.getLogger("graftmem")

Incompatible = Literal["refuse", "keep-apart", "skip"]
#: check(block, staged_path) on every new compatible block, after its bytes are checked and before
#: anything is moved in; it raises to refuse the whole transfer (e.g. a re-derivation)
BlockCheck = Callable[[Block, Path], None]
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
    with ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:
        list(pool.map(fsync_path, paths))


def foreign_store(store: Store, fp_digest: str) -> Store:
    """The store that keeps blocks of another fingerprint apart: ``<home>/foreign/<digest[:16]>``.
    The main store never indexes it, so its blocks can never be grafted here; export it from there to
    a machine whose engine matches."""
    return Store(store.layout.foreign(fp_digest), lock_timeout=store.lock_timeout)


def disk_error(store: Store, exc: OSError, doing: str) -> StoreError:
    """Our error for an OSError while staging or moving in (nothing reached the store)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"disk full while {doing} into {store.home}; nothing was imported: free "
                         "space and retry")
    return StoreError(f"{doing} into {store.home} failed: {exc}; nothing was imported")


def stub_block(e: BundleEntry, fp: Fingerprint) -> Block:
    """A manifest-only Block for error messages about an announced (not yet read) block."""
    return Block(id=e.id, name=e.name, kind=e.kind, text="", tokens=[], n_tokens=e.n_tokens,
                 fingerprint=fp, state_size=e.state_size, state_digest=e.state_digest)


def _adopt(store: Store, items: list[tuple[Block, Path]]) -> list[str]:
    if not items:
        return []
    try:
        return store.adopt(items)
    except OSError as exc:
        raise StoreError(f"cannot move verified blocks into {store.home}: {exc}; nothing was "
                         "imported") from exc


@dataclass
class AdmissionPlan:
    """What :meth:`Admission.plan` decided for the announced entries."""

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
    extra check of :data:`BlockCheck`.
    """

    def __init__(self, store: Store, fingerprint: Fingerprint, *, where: str,
                 incompatible: Incompatible = "refuse", max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                 check: Optional[BlockCheck] = None) -> None:
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
                                    f"another engine; {err}. Nothing was imported; pass "
                                    "incompatible='keep-apart' (CLI: --incompatible keep-apart) to keep "
                                    "them apart, or 'skip'", fields=err.fields if err else {})
        if self.incompatible == "skip":
            plan.skipped = [e.id for e in entries if e.id in plan.foreign]
        plan.present = [e.id for e in entries
                        if e.id not in plan.foreign and self.store.contains(e.id)]
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
    def admit(self, plan: AdmissionPlan, arrived: list[tuple[Block, Path]]) -> tuple[list[str], list[str], list[str]]:
        """Move the checked files in, all or none; returns (added, present, kept_apart) ids.

        ``arrived`` holds every kept block of ``plan`` with the path of its checked file, on the
        store's filesystem (staging or ``.incoming``), which the move consumes.
        """
        local = self.fingerprint.digest()
        mine = [(b, p) for b, p in arrived if b.fingerprint.digest() == local]
        apart = [(b, p) for b, p in arrived if b.fingerprint.digest() != local]
        if self.check is not None:
            for b, p in mine:
                try:
                    self.check(b, p)
                except BlockCorrupted:
                    p.unlink(missing_ok=True)  # its bytes arrived intact but are not what they claim
                    raise
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
