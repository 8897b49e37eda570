"""Long documents through one fixed window: pages, page blocks, passage routing, one-page recall.

Why pages. A graft is exact only at the positions a state was computed at, and a context can only
hold ``n_ctx`` positions. A document longer than the window is therefore cut into *pages* that each
fit the window; every page is prefilled on its own from position 0 (with the model's BOS, as any
fresh prompt) and stored as an ordinary block of kind ``page``. Answering a question restores ONE
page and prefills only the question, so the restore cost and the context size are those of one page
however large the store grows. This is the paper's "needle in store" setting (88 pages of 32k tokens
behind a 32k window), at the sizes our small models and this CPU allow.

Why passages. A page holds thousands of tokens; one embedding of a whole page (or of its start, which
is what `Router` embeds for a block) cannot say which page holds one sentence.
Each page is therefore cut into passages of a few sentences; every passage gets its own MiniLM
vector, and a passage maps back to its page. A question routes to the best passage, and the page of
that passage is the one grafted. The passage index is a small SQLite file (``home/pages/index.sqlite``)
beside the store: it records documents, their pages and the passages with their vectors. It is
append-mostly and written in one transaction per page, after the page's block is stored atomically, so
a kill at any point leaves either a page whose passages are missing (the next build embeds them
without prefilling again) or nothing at all.

Why the build is resumable. A page's block id is a content address (engine fingerprint + token ids),
and the cutting is deterministic (same text, window, overlap and tokenizer give the same pages), so a
rerun computes the same ids, finds the stored ones and skips them: nothing is prefilled twice and
nothing is stored twice. The document row records how many pages are done, for progress reports.

Positions in the document. ``token_start`` of a page is the previous page's plus the tokens of the
text between the two page starts; of a passage, the previous passage's plus the tokens between them.
Each piece is tokenized whole, so an offset differs from tokenizing the entire document at once only
where a piece boundary splits a token (measured: 23 tokens off after 60,000), at the cost of one extra
tokenization of the text.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..core.blocks import PAGE_KIND, Block, Recall, block_id_for
from ..core.errors import BlockNotFound, ConfigError, StoreError
from ..core.progress import progress_bar
from ..store.home import Home
from ..store.sqlite import connect, transaction
from .learn import prefill_and_store
from .recall import answer_graft_way
from .router import LEX_WEIGHT, Router, embedder_id

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.local import Store
    from .router import Embedder

__all__ = ["Page", "DocumentPlan", "PageInfo", "PassageHit", "DocumentReport", "DocumentAnswer",
           "PageIndex", "plan_document", "learn_pages", "learn_document", "recall_document",
           "DEFAULT_RESERVE", "DEFAULT_OVERLAP", "DEFAULT_PAGE_MIN_SCORE", "PAGE_KIND"]

log = logging.getLogger("graftmem")

#: positions of the window kept free for the question and the answer when ``window`` is not given
DEFAULT_RESERVE = 256
#: tokens repeated at the start of the next page, so a sentence cut by a page end is whole in one page
DEFAULT_OVERLAP = 64
#: passage score (cosine + LEX_WEIGHT * lexical coverage) below which recall_document grafts nothing.
#: Not the block router's threshold: a passage is scored on its own text, without a name or a
#: when_to_use, and a one-sentence answer in a passage of unrelated text scores lower than a manual.
#: On the tuning needles (bench/routing.py --quality-only: 4 in stdlib docstrings) the right passages
#: scored 0.33 or more, off-topic questions over those docstrings at most 0.23. Over the synthetic
#: corpus of bench/needle.py (word salad) off-topic questions reach 0.45, its needles 0.95 or more.
DEFAULT_PAGE_MIN_SCORE = 0.30
#: characters a passage grows to before a new one starts (MiniLM reads at most 256 word pieces)
PASSAGE_CHARS = 480

Source = Union[str, "os.PathLike[str]", Iterable[str]]

# a unit ends after sentence punctuation (with closing quotes/brackets) followed by white space, or at
# a blank line; the white space stays with the unit before it, so units concatenate to the text
_BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n\s*")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Page:
    """One page of a plan: its text (a slice of the document), token ids and place in the document."""

    page: int
    char_start: int
    char_end: int
    token_start: int
    tokens: list[int]
    text: str
    passages: list[tuple[int, int, int]]  #: (char_start, char_end, token_start) in document coordinates

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class DocumentPlan:
    """How a document is cut into pages for one engine; deterministic, so a rerun gets the same pages."""

    document: str
    name: str
    text: str
    window: int
    overlap: int
    pages: list[Page]
    n_tokens: int  #: tokens of the document, overlaps counted once (see the module docstring)
    tokenize: Callable[[str], list[int]] = field(repr=False, compare=False)

    @property
    def page_tokens(self) -> int:
        """Tokens prefilled to store every page (overlaps and BOS counted on every page)."""
        return sum(p.n_tokens for p in self.pages)

    def token_offset(self, char_pos: int) -> int:
        """Token offset in the document of character ``char_pos``: the start of the last page that
        begins at or before it, plus the tokens of the page text before it."""
        import bisect

        starts = [p.char_start for p in self.pages]
        page = self.pages[max(0, bisect.bisect_right(starts, char_pos) - 1)]
        head = self.text[page.char_start:char_pos]
        return page.token_start + (len(self.tokenize(head)) if head else 0)

    def pages_holding(self, char_start: int, char_end: int) -> list[int]:
        """Page numbers whose text contains the whole range ``[char_start, char_end)``."""
        return [p.page for p in self.pages if p.char_start <= char_start and char_end <= p.char_end]


class PageInfo(_Model):
    """Where a stored page sits in its document."""

    document: str
    page: int
    block_id: str
    char_start: int
    char_end: int
    token_start: int
    n_tokens: int


class PassageHit(_Model):
    """A routing candidate: a passage, its score against the task (cosine + weighted lexical coverage,
    see `PageIndex`), and its page."""

    score: float
    text: str
    char_start: int
    char_end: int
    token_start: int
    page: PageInfo


class DocumentReport(_Model):
    """What a (possibly resumed) document build did."""

    document: str
    name: str
    pages: int
    pages_learned: int
    pages_skipped: int
    passages_embedded: int
    document_tokens: int
    page_tokens: int
    tokens_prefilled: int
    seconds: float
    complete: bool


class DocumentAnswer(_Model):
    """An answer from ONE grafted page, with where in the document it came from."""

    text: str
    page: PageInfo
    passage: PassageHit
    runner_up: Optional[PassageHit] = None
    recall: Recall

    @property
    def depth(self) -> int:
        """Token offset in the document of the passage the question was routed to."""
        return self.passage.token_start


# --------------------------------------------------------------------------- planning
def read_source(source: Source) -> str:
    """The document text: a path (``Path``, or a ``str`` naming an existing file with no newline in it),
    a text, or an iterable of texts (joined by blank lines, each one a section)."""
    if isinstance(source, os.PathLike):
        return Path(source).read_text(encoding="utf-8")
    if isinstance(source, str):
        if "\n" not in source and len(source) < 4096:
            try:
                if Path(source).expanduser().is_file():
                    return Path(source).expanduser().read_text(encoding="utf-8")
            except OSError:
                pass
        return source
    if isinstance(source, (bytes, bytearray)):
        raise ConfigError("pass the document as text (str), a path, or an iterable of str, not bytes")
    parts = []
    for i, part in enumerate(source):
        if not isinstance(part, str):
            raise ConfigError(f"item {i} of the document is {type(part).__name__}, expected str")
        parts.append(part.strip())
    return "\n\n".join(p for p in parts if p)


def _units(text: str) -> list[tuple[int, int]]:
    """Sentence/paragraph units as (start, end) char spans that tile the text."""
    spans = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        end = m.end()
        if end > start:
            spans.append((start, end))
            start = end
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def _split_long(text: str, start: int, end: int, n_tok: int, budget: int) -> list[tuple[int, int]]:
    """Cut a unit with no sentence break that exceeds ``budget`` tokens at word boundaries."""
    pieces = max(2, -(-n_tok // max(1, budget // 2)))
    step = max(1, (end - start) // pieces)
    out = []
    s = start
    while s < end:
        e = min(end, s + step)
        if e < end:
            sp = text.rfind(" ", s + 1, e)
            e = sp + 1 if sp > s else e
        out.append((s, e))
        s = e
    return out


def plan_document(engine: "Engine", text: str, *, window: Optional[int] = None,
                  overlap: int = DEFAULT_OVERLAP, document: Optional[str] = None,
                  name: Optional[str] = None, passage_chars: int = PASSAGE_CHARS) -> DocumentPlan:
    """Cut ``text`` into pages of at most ``window`` tokens (BOS included) at sentence or paragraph
    boundaries, each page starting ``overlap`` tokens (whole sentences) before the previous one ended.

    ``window`` defaults to the engine's ``n_ctx`` minus `DEFAULT_RESERVE` positions for the
    question and the answer. ``document`` is the document id (default: a hash of the text).
    """
    if not text or not text.strip():
        raise ConfigError("cannot learn an empty document")
    window = engine.n_ctx - DEFAULT_RESERVE if window is None else int(window)
    if window < 32:
        raise ConfigError(f"window={window} tokens is too small for a page (at least 32)")
    if window > engine.n_ctx - 16:
        raise ConfigError(f"window={window} leaves no room for a question in n_ctx={engine.n_ctx}: "
                          f"use at most {engine.n_ctx - 16} (default n_ctx - {DEFAULT_RESERVE})")
    if overlap < 0 or overlap >= window // 2:
        raise ConfigError(f"overlap={overlap} must be >= 0 and less than half the window ({window // 2})")
    doc_id = document or "doc-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    bos = len(engine.tokenize(""))  # the BOS each page starts with, if the model uses one
    budget = window - bos - 2  # joins between units may tokenize a little differently

    spans: list[tuple[int, int]] = []
    counts: list[int] = []
    for s, e in _units(text):
        n = len(engine.tokenize(text[s:e], add_special=False))
        if n > budget:
            for s2, e2 in _split_long(text, s, e, n, budget):
                spans.append((s2, e2))
                counts.append(len(engine.tokenize(text[s2:e2], add_special=False)))
        else:
            spans.append((s, e))
            counts.append(n)
    def count(t: str) -> int:
        return len(engine.tokenize(t, add_special=False)) if t else 0

    page_tok = 0  # token offset of the current page: the previous one's plus its text up to here
    prev_cs = 0

    pages: list[Page] = []
    i = 0
    n_units = len(spans)
    while i < n_units:
        j = i
        total = 0
        while j < n_units and total + counts[j] <= budget:
            total += counts[j]
            j += 1
        if j == i:  # cannot happen after _split_long, but never loop forever
            j = i + 1
        while True:
            cs, ce = spans[i][0], spans[j - 1][1]
            page_text = text[cs:ce].rstrip()
            tokens = engine.tokenize(page_text)
            if len(tokens) <= window or j == i + 1:
                break
            j -= 1
        if len(tokens) > window:
            raise ConfigError(f"a sentence at character {cs} does not fit a {window}-token page")
        page_tok += count(text[prev_cs:cs])
        prev_cs = cs
        passages = []
        k = i
        p_tok, p_cs = page_tok, cs  # passage offsets, counted piece by piece (linear in the page)
        while k < j:
            m = k
            while m < j and (m == k or spans[m][1] - spans[k][0] <= passage_chars):
                m += 1
            p_tok += count(text[p_cs:spans[k][0]])
            p_cs = spans[k][0]
            passages.append((spans[k][0], min(spans[m - 1][1], cs + len(page_text)), p_tok))
            k = m
        pages.append(Page(page=len(pages), char_start=cs, char_end=cs + len(page_text),
                          token_start=page_tok, tokens=tokens, text=page_text, passages=passages))
        if j >= n_units:
            break
        # the next page starts at the earliest unit such that the units it repeats fit in `overlap`
        nxt = j
        kept = 0
        while nxt - 1 > i and kept + counts[nxt - 1] <= overlap:
            nxt -= 1
            kept += counts[nxt]
        i = nxt
    n_doc = page_tok + count(text[prev_cs:])
    return DocumentPlan(document=doc_id, name=name or doc_id, text=text, window=window, overlap=overlap,
                        pages=pages, n_tokens=n_doc, tokenize=lambda t: engine.tokenize(t, add_special=False))


# --------------------------------------------------------------------------- the passage index
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
        self._db = connect(self.path, timeout=60, setup=lambda db: (
            db.execute("PRAGMA synchronous=FULL"), db.executescript(_SCHEMA), _migrate(db)))
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


# --------------------------------------------------------------------------- building
def learn_pages(engine: "Engine", store: "Store", index: PageIndex, plan: DocumentPlan, pages: Optional[Sequence[int]] = None, *,
                progress: bool = True) -> DocumentReport:
    """Prefill and store the pages of ``plan`` (all, or the page numbers in ``pages``, in that order).

    Pages already in the store are skipped (their ids are content addresses); pages whose passages are
    missing from the index (a build killed between the two writes) are embedded again without a
    prefill. Safe to interrupt at any point and to rerun.
    """
    fp = engine.fingerprint
    fpd = fp.digest()
    index.start_document(plan, fpd)
    numbers = list(range(len(plan.pages))) if pages is None else [int(i) for i in pages]
    bad = [i for i in numbers if not 0 <= i < len(plan.pages)]
    if bad:
        raise ConfigError(f"document {plan.document} has pages 0..{len(plan.pages) - 1}; no page {bad[0]}")
    todo = [plan.pages[i] for i in numbers]
    learned = skipped = embedded = prefilled = 0
    t0 = time.perf_counter()
    bar = progress_bar(sum(p.n_tokens for p in todo), f"learn {plan.name}", progress, leave=True)
    try:
        for page in todo:
            bid = block_id_for(fp, page.tokens)
            stored = store.contains(bid)
            if stored and store.get(bid).trusted:
                skipped += 1
                if bar is not None:
                    bar.update(page.n_tokens)
            else:
                prefill_and_store(
                    engine, store, block_id=bid, tokens=page.tokens, text=page.text,
                    name=f"{plan.name} p{page.page}", kind=PAGE_KIND, metadata={
                        "document": plan.document, "document_name": plan.name, "page": page.page,
                        "char_start": page.char_start, "char_end": page.char_end,
                        "token_start": page.token_start, "window": plan.window, "overlap": plan.overlap},
                    progress=bar.update if bar is not None else None,
                    replace=stored)  # an unverified page (imported unchecked) is never reused: re-prefilled
                learned += 1
                prefilled += page.n_tokens
            need = not index.has_passages(bid)
            embedded += index.add_page(plan, page, bid, fpd, embed=need)
    finally:
        if bar is not None:
            bar.close()
        done, complete = index.finish_pages(plan, fpd)
    secs = time.perf_counter() - t0
    log.info("document %s: %d pages learned, %d already stored, %d/%d done, %.1f s", plan.document, learned,
             skipped, done, len(plan.pages), secs)
    return DocumentReport(document=plan.document, name=plan.name, pages=len(plan.pages), pages_learned=learned,
                          pages_skipped=skipped, passages_embedded=embedded, document_tokens=plan.n_tokens,
                          page_tokens=plan.page_tokens, tokens_prefilled=prefilled, seconds=secs,
                          complete=complete)


def learn_document(engine: "Engine", store: "Store", index: PageIndex, source: Source, *, document: Optional[str] = None,
                   name: Optional[str] = None, window: Optional[int] = None,
                   overlap: int = DEFAULT_OVERLAP, progress: bool = True) -> DocumentReport:
    """Cut a document into pages that fit the window, store each page as a block and index its passages."""
    text = read_source(source)
    if name is None and isinstance(source, (os.PathLike, str)) and text is not source:
        name = Path(source).name  # type: ignore[arg-type]
    plan = plan_document(engine, text, window=window, overlap=overlap, document=document, name=name)
    return learn_pages(engine, store, index, plan, progress=progress)


# --------------------------------------------------------------------------- asking
def recall_document(engine: "Engine", store: "Store", index: PageIndex, task: str, *, prompt: Optional[str] = None,
                    document: Optional[str] = None, max_tokens: int = 32,
                    min_score: Optional[float] = None,
                    admit: Optional[Callable[["Block"], None]] = None) -> DocumentAnswer:
    """Route ``task`` to the passage that answers it, graft ONLY that passage's page, prefill the
    prompt (default: a blank line and the task) and answer greedily.

    The context holds one page and the prompt, whatever the size of the store. ``admit(block)`` runs on
    the page's block before any byte of it reaches the engine, and refuses it by raising: the consent
    rule of `graftmem.memory.verbs` (a page imported unchecked may hold another text's state). Call this
    through `MemoryVerbs.recall_document`, which passes it.
    """
    if not isinstance(task, str) or not task.strip():
        raise ConfigError("the task is empty: give the question to route")
    threshold = DEFAULT_PAGE_MIN_SCORE if min_score is None else float(min_score)
    fpd = engine.fingerprint.digest()
    hits = index.search(task, 8, fp_digest=fpd, document=document)
    if not hits:
        where = f"document {document!r}" if document else "this store"
        raise BlockNotFound(f"no page of {where} was learned by this engine ({engine.fingerprint.model_name}); "
                            "learn it with learn_document first")
    if hits[0].score < threshold:
        raise BlockNotFound(f"no passage matched this task: the best one (page {hits[0].page.page} of "
                            f"{hits[0].page.document}) scored {hits[0].score:.3f}, below min_score {threshold:.2f}")
    for n, top in enumerate(hits):
        try:
            block = store.get(top.page.block_id)
            break
        except BlockNotFound:  # deleted by another process since it was indexed: take the next page
            continue
    else:
        raise BlockNotFound("every page that matched this task has been deleted from the store")
    hits = hits[n:]
    if admit is not None:
        admit(block)
    r = answer_graft_way(engine, store, block, prompt if prompt is not None else "\n\n" + task, max_tokens=max_tokens)
    prefetch = getattr(store, "prefetch", None)  # a fleet store: bring the runner-up pages into its cache
    if prefetch is not None:
        prefetch(list(dict.fromkeys(h.page.block_id for h in hits[1:3] if h.page.block_id != block.id)))
    return DocumentAnswer(text=r.text, page=top.page, passage=top, runner_up=hits[1] if len(hits) > 1 else None,
                          recall=r.model_copy(update={"score": top.score}))
