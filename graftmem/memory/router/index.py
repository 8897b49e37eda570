"""The routing index: `Router`, one faiss inner-product index of normalized vectors (several rows per
block: route text, then passages) and a lexical index, kept equal to the store (the package doc says
how), with the exact-lookup cache of recurring tasks."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from ...core.blocks import UNROUTED_KINDS
from ...core.errors import ConfigError, StoreError
from ..lexical import Lexicon, tokens
from .embedder import Embedder, embedder_id
from .text import LEX_CHARS, MAX_PASSAGES, PASSAGE_CHARS, TEXT_CHARS, block_body, entry_key, normalize_task, route_parts

if TYPE_CHECKING:
    from ...core.blocks import Block
    from ...store.protocol import BlockStore

__all__ = ["Router", "INDEX_VERSION", "DEFAULT_MIN_SCORE", "LEX_WEIGHT", "ROUTE_WEIGHT"]

log = logging.getLogger("graftmem")

#: Layout version of ``router/index.npz``; a file with another version is rebuilt, not read.
#: 1: one vector per block. 2: several rows per block (route text + passages), row owners, lexical terms.
INDEX_VERSION = 2
#: Score (dense + LEX_WEIGHT * coverage) below which recall grafts nothing. Chosen on the tuning set
#: (bench/routing.py, docs/routing.md): it refuses all 24 off-topic tasks (their maximum was 0.37, "Plan
#: a three-day trip to Lisbon" -> leave requests) and keeps 67 of the 70 right routes.
DEFAULT_MIN_SCORE = 0.38
#: Weight of the lexical coverage (in [0, 1)) added to the dense score; see docs/routing.md.
LEX_WEIGHT = 0.5
#: Dense score of a block with passages: ROUTE_WEIGHT * cosine(route text) + (1 - ROUTE_WEIGHT) *
#: max cosine(passages). The route text (name, when_to_use, start) says what a block is FOR; a passage
#: only what one paragraph says, and worked examples in a manual look like tasks of other manuals.
ROUTE_WEIGHT = 0.75


def _normalized(vecs: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(vecs, dtype=np.float32)
    if v.ndim != 2:
        raise ConfigError(f"embed_batch must return a 2-D array, got shape {v.shape}")
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return v / norms


_faiss_ready = False


def _faiss() -> Any:
    """faiss, with its OpenMP pool set to one thread on first use.

    Why: a route searches ONE query vector; faiss would split the 10,000-row scan over every core
    and, when llama.cpp or anything else holds those cores, its OpenMP threads wait on each other.
    Measured on this 2-core machine under load, 10,012 rows: 0.3 ms with one thread, 32 ms with two.
    This is process-wide (OpenMP has one pool); call ``faiss.omp_set_num_threads`` after creating a
    router if another part of your program runs large batched faiss searches.
    """
    global _faiss_ready
    try:
        import faiss
    except ImportError as exc:
        raise ConfigError("routing needs faiss: pip install '.[router]' in the graftmem clone") from exc
    if not _faiss_ready:
        faiss.omp_set_num_threads(1)
        _faiss_ready = True
    return faiss


class Router:
    """Hybrid routing over the blocks of a [`Store`][graftmem.Store]: a faiss inner-product index of normalized
    vectors (several rows per block: route text, then passages) plus a lexical index
    (`Lexicon`). Score = dense + ``lex_weight`` * coverage, where dense =
    ``route_weight`` * cosine(route text) + (1 - ``route_weight``) * max cosine(passages).

    Thread-safe: one lock guards the index and its bookkeeping; a task is embedded outside it, so
    several threads route concurrently and only the (millisecond) search is serialized.
    ``store=None`` makes a free-standing index (benchmarks and the pager add entries with
    `add_vectors()` or `add_documents()`). ``lex_weight=0`` routes by the dense score alone;
    ``passages=False`` embeds one row per block (the route text), as index version 1 did.
    """

    def __init__(self, embedder: Embedder, store: Optional["BlockStore"] = None, *,
                 cache_size: int = 4096, lex_weight: float = LEX_WEIGHT, passages: bool = True,
                 route_weight: float = ROUTE_WEIGHT, depth: int = 64) -> None:
        if lex_weight < 0:
            raise ConfigError(f"lex_weight must be >= 0, got {lex_weight}")
        if not 0.0 <= route_weight <= 1.0:
            raise ConfigError(f"route_weight must be in [0, 1], got {route_weight}")
        self.route_weight = float(route_weight)
        self.embedder = embedder
        self.embedder_id = embedder_id(embedder)
        self.store = store
        self.lex_weight = float(lex_weight)
        self.use_passages = bool(passages)
        self.depth = int(depth)
        self.dim: Optional[int] = None
        self._lock = threading.RLock()
        self._index: Any = None
        self._ids: list[str] = []        # per entry (block)
        self._digests: list[str] = []
        self._keys: list[str] = []
        self._terms: list[str] = []      # per entry: its lexical terms, space-joined
        self._owners: list[str] = []     # per faiss row: the entry (block id) it belongs to
        self._pos: dict[str, int] = {}
        self._lex = Lexicon()
        self._rows_of: Optional[dict[str, list[int]]] = None
        self._digest_arr: Optional[np.ndarray] = None
        self._seen_version: Optional[int] = None
        self._cache: "OrderedDict[tuple[str, int, str], list[tuple[str, float]]]" = OrderedDict()
        self._cache_size = cache_size
        self.generation = 0  #: bumped on every change of the entries; invalidates the exact-lookup cache
        self.path = store.layout.router_index if store is not None else None
        if store is not None:
            self._load()
            self.sync(force=True)

    # ------------------------------------------------------------------ entries
    def __len__(self) -> int:
        return len(self._ids)

    @property
    def n_rows(self) -> int:
        """Dense rows (vectors) in the index: one or more per entry."""
        return len(self._owners)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def _ensure_index(self, dim: int) -> None:
        if self._index is None:
            self._index = _faiss().IndexFlatIP(dim)
            self.dim = dim
        elif dim != self.dim:
            raise ConfigError(f"the embedder returned {dim}-dimensional vectors, the index holds {self.dim}")

    def _add(self, ids: Sequence[str], rows: Sequence[np.ndarray], terms: Sequence[Sequence[str]],
             digests: Sequence[str] | None, keys: Sequence[str] | None) -> None:
        if not (len(ids) == len(rows) == len(terms)):
            raise ConfigError(f"{len(ids)} ids for {len(rows)} vector groups and {len(terms)} term lists")
        if len(set(ids)) != len(ids):
            raise ConfigError("the same id was given twice in one add")
        with self._lock:
            replaced = [i for i in ids if i in self._pos]
            if replaced:
                self._remove(replaced)
            if not len(ids):
                return
            vecs = _normalized(np.concatenate([np.asarray(r, dtype=np.float32).reshape(-1, np.asarray(r).shape[-1])
                                               for r in rows]))
            self._ensure_index(vecs.shape[1])
            self._index.add(vecs)
            for j, bid in enumerate(ids):
                self._pos[bid] = len(self._ids)
                self._ids.append(bid)
                self._digests.append(digests[j] if digests is not None else "")
                self._keys.append(keys[j] if keys is not None else "")
                self._terms.append(" ".join(terms[j]))
                self._owners.extend([bid] * len(rows[j]))
            self._lex.add(terms)
            self._changed()

    def add_vectors(self, ids: Sequence[str], vectors: np.ndarray, *, digests: Sequence[str] | None = None,
                    keys: Sequence[str] | None = None, texts: Sequence[str] | None = None) -> None:
        """Add (or replace) entries with one precomputed vector each; rows are normalized here.
        ``texts`` (one per entry) feed the lexical index; without them an entry is routed by its vector."""
        vecs = np.asarray(vectors, dtype=np.float32)
        if vecs.ndim != 2 or len(ids) != len(vecs):
            raise ConfigError(f"{len(ids)} ids for vectors of shape {vecs.shape}")
        if texts is not None and len(texts) != len(ids):
            raise ConfigError(f"{len(ids)} ids for {len(texts)} texts")
        terms = [tokens(t) for t in texts] if texts is not None else [[] for _ in ids]
        self._add(ids, [vecs[j:j + 1] for j in range(len(ids))], terms, digests, keys)

    def add_documents(self, ids: Sequence[str], docs: Sequence[tuple[str, Optional[str], str]], *,
                      digests: Sequence[str] | None = None, keys: Sequence[str] | None = None) -> None:
        """Embed and add entries given as ``(name, when_to_use, text)``: the route text, the passages
        of the text (unless ``passages=False``) and the lexical terms (`route_parts()`).

        The store shares vectors with its other workers (`BlockStore.get_vectors` / ``put_vectors``,
        keyed by the embedder and the layout; a local store has none to share): it gives the rows it has, checked for their count and width, and gets
        the rows embedded here: a new worker embeds only what no worker embedded before."""
        parts = [route_parts(n, w, b) for n, w, b in docs]
        texts = [p[0] if self.use_passages else p[0][:1] for p in parts]
        shared = self.store.get_vectors if keys is not None and self.store is not None else None
        space = hashlib.sha256(json.dumps([self.embedder_id, self._layout()]).encode()).hexdigest()[:16]
        names = [f"{i}-{k}" for i, k in zip(ids, keys)] if keys is not None else []
        have = shared(space, names) if shared is not None else {}
        have = {n: v for n, v, ts in zip(names, [have.get(n) for n in names], texts)
                if v is not None and v.ndim == 2 and v.shape[0] == len(ts) and (self.dim is None or v.shape[1] == self.dim)}
        flat = [t for j, ts in enumerate(texts) if not names or names[j] not in have for t in ts]
        vecs = np.asarray(self.embedder.embed_batch(flat), dtype=np.float32) if flat else np.zeros((0, 1), dtype=np.float32)
        rows, at, new = [], 0, {}
        for j, ts in enumerate(texts):
            if names and names[j] in have:
                rows.append(np.asarray(have[names[j]], dtype=np.float32))
                continue
            rows.append(vecs[at:at + len(ts)])
            at += len(ts)
            if names:
                new[names[j]] = rows[-1]
        if shared is not None and new and self.store is not None:
            self.store.put_vectors(space, new)
        self._add(ids, rows, [p[1] for p in parts], digests, keys)

    def add_blocks(self, blocks: Sequence["Block"], *, persist: bool = True) -> None:
        """Embed blocks (route text, passages, lexical terms), add them, and write the index file.
        Document pages are left out (routed per passage by `graftmem.memory.pager`), and so are the
        server's automatic prefix blocks."""
        blocks = [b for b in blocks if b.kind not in UNROUTED_KINDS]
        if not blocks:
            return
        self.add_documents([b.id for b in blocks],
                           [(b.name, b.metadata.get("when_to_use"), block_body(b)) for b in blocks],
                           digests=[b.fingerprint.digest() for b in blocks],
                           keys=[entry_key(b.name, b.metadata.get("when_to_use")) for b in blocks])
        if persist:
            self.save()

    def _remove(self, ids: Sequence[str]) -> None:
        gone = {i for i in ids if i in self._pos}
        if not gone:
            return
        rows = [r for r, owner in enumerate(self._owners) if owner in gone]
        # IndexFlat.remove_ids compacts the remaining rows in order, so the parallel lists stay aligned
        self._index.remove_ids(np.asarray(rows, dtype=np.int64))
        self._owners = [o for o in self._owners if o not in gone]
        keep = [j for j, bid in enumerate(self._ids) if bid not in gone]
        self._ids = [self._ids[j] for j in keep]
        self._digests = [self._digests[j] for j in keep]
        self._keys = [self._keys[j] for j in keep]
        self._terms = [self._terms[j] for j in keep]
        self._lex.keep(keep)
        self._pos = {bid: j for j, bid in enumerate(self._ids)}
        self._changed()

    def remove(self, ids: Sequence[str], *, persist: bool = True) -> None:
        with self._lock:
            self._remove(ids)
            if persist:
                self.save()

    def _changed(self) -> None:
        self.generation += 1
        self._cache.clear()
        self._rows_of = None
        self._digest_arr = None

    def _clear(self) -> None:
        self._index = None
        self.dim = None
        self._ids, self._digests, self._keys, self._terms, self._owners = [], [], [], [], []
        self._pos = {}
        self._lex.clear()
        self._changed()

    # ------------------------------------------------------------------ consistency with the store
    def _data_version(self) -> int:
        # changes when *another* connection commits; this Memory's own writes go through
        # add_blocks/remove directly
        assert self.store is not None
        return self.store.data_version()

    def _store_rows(self) -> dict[str, tuple[str, str]]:
        """``{block id: (fingerprint digest, entry key)}`` for every block in the store."""
        assert self.store is not None
        rows = self.store.routing_rows(exclude_kinds=UNROUTED_KINDS)
        return {r[0]: (r[2], entry_key(r[1], r[3])) for r in rows}

    def sync(self, *, force: bool = False) -> bool:
        """Make the index equal to the store; cheap (one PRAGMA) when nothing changed. True if it changed."""
        if self.store is None:
            return False
        with self._lock:
            dv = self._data_version()
            if not force and dv == self._seen_version:
                return False
            rows = self._store_rows()
            mine = {bid: self._keys[j] for j, bid in enumerate(self._ids)}
            stale = [bid for bid, key in mine.items() if bid not in rows or rows[bid][1] != key]
            missing = [bid for bid in rows if bid not in mine or rows[bid][1] != mine[bid]]
            if stale:
                self._remove(stale)
            if missing:
                blocks = []
                for bid in missing:
                    try:
                        blocks.append(self.store.get(bid))
                    except StoreError:  # deleted meanwhile: the next sync drops it
                        continue
                self.add_blocks(blocks, persist=False)
            self._seen_version = dv
            if stale or missing:
                log.info("router synced with %s: %d added, %d dropped", self.store.home, len(missing),
                         len([s for s in stale if s not in rows]))
                self.save()
                return True
            return False

    def rebuild(self) -> int:
        """Forget every vector and embed every block of the store again; returns the entry count."""
        with self._lock:
            self._clear()
            self._seen_version = None
            self.sync(force=True)
            self.save()
            return len(self._ids)

    # ------------------------------------------------------------------ persistence
    def _layout(self) -> dict:
        """What the rows of a file depend on besides the embedder: a file built otherwise is rebuilt."""
        return {"passages": [PASSAGE_CHARS, MAX_PASSAGES] if self.use_passages else None,
                "text_chars": TEXT_CHARS, "lex_chars": LEX_CHARS}

    def save(self) -> None:
        """Write ``router/index.npz`` atomically: the serialized faiss index, the entries (ids, digests,
        keys, lexical terms) and the row -> entry map."""
        if self.path is None:
            return
        with self._lock:
            faiss = _faiss()
            blob = (faiss.serialize_index(self._index) if self._index is not None
                    else np.zeros(0, dtype=np.uint8))
            meta = {"version": INDEX_VERSION, "embedder": self.embedder_id, "dim": self.dim, **self._layout()}
            terms = np.frombuffer("\n".join(self._terms).encode("utf-8"), dtype=np.uint8)
            buf = io.BytesIO()
            np.savez(buf, faiss=np.asarray(blob, dtype=np.uint8), meta=np.asarray(json.dumps(meta)),
                     ids=np.asarray(self._ids, dtype="U64"), digests=np.asarray(self._digests, dtype="U64"),
                     keys=np.asarray(self._keys, dtype="U16"), owners=np.asarray(self._owners, dtype="U64"),
                     terms=terms)
            data = buf.getvalue()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        from ...store.local import atomic_file

        try:
            with atomic_file(self.path) as f:
                f.write(data)
        except OSError as exc:  # the index is a cache: failing to persist it costs a re-embed later
            log.warning("could not write the routing index %s: %s", self.path, exc)

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            with np.load(self.path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                layout = {k: meta.get(k) for k in self._layout()}
                if (meta.get("version") != INDEX_VERSION or meta.get("embedder") != self.embedder_id
                        or layout != json.loads(json.dumps(self._layout()))):
                    log.info("routing index %s was built by %s (v%s, %s); rebuilding for %s (v%s)", self.path,
                             meta.get("embedder"), meta.get("version"), layout, self.embedder_id, INDEX_VERSION)
                    return
                ids = [str(x) for x in z["ids"]]
                digests = [str(x) for x in z["digests"]]
                keys = [str(x) for x in z["keys"]]
                owners = [str(x) for x in z["owners"]]
                raw = bytes(z["terms"]).decode("utf-8")
                terms = raw.split("\n") if ids else []
                blob = z["faiss"]
                index = _faiss().deserialize_index(blob) if blob.size else None
        except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt from the store, never trusted
            log.warning("routing index %s is unreadable (%s); rebuilding it from the store", self.path, exc)
            return
        n = index.ntotal if index is not None else 0
        if (n != len(owners) or len(set(ids)) != len(ids) or len(terms) != len(ids)
                or len(digests) != len(ids) or len(keys) != len(ids) or set(owners) != set(ids)):
            log.warning("routing index %s is inconsistent (%d vectors, %d row owners, %d ids); rebuilding",
                        self.path, n, len(owners), len(ids))
            return
        self._clear()
        self._index, self.dim = index, meta.get("dim")
        self._ids, self._digests, self._keys, self._terms, self._owners = ids, digests, keys, terms, owners
        self._lex.add([t.split() for t in terms])
        self._pos = {bid: j for j, bid in enumerate(ids)}
        self._changed()

    # ------------------------------------------------------------------ queries
    def embed_task(self, task: str) -> np.ndarray:
        return _normalized(np.asarray(self.embedder.embed_batch([task])))

    def _entry_rows(self, bid: str) -> list[int]:
        if self._rows_of is None:
            rows: dict[str, list[int]] = {}
            for r, owner in enumerate(self._owners):
                rows.setdefault(owner, []).append(r)
            self._rows_of = rows
        return self._rows_of.get(bid, [])

    def _dense(self, q: np.ndarray, bids: Sequence[str]) -> list[float]:
        """Exact dense scores of some entries: route row (an entry's first) mixed with its best passage."""
        d = self._index.d
        mat = _faiss().rev_swig_ptr(self._index.get_xb(), self._index.ntotal * d).reshape(-1, d)  # no copy
        groups = [self._entry_rows(b) for b in bids]
        flat = np.fromiter((r for g in groups for r in g), dtype=np.int64)
        sims = mat[flat] @ q[0]
        out, at = [], 0
        w = self.route_weight
        for g in groups:
            s = sims[at:at + len(g)]
            at += len(g)
            out.append(float(s[0]) if len(s) == 1 else float(w * s[0] + (1.0 - w) * s[1:].max()))
        return out

    def search(self, task: str, top_k: int = 5, *, fingerprint_digest: Optional[str] = None,
               use_cache: bool = True) -> list[tuple[str, float]]:
        """``[(block id, score)]``, best first, at most ``top_k``; only blocks of ``fingerprint_digest``
        when given. The score is ``dense + lex_weight * coverage``: the cosine of the block's best
        row plus the weighted lexical coverage. Recurring tasks (same normalized text, index unchanged)
        are answered from the exact-lookup cache without embedding.

        Candidates are the union of the dense top rows and the lexical top entries; each candidate is
        scored exactly on both, so the top-1 is exact unless a block is in neither list."""
        if top_k < 1:
            raise ConfigError(f"top_k must be at least 1, got {top_k}")
        self.sync()
        key = (fingerprint_digest or "", top_k, normalize_task(task))
        if use_cache:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return list(hit)
                gen = self.generation
        q = self.embed_task(task)  # outside the lock: the expensive part runs concurrently
        with self._lock:
            if self._index is None or not self._ids:
                return []
            if fingerprint_digest is not None:
                if self._digest_arr is None:
                    self._digest_arr = np.asarray(self._digests)
                allowed = self._digest_arr == fingerprint_digest
                n_allowed = int(allowed.sum())
            else:
                allowed, n_allowed = None, len(self._ids)
            if n_allowed == 0:
                return []
            want = min(top_k, n_allowed)
            nrows = len(self._owners)
            k = min(nrows, max(self.depth, top_k * 8))
            cands: dict[str, None] = {}  # ordered set
            while True:
                _, rows = self._index.search(q, k)
                cands.clear()
                for r in rows[0]:
                    if r >= 0:
                        bid = self._owners[r]
                        if allowed is None or allowed[self._pos[bid]]:
                            cands[bid] = None
                if len(cands) >= want or k >= nrows:
                    break
                k = min(nrows, k * 4)  # other fingerprints (or one block's many rows) crowded the top
            cov: Optional[np.ndarray] = None
            if self.lex_weight > 0 and len(self._lex):
                cov = self._lex.coverage(task)
                if allowed is not None:
                    cov = np.where(allowed, cov, 0.0)
                m = min(len(cov), max(self.depth // 4, top_k * 2))
                top = np.argpartition(-cov, m - 1)[:m] if m < len(cov) else np.arange(len(cov))
                for j in top:
                    if cov[j] > 0:
                        cands[self._ids[j]] = None
            bids = list(cands)
            dense = self._dense(q, bids)
            hits = [(bid, d + (self.lex_weight * float(cov[self._pos[bid]]) if cov is not None else 0.0))
                    for bid, d in zip(bids, dense)]
            hits.sort(key=lambda h: -h[1])
            hits = hits[:top_k]
            if use_cache and gen == self.generation:
                self._cache[key] = hits
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return list(hits)
