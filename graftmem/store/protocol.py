"""`BlockStore`: the one interface the layers above the store use, whatever holds the blocks.

Why a protocol: `Memory`, the features (learn, recall, router, pager), the sharing code, the server
and the CLI take "a store" and work the same over the local directory
([`Store`][graftmem.Store]) and the bucket with a local cache ([`FleetStore`][graftmem.FleetStore]).
Before this, they were typed ``Store | FleetStore`` (or ``Store`` alone, though a fleet store was
passed) and branched on ``isinstance(store, FleetStore)`` or ``getattr(store, "prefetch", None)``.
Now the difference is a capability each store states: ``remote`` (other workers share these blocks,
seen every ``poll_interval`` seconds) and verbs that a local store answers trivially (no other worker
to share files or routing vectors with, nothing to prefetch) rather than lacks.

The members are the ones the layers above actually call (a test derives nothing from this list; it
checks that both stores have every member with the same signature: `tests/test_store_protocol.py`).
A third store (say, over a network file system) implements these and is usable everywhere.
"""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Protocol, Sequence, runtime_checkable

from ..core.blocks import PROVENANCE_LOCAL

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..core.blocks import Block, Fingerprint, StoreStats
    from .home import Home

__all__ = ["BlockStore"]


@runtime_checkable
class BlockStore(Protocol):
    """Where blocks live and how they are read back, checked (see the module doc for why)."""

    #: the local directory beside the blocks: routing index, page index, scopes (a fleet store: its cache)
    home: Path
    #: every path under ``home`` (`graftmem.store.Home`)
    layout: Home
    #: True when mutations raise `StoreReadOnly` (a home that cannot be written)
    read_only: bool
    #: seconds a writer waits for another process's lock
    lock_timeout: float
    #: True when other workers share these blocks (a bucket): what they learn is seen at the next
    #: look, at most every ``poll_interval`` seconds, and ``put_file`` / ``list_files`` share files
    remote: bool
    #: seconds between two looks at other workers' changes (0 for a local store: SQLite sees them at once)
    poll_interval: float

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the index (and, for a fleet store, wait for the cache writes in progress)."""
        ...

    def lock(self) -> ContextManager[None]:
        """The lock that serializes this machine's writers (re-entrant in a thread)."""
        ...

    def reconcile(self) -> dict[str, int]:
        """Make the index agree with what is stored; counts of what changed."""
        ...

    # ------------------------------------------------------------------ reads
    def resolve(self, block_id: str) -> str:
        """The full id of an id or a unique prefix (at least 4 hex characters)."""
        ...

    def get(self, block_id: str) -> Block:
        """The block's manifest with this store's provenance; `BlockNotFound` if absent."""
        ...

    def contains(self, block_id: str) -> bool:
        """Whether a block with this full id is here."""
        ...

    def list(self, *, kind: str | None = None) -> list[Block]:
        """Every block (of ``kind``), oldest first."""
        ...

    def children(self, block_id: str) -> builtins.list[str]:
        """Ids of the blocks chained directly on ``block_id``."""
        ...

    def provenance(self, block_id: str) -> str:
        """What this store knows of where the block's state came from."""
        ...

    def stats(self) -> StoreStats:
        """Counts and sizes (from the index: no block file is read)."""
        ...

    def data_version(self) -> int:
        """Changes when another process or worker changed the blocks: the router's cue to re-sync."""
        ...

    def routing_rows(self, *, exclude_kinds: Sequence[str] = ()) -> builtins.list[tuple[str, str, str, str | None]]:
        """``(id, name, fingerprint digest, when_to_use)`` of the blocks that may steer routing."""
        ...

    def read_state(self, block_id: str, buffer: Callable[[int], memoryview], *,
                   fingerprint: Optional[Fingerprint] = None,
                   timings: Optional[dict[str, float]] = None) -> tuple[Block, memoryview]:
        """The block's state in ``buffer(n)``, every check passed before anything is returned."""
        ...

    def path_of(self, block_id: str) -> Path:
        """The block's file on this machine (a fleet store fetches and checks it first)."""
        ...

    def check_file(self, block_id: str) -> Block:
        """The manifest as the block's file holds it, with header, trailer and padding checked (the
        state is not read): what ``graftmem doctor`` asks of every block."""
        ...

    # ------------------------------------------------------------------ writes
    def put(self, block: Block, state: memoryview | bytes, *, replace: bool = False,
            provenance: str = PROVENANCE_LOCAL, labels_trusted: bool = True) -> Block:
        """Store a block (a block already here is returned as is unless ``replace``)."""
        ...

    def delete(self, block_id: str, *, cascade: bool = False) -> builtins.list[str]:
        """Delete a block (with ``cascade``, the blocks chained on it too); the ids deleted."""
        ...

    def adopt(self, files: builtins.list[tuple[Block, Path]]) -> builtins.list[str]:
        """Move verified, staged block files in (bundle import, pull); the ids added."""
        ...

    def set_manifest(self, block: Block) -> None:
        """Rewrite a block's manifest (labels, verification record); its id and state stay."""
        ...

    def set_provenance(self, block_id: str, provenance: str, *, labels_trusted: Optional[bool] = None) -> None:
        """Record what was proved about a block here."""
        ...

    # ------------------------------------------------------------------ sharing with other workers
    def prefetch(self, block_ids: builtins.list[str]) -> builtins.list[Future]:
        """Bring blocks likely asked next onto this machine in the background (a hint; nothing to do
        where every block is local)."""
        ...

    def get_vectors(self, space: str, names: builtins.list[str]) -> dict[str, Any]:
        """Routing rows other workers embedded, by name (none where there are no other workers)."""
        ...

    def put_vectors(self, space: str, rows: dict[str, Any]) -> None:
        """Share routing rows embedded here with the other workers (nothing to do without any)."""
        ...

    def put_file(self, name: str, path: Path) -> None:
        """Share a file with the other workers under a relative ``name`` (nothing to do without any)."""
        ...

    def list_files(self, prefix: str) -> builtins.list[dict[str, Any]]:
        """The files shared under ``prefix``: ``name``, ``size`` and ``e_tag`` each."""
        ...

    def get_file(self, name: str, dest: Path) -> bool:
        """Download a shared file to ``dest``; False if there is none."""
        ...
