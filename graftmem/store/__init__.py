"""Store: where blocks live and how they are read back, checked. The local directory store (the
default, embedded: files + a SQLite index + a lock), block chains resolved through it, and the whole
layout of a home (``blocks/``, ``index.sqlite``, staging, foreign areas) in one place.

Public for advanced use: [`Store`][graftmem.Store], `default_home()`, `load_state()` (read a block or a
chain into an engine buffer with every digest checked) and the chain helpers. [`FleetStore`][graftmem.FleetStore] is the same interface over an S3-compatible bucket
with a local read-through cache (docs/fleet.md); `open_store()` picks one from ``s3://...`` or a path.
Both implement [`BlockStore`][graftmem.store.BlockStore], the protocol the layers above use: code that
takes a store should be typed against it, and ask ``store.remote`` rather than the class.
"""

from .chain import chain_of, full_state, full_tokens, load_state, segments
from .home import Home
from .protocol import BlockStore
from .fleet import FleetStore, default_cache_dir, open_store
from .hot import configure_hot_tier, hot_tier
from .local import Store, atomic_file, default_home, fsync_path, read_block_file
from .remote import RetryPolicy
from .scopes import ScopeIndex

__all__ = ["BlockStore", "FleetStore", "Home", "RetryPolicy", "ScopeIndex", "Store", "configure_hot_tier", "default_cache_dir", "open_store", "atomic_file", "chain_of", "default_home", "fsync_path", "full_state", "full_tokens",
           "hot_tier", "load_state", "read_block_file", "segments"]
