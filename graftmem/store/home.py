"""The layout of a graftmem home, in one place: every path any layer reads or writes under a home.

::

    blocks/<id[:2]>/<id>.gmb     block files (see graftmem.core.format), content-addressed, immutable
    index.sqlite                 the block index (SQLite, WAL): one row per block with its manifest
    scopes.sqlite                who a block belongs to (user / agent / session) and its history
    lock                         an flock(2) file that serializes mutations across processes
    router/index.npz             the routing index (embeddings of each block's route text)
    pages/index.sqlite           documents, pages and passage vectors of long documents
    trust.json                   the trust policy (required signatures, trusted keys)
    .staging/<pid>-<rand>/       private staging of an import or push (same filesystem: moves are renames)
    .incoming/<id>.<etag>.part   downloads of a pull, kept across interruptions to resume them
    foreign/<digest[:16]>/       a store of blocks of another engine fingerprint, never grafted here
    quarantine/                  entries under blocks/ the store could not read (junk, FIFOs, links,
                                 damaged unindexed files), moved aside on open with a log line

A feature asks `Home` for a path instead of joining strings, so that the layout is read in one
file and an object-storage store can map the same names to keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["Home", "BLOCK_SUFFIX"]

BLOCK_SUFFIX = ".gmb"


@dataclass(frozen=True)
class Home:
    """The paths of the home at ``root``. Nothing is created here; the owners create what they use."""

    root: Path

    @property
    def blocks(self) -> Path:
        return self.root / "blocks"

    def block(self, block_id: str) -> Path:
        return self.blocks / block_id[:2] / f"{block_id}{BLOCK_SUFFIX}"

    @property
    def index(self) -> Path:
        return self.root / "index.sqlite"

    @property
    def scopes(self) -> Path:
        return self.root / "scopes.sqlite"

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    @property
    def router_index(self) -> Path:
        return self.root / "router" / "index.npz"

    @property
    def pages_index(self) -> Path:
        return self.root / "pages" / "index.sqlite"

    @property
    def trust_policy(self) -> Path:
        return self.root / "trust.json"

    @property
    def staging(self) -> Path:
        return self.root / ".staging"

    @property
    def incoming(self) -> Path:
        return self.root / ".incoming"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def foreign(self, fp_digest: str) -> Path:
        return self.root / "foreign" / fp_digest[:16]
