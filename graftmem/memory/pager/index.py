"""The passage index of long documents: documents, their pages and the passages with their vectors in
``home/pages/index.sqlite``, searched through a free-standing `Router` topped up from the rows; one
file per document can be exported and merged (what a fleet's workers share)."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ...core.errors import StoreError
from ...store.home import Home
from ...store.sqlite import connect, transaction
from ..router.embedder import embedder_id
from ..router.index import LEX_WEIGHT, Router
from .plan import DocumentPlan, Page

if TYPE_CHECKING:
    from ..router.embedder import Embedder

__all__ = ["PageIndex", "PageInfo", "PassageHit", "PagerModel"]

log = logging.getLogger("graftmem")


class PagerModel(BaseModel):
    """The pager's result types: strict (unknown fields are an error) and frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)



class PageInfo(PagerModel):
    """Where a stored page sits in its document."""

    document: str
    page: int
    block_id: str
    char_start: int
    char_end: int
    token_start: int
    n_tokens: int


class PassageHit(PagerModel):
    """A routing candidate: a passage, its score against the task (cosine + weighted lexical coverage,
    see `PageIndex`), and its page."""

    score: float
    text: str
    char_start: int
    char_end: int
    token_start: int
    page: PageInfo


_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    id TEXT NOT NULL, fp_digest TEXT NOT NULL, name TEXT NOT NULL, n_chars INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL, n_pages INTEGER NOT NULL, window INTEGER NOT NULL,
    overlap INTEGER NOT NULL, pages_done INTEGER NOT NULL, complete INTEGER NOT NULL,
    updated_at REAL NOT NULL, PRIMARY KEY (id, fp_digest));
CREATE TABLE IF NOT EXISTS pages (
    document TEXT NOT NULL, fp_digest TEXT NOT NULL, page INTEGER NOT NULL, block_id TEXT NOT NULL,
    char_start INTEGER NOT NULL, char_end INTEGER NOT NULL, token_start INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL, PRIMARY KEY (document, fp_digest, page));
CREATE INDEX IF NOT EXISTS pages_block ON pages(block_id);
CREATE TABLE IF NOT EXISTS passages (
    rowid INTEGER PRIMARY KEY, block_id TEXT NOT NULL, document TEXT NOT NULL, page INTEGER NOT NULL,
    idx INTEGER NOT NULL, char_start INTEGER NOT NULL, char_end INTEGER NOT NULL,
    token_start INTEGER NOT NULL, text TEXT NOT NULL, embedder TEXT NOT NULL, vec BLOB NOT NULL,
    UNIQUE (block_id, idx, embedder));
"""

# Passages are keyed by the page's block: the same text learned by another engine or with another
# window is another plan (other pages, other block ids) under the same document id. Version 0 keyed
# them by (document, page), so a second engine's pages found the first one's passages, embedded
# nothing, and could not be routed to. _migrate rebuilds such a table, keeping rowids.
_PASSAGES_V1 = _SCHEMA[_SCHEMA.index("CREATE TABLE IF NOT EXISTS passages"):]
_USER_VERSION = 1


def _setup(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(_SCHEMA)
    _migrate(db)


def _migrate(db: sqlite3.Connection) -> None:
    if db.execute("PRAGMA user_version").fetchone()[0] >= _USER_VERSION:
        return
    with transaction(db):  # re-read inside the write lock: another process may have migrated meanwhile
        if db.execute("PRAGMA user_version").fetchone()[0] < _USER_VERSION:
            sql = db.execute("SELECT sql FROM sqlite_master WHERE name='passages'").fetchone()
            if sql is not None and "UNIQUE (block_id, idx, embedder)" not in sql[0]:
                db.execute("ALTER TABLE passages RENAME TO passages_v0")
                db.execute(_PASSAGES_V1)
                db.execute("INSERT OR IGNORE INTO passages SELECT * FROM passages_v0")
                db.execute("DROP TABLE passages_v0")
                log.info("page index: passages re-keyed by page block (schema version %d)", _USER_VERSION)
            db.execute(f"PRAGMA user_version={_USER_VERSION}")


class PageIndex:
    """Documents, pages and passage vectors of one store, in ``home/pages/index.sqlite``.

    Search uses a free-standing `Router` loaded from the SQLite rows and
    topped up incrementally when rows are added, by this process or another one. It is hybrid: a
    passage scores its MiniLM cosine plus ``lex_weight`` times its lexical coverage of the question
    (`graftmem.memory.lexical`), because a one-sentence fact inside a passage of unrelated text is
    diluted in the passage's vector while the rare name it carries is exactly what a word index
    catches. ``lex_weight=0`` routes by the cosine alone (as before; for comparisons).
    """

    def __init__(self, home: Path, embedder: "Embedder", *, lex_weight: float = LEX_WEIGHT) -> None:
        self.path = Home(Path(home)).pages_index
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the page index at {self.path.parent}: {exc}") from exc
        self.embedder = embedder
        self.embedder_id = embedder_id(embedder)
        self.lex_weight = float(lex_weight)
        self._lock = threading.RLock()
        self._db = connect(self.path, timeout=60, setup=_setup)
        self._router: "Router | None" = None
        self._loaded_rowid = 0

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ sharing (a fleet's bucket)
    @contextlib.contextmanager
    def _attached(self, path: Path, alias: str, begin: str = "BEGIN") -> Iterator[None]:
        """Another index file attached as ``alias`` for one transaction: committed if the block ends
        normally, rolled back on an error, detached in any case."""
        with self._lock:
            self._db.execute(f"ATTACH DATABASE ? AS {alias}", (str(path),))
            try:
                with transaction(self._db, begin):
                    yield
            finally:
                self._db.execute(f"DETACH DATABASE {alias}")

    def export_document(self, document: str, fp_digest: str, dest: Path) -> int:
        """Write one document's rows (its record, its pages, their passages and vectors) into a new
        SQLite file ``dest``; return the passages written. What a worker of a fleet publishes beside the
        blocks, so that other workers route to the pages without embedding the document again; one
        file per document (and engine), so workers that learn different documents never overwrite each
        other's rows (a whole-index snapshot would)."""
        dest = Path(dest)
        dest.unlink(missing_ok=True)
        with contextlib.closing(sqlite3.connect(dest)) as out:
            out.executescript(_SCHEMA)
            out.execute(f"PRAGMA user_version={_USER_VERSION}")
        args = (document, fp_digest)
        with self._attached(dest, "out"):
            self._db.execute("INSERT INTO out.documents SELECT * FROM documents WHERE id=? AND fp_digest=?", args)
            self._db.execute("INSERT INTO out.pages SELECT * FROM pages WHERE document=? AND fp_digest=?", args)
            return self._db.execute("INSERT INTO out.passages SELECT * FROM passages WHERE block_id IN "
                                    "(SELECT block_id FROM pages WHERE document=? AND fp_digest=?)", args).rowcount

    def merge_from(self, path: Path) -> int:
        """Add the rows of a file written by `export_document()` (this or another worker's) to this
        index; return the passages added. Idempotent: pages and passages already here are kept (the
        passages get rowids of this index, so the router's incremental load picks them up), a
        document's progress only grows. A file that is not such an index raises ``sqlite3.Error``."""
        cols = "block_id, document, page, idx, char_start, char_end, token_start, text, embedder, vec"
        with self._attached(path, "src", "BEGIN IMMEDIATE"):
            self._db.execute(
                "INSERT INTO documents SELECT * FROM src.documents WHERE true ON CONFLICT(id, fp_digest) "
                "DO UPDATE SET pages_done=max(pages_done, excluded.pages_done), "
                "complete=max(complete, excluded.complete), updated_at=max(updated_at, excluded.updated_at)")
            self._db.execute("INSERT OR IGNORE INTO pages SELECT * FROM src.pages")
            return self._db.execute(f"INSERT OR IGNORE INTO passages ({cols}) SELECT {cols} FROM src.passages "
                                    "ORDER BY rowid").rowcount

    # ------------------------------------------------------------------ writes
    def start_document(self, plan: DocumentPlan, fp_digest: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO documents VALUES (?,?,?,?,?,?,?,?,0,0,?) ON CONFLICT(id, fp_digest) DO UPDATE SET "
                "name=excluded.name, n_chars=excluded.n_chars, n_tokens=excluded.n_tokens, "
                "n_pages=excluded.n_pages, window=excluded.window, overlap=excluded.overlap, "
                "updated_at=excluded.updated_at",
                (plan.document, fp_digest, plan.name, len(plan.text), plan.n_tokens, len(plan.pages),
                 plan.window, plan.overlap, time.time()))

    def has_passages(self, block_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM passages WHERE block_id=? AND embedder=? LIMIT 1",
                                    (block_id, self.embedder_id)).fetchone() is not None

    def add_page(self, plan: DocumentPlan, page: Page, block_id: str, fp_digest: str,
                 embed: bool) -> int:
        """Record the page and (if ``embed``) its passages with their vectors, in one transaction."""
        texts = [plan.text[s:e] for s, e, _ in page.passages]
        vecs = np.asarray(self.embedder.embed_batch(texts), dtype=np.float32) if embed and texts else None
        with self._lock:
            with transaction(self._db):
                self._db.execute("INSERT OR REPLACE INTO pages VALUES (?,?,?,?,?,?,?,?)",
                                 (plan.document, fp_digest, page.page, block_id, page.char_start,
                                  page.char_end, page.token_start, page.n_tokens))
                if vecs is not None:
                    self._db.executemany(
                        "INSERT OR IGNORE INTO passages (block_id, document, page, idx, char_start, char_end, "
                        "token_start, text, embedder, vec) VALUES (?,?,?,?,?,?,?,?,?,?)",
                        [(block_id, plan.document, page.page, k, s, e, t, texts[k], self.embedder_id,
                          vecs[k].tobytes()) for k, (s, e, t) in enumerate(page.passages)])
        return len(texts) if vecs is not None else 0

    def finish_pages(self, plan: DocumentPlan, fp_digest: str) -> tuple[int, bool]:
        with self._lock:
            done = self._db.execute("SELECT COUNT(*) FROM pages WHERE document=? AND fp_digest=?",
                                    (plan.document, fp_digest)).fetchone()[0]
            complete = done >= len(plan.pages)
            self._db.execute("UPDATE documents SET pages_done=?, complete=?, updated_at=? WHERE id=? AND fp_digest=?",
                             (done, int(complete), time.time(), plan.document, fp_digest))
        return done, complete

    # ------------------------------------------------------------------ reads
    def documents(self) -> list[dict]:
        with self._lock:
            cur = self._db.execute("SELECT * FROM documents ORDER BY updated_at")
            cols = [c[0] for c in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    def pages(self, document: str, fp_digest: str) -> list[PageInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT document, page, block_id, char_start, char_end, token_start, n_tokens FROM pages "
                "WHERE document=? AND fp_digest=? ORDER BY page", (document, fp_digest)).fetchall()
        return [PageInfo(document=r[0], page=r[1], block_id=r[2], char_start=r[3], char_end=r[4],
                         token_start=r[5], n_tokens=r[6]) for r in rows]

    def _refresh(self) -> "Router":
        """Load passage vectors added since the last call into the in-memory router."""
        with self._lock:
            if self._router is None:
                self._router = Router(self.embedder, lex_weight=self.lex_weight, passages=False)
            rows = self._db.execute("SELECT rowid, vec, text FROM passages WHERE embedder=? AND rowid>? "
                                    "ORDER BY rowid", (self.embedder_id, self._loaded_rowid)).fetchall()
            if rows:
                vecs = np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows])
                self._router.add_vectors([str(r[0]) for r in rows], vecs, texts=[r[2] for r in rows])
                self._loaded_rowid = rows[-1][0]
            return self._router

    def __len__(self) -> int:
        return len(self._refresh())

    def search(self, task: str, top_k: int = 5, *, fp_digest: str,
               document: Optional[str] = None) -> list[PassageHit]:
        """Passages best first, only from pages of this engine (and of ``document`` if given)."""
        router = self._refresh()
        n = len(router)
        if n == 0:
            return []
        k = min(n, max(top_k * 4, 16))
        while True:
            out: list[PassageHit] = []
            for pid, score in router.search(task, k):
                with self._lock:
                    r = self._db.execute(
                        "SELECT p.text, p.char_start, p.char_end, p.token_start, g.document, g.page, g.block_id, "
                        "g.char_start, g.char_end, g.token_start, g.n_tokens FROM passages p JOIN pages g "
                        "ON g.document=p.document AND g.page=p.page AND g.block_id=p.block_id "
                        "WHERE p.rowid=? AND g.fp_digest=?", (int(pid), fp_digest)).fetchone()
                if r is None or (document is not None and r[4] != document):
                    continue
                out.append(PassageHit(score=score, text=r[0], char_start=r[1], char_end=r[2], token_start=r[3],
                                      page=PageInfo(document=r[4], page=r[5], block_id=r[6], char_start=r[7],
                                                    char_end=r[8], token_start=r[9], n_tokens=r[10])))
                if len(out) == top_k:
                    return out
            if k >= n:
                return out
            k = min(n, k * 4)
