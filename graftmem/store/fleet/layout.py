"""The bucket's layout: every key the fleet store reads or writes, and the marker's format, in one
place (the module doc of `graftmem.store.fleet` draws the layout and says why it is so)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

from ...core.blocks import Block
from ..home import BLOCK_SUFFIX

__all__ = ["MARKER_VERSION", "block_key", "upload_key", "marker_key", "tomb_key", "vector_key", "file_key",
           "id_of", "marker"]

#: Version of the marker's JSON (``index/<id>.json``).
MARKER_VERSION = 1
#: Folders of the bucket (under the URL's prefix).
BLOCKS, INDEX, TOMBSTONES, UPLOADS, ROUTING, FILES = "blocks", "index", "tombstones", "uploads", "routing", "files"


def block_key(bid: str) -> str:
    return f"{BLOCKS}/{bid[:2]}/{bid}{BLOCK_SUFFIX}"


def upload_key(bid: str) -> str:
    """Where a large block goes up before its conditional copy to its key: a name of this writer's own."""
    return f"{UPLOADS}/{bid}.{os.getpid()}.{threading.get_ident()}.{time.time_ns()}{BLOCK_SUFFIX}"


def marker_key(bid: str) -> str:
    return f"{INDEX}/{bid}.json"


def tomb_key(bid: str) -> str:
    return f"{TOMBSTONES}/{bid}"


def vector_key(space: str, name: str) -> str:
    """Routing rows a worker embedded: ``routing/<space>/<id>-<entry key>.npy``."""
    return f"{ROUTING}/{space}/{name}.npy"


def file_key(name: str) -> str:
    """A file shared beside the blocks (`FleetStore.put_file`)."""
    return f"{FILES}/{name}"


def id_of(path: str, folder: str, suffix: str = "") -> Optional[str]:
    """The block id a listed key names in ``folder`` (with ``suffix``), or None for any other key."""
    name = path.rsplit("/", 1)[-1]
    if suffix:
        if not name.endswith(suffix):
            return None
        name = name[:-len(suffix)]
    if len(name) == 64 and all(c in "0123456789abcdef" for c in name) and f"{folder}/" in f"/{path}":
        return name
    return None


def marker(block: Block, file_size: int, provenance: str, labels_trusted: bool) -> bytes:
    """A block's marker: its manifest, the fleet's provenance of it, whether its labels are trusted
    and the size of its block file (so a reader knows where the state lies before the first byte)."""
    return json.dumps({"v": MARKER_VERSION, "manifest": json.loads(block.model_dump_json()),
                       "provenance": provenance, "labels_trusted": bool(labels_trusted),
                       "file_size": int(file_size)}, sort_keys=True).encode()
