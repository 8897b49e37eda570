"""Garbage collection of a fleet's bucket: what no marker names any more, once old enough.

Why a grace period and not at delete time: a reader that listed a block before its delete fetches
its block object afterwards, and must find it whole; a worker killed between its block object and its
marker leaves an object no marker names, which a slow upload in progress looks like too.
"""

from __future__ import annotations

import time

from ..home import BLOCK_SUFFIX
from ..remote import Bucket
from .layout import BLOCKS, INDEX, TOMBSTONES, UPLOADS, block_key, id_of, tomb_key
from .sightings import LEASES, SIGHTINGS

__all__ = ["collect_garbage", "DEFAULT_GRACE"]

#: A tombstoned or unlisted block object older than this is removed by `FleetStore.collect_garbage`.
DEFAULT_GRACE = 3600.0


def collect_garbage(bucket: Bucket, *, grace: float = DEFAULT_GRACE) -> dict[str, int]:
    """Remove block objects without a marker (deleted, or left by a worker killed between its
    block and its marker), tombstones whose marker is gone and large uploads left in ``uploads/`` by
    a worker killed before their copy, and prompt-prefix sightings and learn leases, once older than
    ``grace`` seconds. Safe while workers run: a
    reader that listed a block before its delete has ``grace`` seconds to fetch it."""
    now = time.time()
    markers = {bid for o in bucket.list(INDEX) if (bid := id_of(o["path"], INDEX, ".json"))}
    removed = tombs = 0
    for o in bucket.list(BLOCKS):
        bid = id_of(o["path"], BLOCKS, BLOCK_SUFFIX)
        if bid and bid not in markers and now - o["last_modified"].timestamp() > grace:
            bucket.delete(block_key(bid))
            removed += 1
    for o in bucket.list(TOMBSTONES):
        bid = id_of(o["path"], TOMBSTONES)
        if bid and bid not in markers and now - o["last_modified"].timestamp() > grace:
            bucket.delete(tomb_key(bid))
            tombs += 1
    uploads = 0
    for o in bucket.list(UPLOADS):
        if now - o["last_modified"].timestamp() > grace:
            bucket.delete(f"{UPLOADS}/" + o["path"].rsplit("/", 1)[-1])
            uploads += 1
    # prompt-prefix sightings and learn leases (`graftmem.store.fleet.sightings`): a prefix not learned
    # within ``grace`` is counted afresh, a lease that old has long been overtaken or fulfilled
    counts = 0
    for folder in (SIGHTINGS, LEASES):
        for o in bucket.list(folder):
            if now - o["last_modified"].timestamp() > grace:
                parts = o["path"].split("/")  # the key under the URL's prefix: sightings/<key>/<n>, leases/<key>
                bucket.delete("/".join([folder, *parts[-2 if folder == SIGHTINGS else -1:]]))
                counts += 1
    return {"blocks_removed": removed, "tombstones_removed": tombs, "uploads_removed": uploads,
            "sightings_removed": counts}
