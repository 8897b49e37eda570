"""Store: where blocks live and how they are read back, checked. The local directory store (the
default, embedded: files + a SQLite index + a lock), block chains resolved through it, and the whole
layout of a home (``blocks/``, ``index.sqlite``, staging, foreign areas) in one place.

Public for advanced use: [`Store`][graftmem.Store], `default_home()`, `load_state()` (read a block or a
chain into an engine buffer with every digest checked) and the chain helpers.
"""

from .chain import chain_of, full_state, full_tokens, load_state, segments
from .home import Home
from .local import Store, atomic_file, default_home, fsync_path, read_block_file

__all__ = ["Home", "Store", "atomic_file", "chain_of", "default_home", "fsync_path", "full_state", "full_tokens",
           "load_state", "read_block_file", "segments"]
