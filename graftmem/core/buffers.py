"""Fresh buffers for block states: writable, not zeroed, on huge pages where the kernel allows.

Why not ``bytearray(n)``: a new 69 MB bytearray (a 3,000-token SmolLM2 state) is zeroed page by page,
4 KiB at a time: every page faults in, then is written again by the copy that fills it. numpy's
allocator asks the kernel for transparent huge pages on large blocks (``madvise``, the default
``transparent_hugepage`` mode of common distributions), so the same buffer faults in 2 MiB at a time and
is never zeroed: measured on the 2-core dev VM (loaded), allocating and filling 69 MB took 138 ms as a
bytearray and 23 ms this way. The server allocates one per answer (`Engine.capture_copy`, the prefix
states it learns), on the engine's thread, between one turn and the next.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fresh"]


def fresh(n: int) -> memoryview:
    """A writable ``n``-byte buffer (format ``B``), contents undefined: the caller writes all of it."""
    return np.empty(n, dtype=np.uint8).data
