"""The fleet store: one memory in an S3-compatible bucket, shared by many workers, each with a local
read-through cache. Same interface as the local [`Store`][graftmem.Store]; selected with
``Memory(store="s3://bucket/prefix")``, ``GRAFTMEM_STORE=s3://...`` or the CLI's ``--store``.

Bucket layout (keys under the URL's prefix)::

    blocks/<id[:2]>/<id>.gmb   the block file, the same bytes as a local one (self-verifying: header,
                               manifest with the id and the state's BLAKE3 digest, trailer); written
                               ONCE (If-None-Match: *; above 256 MiB: a look first, then a multipart
                               upload under uploads/ and a server-side copy completed with
                               If-None-Match: *, so of two racing workers one writes)
    index/<id>.json            the marker: manifest, provenance, labels_trusted, file size. Written
                               after the block file, so a listing of index/ shows complete blocks only
                               (a worker killed mid-upload leaves at most an unlisted block object)
    tombstones/<id>            a delete: the block is gone for every reader that lists after it; the
                               block object stays until `collect_garbage` (after a grace period), so a
                               reader that listed before the delete still gets whole, checked bytes

The routing data is in the bucket too: a marker carries the manifest, whose ``metadata`` holds the
block's text and ``when_to_use``, so a new worker routes over every block after one listing (its
embedder embeds them locally, once; the router index is cached beside the block cache).

What is consistent when: a worker's own writes are visible to it at once; another worker's learn or
delete is seen at the next listing, which runs when ``poll_interval`` seconds (default 2) have passed
since the last one and something asks (list, route, stats), or at once when a block id is asked
for that this worker does not know. S3 (since 2020), MinIO, R2 and SeaweedFS list a completed PUT
immediately (strong read-after-write), so the delay is the poll interval.

The cache is a local `Store` under the platform cache dir (``platformdirs.user_cache_dir``, one
directory per bucket URL) capped at ``cache_bytes`` with LRU eviction: a block is fetched once,
checked on arrival (header, trailer, manifest id, fingerprint, BLAKE3 of the state, the local store's
checks) before it is grafted or enters the cache, and checked again on every graft as today. A
corrupted or swapped object raises [`BlockCorrupted`][graftmem.BlockCorrupted] and never enters the
cache; a bucket that is down or slow raises [`TransferError`][graftmem.TransferError] after bounded
retries with back-off, and the cache is left as it was.

Trust: whoever can write the bucket is trusted like whoever can write a local home: the marker's
provenance (``local`` for a block a worker prefilled itself) is taken as it is. Bundles, pulls and
signatures (docs/security.md) are how blocks from outside the fleet come in.

Where each idea lives (one room each; `FleetStore` composes them): `layout` (every key of the bucket
and the marker's format), `index` (the local SQLite mirror of the markers, the listing, the LRU use
times), `cache` (the read-through cache: download into memory, checks, write-behind, prefetch,
eviction), `writes` (uploads, markers, tombstones, deletes, `upload_store`), `shared` (routing rows and
files shared beside the blocks), `gc` (`collect_garbage`) and `store` (`FleetStore`, `open_store`).
"""

from .gc import DEFAULT_GRACE
from .store import DEFAULT_CACHE_BYTES, DEFAULT_POLL_INTERVAL, FleetStore, default_cache_dir, is_remote, open_store

__all__ = ["FleetStore", "default_cache_dir", "open_store", "is_remote", "DEFAULT_CACHE_BYTES", "DEFAULT_POLL_INTERVAL",
           "DEFAULT_GRACE"]
