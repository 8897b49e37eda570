"""What a fleet's workers share beside the blocks: routing rows (so a new worker embeds only what no
worker embedded before) and files (a document's page index, so a new worker routes to its pages
without embedding the document again). Best effort by design: a row or a file that cannot be read
or written costs a re-embed, never a wrong answer (the blocks themselves are checked on every read).
"""

from __future__ import annotations

import io
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from ...core.errors import BlockNotFound, ConfigError, StoreError, TransferError
from ..local import atomic_file
from ..remote import Bucket
from .layout import FILES, ROUTING, file_key, vector_key

__all__ = ["SharedFiles"]

log = logging.getLogger("graftmem")


class SharedFiles:
    """Routing rows under ``routing/<space>/`` and files under ``files/`` of one bucket."""

    def __init__(self, bucket: Bucket, *, url: str, counters: dict[str, int]) -> None:
        self.bucket, self.url, self.counters = bucket, url, counters

    # ------------------------------------------------------------------ routing vectors
    def get_vectors(self, space: str, names: list[str]) -> dict[str, Any]:
        """Routing rows other workers embedded (``routing/<space>/<id>-<entry key>.npy``), for the
        router (`graftmem.memory.router`); missing or unreadable ones are left out (embedded locally)."""
        import numpy as np

        if not names:
            return {}
        try:
            there = {o["path"].rsplit("/", 1)[-1][:-4] for o in self.bucket.list(f"{ROUTING}/{space}")
                     if o["path"].endswith(".npy")}
        except (StoreError, TransferError) as exc:
            log.warning("fleet store %s: routing vectors not listed (%s); embedding here", self.url, exc)
            return {}
        want = [n for n in names if n in there]

        def one(name: str) -> Optional[tuple[str, Any]]:
            try:
                raw = bytes(self.bucket.get(vector_key(space, name)))
                arr = np.load(io.BytesIO(raw), allow_pickle=False)
            except (StoreError, TransferError, ValueError, OSError) as exc:
                log.warning("fleet store %s: routing vectors %s unreadable (%s); embedding here", self.url, name, exc)
                return None
            if arr.dtype != np.float32 or arr.ndim != 2 or not np.isfinite(arr).all():
                return None
            return name, arr

        with ThreadPoolExecutor(max_workers=8) as pool:
            got = [g for g in pool.map(one, want) if g is not None]
        self.counters["gets"] += len(want)
        return dict(got)

    def put_vectors(self, space: str, rows: dict[str, Any]) -> None:
        """Share routing rows this worker embedded (written once; a failure only costs a re-embed elsewhere)."""
        import numpy as np

        def one(item: tuple[str, Any]) -> None:
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(item[1], dtype=np.float32), allow_pickle=False)
            try:
                self.bucket.put(vector_key(space, item[0]), buf.getvalue(), create=True)
            except (StoreError, TransferError) as exc:
                log.warning("fleet store %s: routing vectors %s not shared: %s", self.url, item[0], exc)

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(one, rows.items()))
        self.counters["puts"] += len(rows)

    # ------------------------------------------------------------------ files
    def put_file(self, name: str, path: Path) -> None:
        """Share a file beside the blocks (``files/<name>``, overwritten): e.g. a snapshot of a page
        index, so that a new worker asks a long document without re-embedding its passages."""
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ConfigError(f"{name!r} is not a relative file name")
        self.bucket.put(file_key(name), Path(path), create=False)
        self.counters["puts"] += 1

    def list_files(self, prefix: str) -> list[dict[str, Any]]:
        """The files shared under ``prefix`` (`put_file()` names): ``name``, ``size`` and ``e_tag`` each."""
        base = file_key(prefix)
        return [{"name": o["path"][len(f"{FILES}/"):], "size": o.get("size"), "e_tag": o.get("e_tag")}
                for o in self.bucket.list(base) if o["path"].startswith(base)]

    def get_file(self, name: str, dest: Path) -> bool:
        """Download ``files/<name>`` to ``dest`` (atomically); False if there is none."""
        try:
            data = self.bucket.get(file_key(name))
        except BlockNotFound:
            return False
        self.counters["gets"] += 1
        self.counters["get_bytes"] += len(data)
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(Path(dest)) as f:
            f.write(memoryview(data))
        return True
