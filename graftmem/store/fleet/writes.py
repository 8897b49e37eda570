"""The fleet store's writes: a block file goes up once (create-only), then its marker, which is what
makes the block exist for every worker; a delete is a tombstone, then the marker's removal.

Why in that order: a listing of ``index/`` then shows complete blocks only (a worker killed
mid-upload leaves at most an unlisted block object, removed by `collect_garbage`), and a reader
that listed a block before its delete still finds its block object, whole and checked.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Optional

from ...core.blocks import PROVENANCE_UNVERIFIED, Block
from ...core.errors import BlockCorrupted, StoreError
from ...core.format import HEADER, TRAILER_LEN, parse_header, parse_manifest
from ..local import deletion_order
from ..protocol import BlockStore
from ..remote import Bucket
from .cache import ReadCache
from .index import BucketIndex
from .layout import block_key, marker, marker_key, tomb_key, upload_key

__all__ = ["BucketWriter"]

log = logging.getLogger("graftmem")


class BucketWriter:
    """Uploads, marker rewrites and deletes of one bucket, kept in step with its ``index`` and ``cache``."""

    def __init__(self, bucket: Bucket, index: BucketIndex, cache: ReadCache, *, url: str,
                 counters: dict[str, int]) -> None:
        self.bucket, self.index, self.cache, self.url, self.counters = bucket, index, cache, url, counters

    def upload(self, block: Block, path: Path, provenance: str, labels_trusted: bool, *, replace: bool) -> None:
        """Block file first (create-once), then its marker, then clear a tombstone of an earlier delete."""
        size = path.stat().st_size
        key = block_key(block.id)
        if size > self.bucket.multipart_above:
            # in parts under a staging key, then a conditional server-side copy (Bucket.put_large_once):
            # of two workers racing here exactly one writes; a look first skips the upload when it is there
            tag = None if self.bucket.head(key) is not None else self.bucket.put_large_once(
                key, path, upload_key(block.id), size=size)
        else:
            tag = self.bucket.put(key, path, create=True, size=size)
        self.counters["puts"] += 1
        if tag is None:  # already there (another worker, or a killed upload of ours): same bytes?
            self._check_existing(block, key)
        else:
            self.counters["put_bytes"] += size
        data = marker(block, size, provenance, labels_trusted)
        mtag = self.bucket.put(marker_key(block.id), data, create=not replace)
        self.counters["puts"] += 1
        if mtag is None:  # learned by another worker at the same time: theirs stands, ours is the same state
            log.info("fleet store %s: block %s was written by another worker meanwhile", self.url, block.short_id)
        self.bucket.delete(tomb_key(block.id))
        self.index.upsert(json.loads(data), mtag or "")  # no tag: take the listing's at the next poll

    def _check_existing(self, block: Block, key: str) -> None:
        """The object under a block's key must be that block: id and state digest from its header."""
        head = self.bucket.head(key)
        if head is None:
            raise StoreError(f"{self.url}/{key} was reported present and is gone; retry")
        size = int(head["size"])
        raw = bytes(self.bucket.get_ranges(key, [0], [min(size, HEADER.size)])[0])
        _, soff, slen = parse_header(raw, where=key, file_size=size)
        prefix, trailer = self.bucket.get_ranges(key, [0, soff + slen], [soff, soff + slen + TRAILER_LEN])
        other = parse_manifest(bytes(prefix), bytes(trailer), where=f"{self.url}/{key}")
        if other.id != block.id or other.state_digest != block.state_digest:
            raise BlockCorrupted(f"{self.url}/{key} holds other content (id {other.id[:12]}, state "
                                 f"{other.state_digest}) than block {block.short_id} ({block.state_digest}); "
                                 "refusing to mark it as this block", path=f"{self.url}/{key}",
                                 expected=block.state_digest, actual=other.state_digest)

    def rewrite_marker(self, block: Block, provenance: str, labels_trusted: bool) -> None:
        """A new marker for a block already there (the block object is immutable)."""
        data = marker(block, self.index.file_size(block.id), provenance, labels_trusted)
        tag = self.bucket.put(marker_key(block.id), data, create=False)
        self.counters["puts"] += 1
        self.index.upsert(json.loads(data), tag or "")

    def delete(self, bid: str, *, cascade: bool) -> list[str]:
        """A tombstone first, then the marker, children first; the block objects stay for
        `collect_garbage`. Returns the ids deleted, parents first."""
        order = deletion_order(bid, self.index.children, cascade=cascade)
        for cur in reversed(order):  # children first
            self.bucket.put(tomb_key(cur), b"", create=False)
            self.bucket.delete(marker_key(cur))
            self.index.remove(cur)
            self.cache.drop(cur)
        return list(reversed(order))

    def upload_store(self, source: BlockStore, *, progress: Optional[Callable[[int, int], None]] = None) -> list[str]:
        """Every block of another store (block files as they are, markers with their provenance);
        blocks already in the bucket are skipped. Returns the ids uploaded."""
        blocks = source.list()
        done: list[str] = []
        for i, block in enumerate(blocks):
            if not self.index.contains(block.id):
                self.upload(block, source.path_of(block.id), block.provenance or PROVENANCE_UNVERIFIED,
                            bool(block.labels_trusted), replace=False)
                done.append(block.id)
            if progress is not None:
                progress(i + 1, len(blocks))
        return done
