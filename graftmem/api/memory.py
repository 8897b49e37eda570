"""Memory: the thin coordinator an application holds. It owns one engine and one store and turns
the verbs (learn, ask, get, delete, verify, stats) into engine and store calls. No llama.cpp here.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sqlite3
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Sequence

from ..core.blocks import (Block, EngineConfig, Exactness, Fingerprint, HistoryEvent, Recall, Scope, SearchHit,
                           StoreStats, VerifyReport)
from ..core.decoding import Sampling
from ..core.engine import Engine
from ..core.blocks import PROVENANCE_REDERIVED, PROVENANCE_UNVERIFIED
from ..core.errors import BlockNotFound, ClosedError, ConfigError, GraftmemError
from ..core.segments import detect_format, no_format_reason
from ..memory import validate as check
from ..memory.access import Access
from ..memory.answer import OnText
from ..memory.exactness import record_verification
from ..memory.learn import default_name
from ..memory.pager import DEFAULT_OVERLAP, PageIndex, learn_document
from ..memory.verbs import MemoryVerbs
from ..memory.rederive import RederiveReport, rederive as _rederive, rederive_state
from ..memory.router import Embedder, Router, SentenceTransformerEmbedder
from ..server.blocks import BlockServer
from ..server.config import ServeConfig
from ..server.pool import pool_engines
from ..server.runner import ServerThread
from ..server.service import api_server, block_server
from ..share.bundle import export as export_bundle
from ..share.bundle import import_bundle
from ..share.client import pull, push
from ..share.admission import Vetting
from ..share.manifest import ExportReport, TransferReport
from ..share.trust import SigningKey, TrustPolicy
from ..store.fleet import open_store
from ..store.protocol import BlockStore
from ..store.scopes import ScopeIndex
from .stream import AnswerStream

if TYPE_CHECKING:
    from ..memory.pager import DocumentAnswer, DocumentReport, Source

__all__ = ["Memory"]

log = logging.getLogger("graftmem")

#: Where a fleet's workers publish their documents' page indexes (one SQLite file per document and
#: engine, `PageIndex.export_document`), as `FleetStore.put_file` names.
PAGE_DOCS = "pages/docs/"

#: The largest n_ctx llama.cpp can be asked for (its context parameters are 32-bit): a larger value
#: would wrap around silently (2**32 + 128 ran with 256).
MAX_N_CTX = 2**31 - 1
_INCOMPATIBLE = ("refuse", "keep-apart", "skip")


# argument checks (before any work): one module for every door (graftmem.memory.validate)
_scope, _text, _int, _flag, _score = check.scope, check.text, check.integer, check.flag, check.score
_choice, _ids, _metadata, _path, _instance = check.choice, check.ids, check.metadata, check.path, check.instance


class Memory:
    """An agent memory made of verified KV-cache blocks.

    ```python
    with Memory() as mem:
        block = mem.learn("Refunds: always ask for the order number first.", name="refunds")
        print(mem.ask(block.id, "\\nQ: what do I ask first?\\nA:").text)
    ```

    ``model`` is a short name (``"smollm2"``, ``"gemma3-270m"``) or a GGUF path; ``home`` the store
    directory (default ``$GRAFTMEM_HOME`` or the user data dir); ``config`` an [`EngineConfig`][graftmem.EngineConfig]
    or a dict of its fields (unknown keys are an error). ``engine`` shares an already loaded
    [`Engine`][graftmem.Engine] between stores (the Memory then does not close it); ``embedder`` replaces the
    packaged MiniLM for routing. ``store`` instead of ``home``: a directory, ``"s3://bucket/prefix"``
    (a fleet store in S3-compatible object storage with a local cache, docs/fleet.md; also
    ``$GRAFTMEM_STORE``) or an open store (a [`Store`][graftmem.Store], a [`FleetStore`][graftmem.FleetStore]
    or anything else that implements [`BlockStore`][graftmem.store.BlockStore]; left open at ``close``).

    The Memory owns its resources (engine, store, embedder, router, page index) and exposes them as
    properties; every verb hands them explicitly to the feature that does the work
    (`graftmem.memory`, `graftmem.share`), so the features never reach into this object.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *,
                 home: str | os.PathLike[str] | None = None,
                 config: EngineConfig | Mapping[str, Any] | None = None,
                 engine: Engine | None = None, embedder: Embedder | None = None,
                 store: "str | os.PathLike[str] | BlockStore | None" = None) -> None:
        if engine is not None and (model is not None or config is not None):
            raise ConfigError("pass either engine= or model=/config=, not both")
        if store is not None and home is not None:
            raise ConfigError("pass either home= (a directory) or store= (a directory, s3://bucket/prefix "
                              "or a Store), not both")
        if store is None and home is None and os.environ.get("GRAFTMEM_STORE"):
            store = os.environ["GRAFTMEM_STORE"]
        if store is not None and not isinstance(store, BlockStore):
            _path("store", store)
        if model is not None:
            _path("model", model)
        if home is not None:
            _path("home", home)
        _instance("engine", engine, Engine)
        if config is not None:
            config = EngineConfig.coerce(config)  # a typo fails here, before the store is opened
        if config is not None and config.n_ctx > MAX_N_CTX:
            raise ConfigError(f"n_ctx={config.n_ctx} is beyond what llama.cpp can address ({MAX_N_CTX}); "
                              "give a context the model and memory allow (e.g. 8192)")
        self._owns_store = not isinstance(store, BlockStore)  # a store passed in stays open
        if isinstance(store, BlockStore):
            self._store: BlockStore = store
        else:
            self._store = open_store(store if store is not None else home)
        self._owns_engine = engine is None
        try:
            self._engine = engine if engine is not None else Engine(model, config)
            if config is not None and engine is None and self._engine.n_ctx < config.n_ctx:
                raise ConfigError(f"n_ctx={config.n_ctx} was asked for, llama.cpp gave "
                                  f"{self._engine.n_ctx}: the model or llama.cpp cannot give that context; "
                                  "ask for a smaller n_ctx")
        except BaseException:
            if engine is None and getattr(self, "_engine", None) is not None:
                self._engine.close()
            if self._owns_store:
                self._store.close()
            raise
        self._closed = False
        #: the verbs with their rules (checks, consent, provenance stamp), shared with the server's doors
        self._verbs = MemoryVerbs(self._engine, self._store)
        #: who sees what (`graftmem.memory.access`): the operator's view, every block and every scope
        self._access = Access(self._store, scopes=lambda: self.scopes, operator=True)
        # routing loads torch and MiniLM (seconds): created on the first recall/search, never by learn/ask
        self._embedder = embedder
        self._router: Optional[Router] = None
        self._pages: Optional[PageIndex] = None
        self._pages_synced: set[str] = set()  #: the fleet's document index files merged (name@etag)
        self._pages_synced_at = -math.inf
        self._scopes: Optional[ScopeIndex] = None
        self._lazy_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the engine (when this Memory loaded it), the page index and the store. Idempotent."""
        if not self._closed:
            self._closed = True
            if self._pages is not None:
                self._pages.close()
            if self._scopes is not None:
                self._scopes.close()
            if self._owns_engine:
                self._engine.close()
            if self._owns_store:
                self._store.close()

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("this Memory is closed; open a new one")

    # ------------------------------------------------------------------ resources
    @property
    def engine(self) -> Engine:
        """The llama.cpp engine (model + context) every graft and prefill runs in."""
        return self._engine

    @property
    def store(self) -> BlockStore:
        """The block store this memory learns into and grafts from: the local directory (``home``) or,
        for ``store="s3://..."``, the bucket behind its local cache (a [`FleetStore`][graftmem.FleetStore])."""
        return self._store

    @property
    def fingerprint(self) -> Fingerprint:
        """The engine's identity; blocks of another fingerprint are never grafted here."""
        return self._engine.fingerprint

    @property
    def exactness(self) -> Exactness:
        """Whether grafts in this engine configuration are byte-exact (static rule + load-time probe)."""
        return self._engine.exactness

    @property
    def router_loaded(self) -> bool:
        """Whether the router (torch + MiniLM) has been loaded; ``learn`` and ``ask`` never load it."""
        return self._router is not None

    @property
    def embedder(self) -> Embedder:
        """The text embedder of routing (the packaged MiniLM unless one was given), loaded on first use."""
        self._check()
        with self._lazy_lock:
            if self._embedder is None:
                self._embedder = SentenceTransformerEmbedder()
            return self._embedder

    @property
    def router(self) -> Router:
        """The routing index over this store's blocks, created (and synced with the store) on first use."""
        self._check()
        embedder = self.embedder
        with self._lazy_lock:
            if self._router is None:
                self._router = Router(embedder, self._store)
            return self._router

    @property
    def scopes(self) -> ScopeIndex:
        """Who owns which block (user / agent / session) and each block's history, opened on first use."""
        self._check()
        with self._lazy_lock:
            if self._scopes is None:
                self._scopes = ScopeIndex(self._store.home, timeout=self._store.lock_timeout)
            return self._scopes

    def _filter(self, scope: Scope, filters: Optional[Mapping[str, Any]],
                kind: Optional[str] = None) -> Optional[Callable[[Block], bool]]:
        """A block predicate for a scope, metadata filters (exact values) and a kind; None if no filter.
        The rule is `graftmem.memory.access.Access`'s (the one the server's doors use), in the operator's
        view: this process owns the home, so it sees every block and every tenant's scopes."""
        return self._access.allow(scope, filters, kind)

    @property
    def pages(self) -> PageIndex:
        """The passage index of long documents (`learn_document()`), opened on first use."""
        self._check()
        embedder = self.embedder
        with self._lazy_lock:
            if self._pages is None:
                self._pages = PageIndex(self._store.home, embedder)
            pages = self._pages
        self._sync_pages()
        return pages

    # ------------------------------------------------------------------ a fleet's page indexes
    def _sync_pages(self, *, force: bool = False) -> int:
        """On a store shared with other workers (``store.remote``: a fleet store), merge the document
        indexes they published beside the blocks (``pages/docs/``) that this worker has not merged yet; at most once per the store's
        ``poll_interval`` unless ``force``. Returns the passages added. A file that cannot be read or
        merged is logged and skipped (routing then misses that document, nothing else changes)."""
        store = self._store
        if not store.remote or self._pages is None:
            return 0
        now = time.monotonic()
        with self._lazy_lock:
            if not force and now - self._pages_synced_at < store.poll_interval:
                return 0
            self._pages_synced_at = now
        added = 0
        for f in store.list_files(PAGE_DOCS):
            name = f["name"]
            tag = f"{name}@{f['e_tag'] or f['size']}"
            if tag in self._pages_synced or not name.endswith(".sqlite"):
                continue
            with tempfile.TemporaryDirectory(prefix="graftmem-pages-") as tmp:
                local = Path(tmp) / "index.sqlite"
                try:
                    if store.get_file(name, local):
                        added += self._pages.merge_from(local)
                except (sqlite3.Error, GraftmemError, OSError) as exc:
                    log.warning("%r: shared document index %s not merged: %s", store, name, exc)
                    continue
            self._pages_synced.add(tag)
        if added:
            log.info("%r: %d passages of other workers' documents merged", store, added)
        return added

    def _publish_pages(self, document: str) -> None:
        """On a store shared with other workers (``store.remote``), publish this document's index rows
        beside the blocks for them."""
        store = self._store
        if not store.remote:
            return
        fpd = self._engine.fingerprint.digest()
        name = f"{hashlib.sha256(document.encode()).hexdigest()[:32]}-{fpd[:16]}.sqlite"
        with tempfile.TemporaryDirectory(prefix="graftmem-pages-") as tmp:
            local = Path(tmp) / "index.sqlite"
            self.pages.export_document(document, fpd, local)
            store.put_file(PAGE_DOCS + name, local)

    # ------------------------------------------------------------------ learn
    def learn(self, text: "str | Sequence[Mapping[str, Any]]", *, name: Optional[str] = None,
              kind: str = "manual", metadata: Optional[Mapping[str, Any]] = None, progress: bool = False,
              when_to_use: Optional[str] = None, chat: bool = False, parent: Optional[str] = None,
              user_id: Optional[str] = None, agent_id: Optional[str] = None,
              session_id: Optional[str] = None) -> Block:
        """Prefill ``text`` once and store its KV state as a block (deduplicated by content).

        ``text`` may also be a list of chat messages (``[{"role": "user", "content": "I like tea"}]``,
        the shape the OpenAI API and mem0 use): they are rendered with the model's chat template and
        stored as a chat block, so that `recall()` continues the conversation with the task as the
        next user turn.

        ``parent`` (a block id) chains the text on that block: the parent is grafted, ``text`` is
        tokenized without BOS and prefilled at positions ``parent.pos_end..``, and the child is
        stored as a delta (its new cells only) when the state layout allows; grafting the child
        equals a fresh sequential prefill of every text of the chain, byte for byte. A shared system
        prompt learned once with many manuals chained on it is the intended use.

        ``when_to_use`` describes the tasks this block serves; the router embeds it with the name and
        the start of the text. ``chat=True`` stores the text as a complete chat turn of the model's
        template (see `graftmem.core.prompt`), so that `recall()` can append a task as the next
        turn and still match a fresh prefill of the whole prompt token for token.

        ``user_id``, ``agent_id`` and ``session_id`` scope the block: `get_all()`, `search()`
        and `recall()` given a scope see only the blocks learned in it. The same text learned in two
        scopes is one block (one prefill) owned by both.

        A text whose block is already here is not prefilled again, unless that block is
        ``unverified`` (it came from elsewhere unchecked): then this engine's own prefill replaces it.
        ``name``/``when_to_use`` given for a block whose labels came from elsewhere make them this
        store's own (trusted, routed).
        """
        self._check()
        scope = _scope(user_id, agent_id, session_id)
        if not isinstance(text, (str, bytes, bytearray)):
            text, name, metadata = self._render_messages(text, name, metadata, chat)
        started = datetime.now(timezone.utc)
        block, changed = self._verbs.learn(text, name=name, kind=kind, metadata=metadata, progress=progress,
                                           when_to_use=when_to_use, chat=chat, parent=parent)
        self._access.own(block, scope, changed, started)
        if self._router is not None and changed:
            self._router.add_blocks([block])
        return block

    def _render_messages(self, messages: Any, name: Optional[str], metadata: Optional[Mapping[str, Any]],
                         chat: bool) -> tuple[str, Optional[str], dict[str, Any]]:
        if isinstance(messages, (bytes, bytearray)) or not isinstance(messages, Sequence) or not messages:
            raise ConfigError("learn() takes a text or a non-empty list of chat messages "
                              f"([{{'role': 'user', 'content': '...'}}]), got {type(messages).__name__}")
        if chat:
            raise ConfigError("chat=True wraps a text in a chat turn; messages are chat turns already")
        fmt = detect_format(self._engine)
        if fmt is None:
            raise ConfigError(f"model {self.fingerprint.model_name!r} cannot learn chat messages: "
                              f"{no_format_reason(self._engine)}; learn the conversation as a text")
        text = fmt.render(messages)
        last_user = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), text)
        meta = {**dict(metadata or {}), "chat_format": fmt.name}
        if fmt.template is not None:
            meta["chat_parts"] = fmt.parts
        return text, name or default_name(last_user), meta

    add = learn

    # ------------------------------------------------------------------ ask
    def ask(self, block_id: str, query: str, *, max_tokens: int = 64,
            sampling: Optional[Sampling] = None, stop: "str | Sequence[str] | None" = None,
            allow_unverified: bool = False, response_format: Optional[Mapping[str, Any]] = None) -> Recall:
        """Graft the block at its own positions, prefill ``query``, and answer (greedily by default).

        ``stop`` ends the answer at the first of these strings (cut from ``text``, ``finish_reason``
        ``"stop"``). A block (or an ancestor of a chained one) whose provenance is ``unverified`` is
        refused with `UnverifiedBlock` unless ``allow_unverified=True``: its state may not be its
        text's. The receipt names the grafted block's provenance. ``response_format`` as OpenAI's
        (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``):
        the answer is decoded under a grammar that only lets such JSON through (the logits, hence the
        exactness of the graft, are untouched)."""
        return self._ask_call(block_id, query, max_tokens, sampling, stop, allow_unverified, response_format)(None)

    def ask_stream(self, block_id: str, query: str, *, max_tokens: int = 64,
                   sampling: Optional[Sampling] = None, stop: "str | Sequence[str] | None" = None,
                   allow_unverified: bool = False, response_format: Optional[Mapping[str, Any]] = None) -> AnswerStream:
        """[`ask()`][graftmem.Memory.ask], with the answer's text handed out as it is decoded.

        Arguments are checked (and the block refused) here, before anything runs; iterate the
        returned [`AnswerStream`][graftmem.AnswerStream] for the text, read its ``result``
        for the whole `Recall` and receipt, ``close()`` it to stop early."""
        return AnswerStream(self._ask_call(block_id, query, max_tokens, sampling, stop, allow_unverified,
                                           response_format))

    def _ask_call(self, block_id: str, query: str, max_tokens: int, sampling: Optional[Sampling],
                  stop: "str | Sequence[str] | None", allow_unverified: bool,
                  response_format: Optional[Mapping[str, Any]] = None) -> Callable[[Optional[OnText]], Recall]:
        """Check the arguments of ask (and the block's consent); return the call that answers."""
        self._check()
        return self._verbs.prepare_ask(block_id, query, max_tokens=max_tokens, sampling=sampling, stop=stop,
                                       allow_unverified=allow_unverified, response_format=response_format)

    # ------------------------------------------------------------------ routing
    def search(self, task: str, *, top_k: int = 5, limit: Optional[int] = None,
               filters: Optional[Mapping[str, Any]] = None, kind: Optional[str] = None,
               user_id: Optional[str] = None, agent_id: Optional[str] = None,
               session_id: Optional[str] = None) -> list[SearchHit]:
        """Rank this engine's blocks for ``task`` (best first) without restoring anything.

        ``limit`` is another name for ``top_k`` (mem0's). ``filters`` keeps blocks whose metadata has
        each given value; ``kind`` and the scope (``user_id``, ``agent_id``, ``session_id``) narrow too.
        """
        self._check()
        _text("task", task)
        if limit is not None:
            _int("limit", limit, lo=1)
            top_k = limit
        _int("top_k", top_k, lo=1)
        allow = self._filter(_scope(user_id, agent_id, session_id), filters, kind)
        return self._verbs.search(self.router, task, top_k=top_k, allow=allow)

    def recall(self, task: str, *, max_tokens: int = 64, min_score: Optional[float] = None,
               mode: Literal["graft", "text"] = "graft", sampling: Optional[Sampling] = None,
               stop: "str | Sequence[str] | None" = None,
               allow_unverified: bool = False, filters: Optional[Mapping[str, Any]] = None,
               user_id: Optional[str] = None, agent_id: Optional[str] = None,
               session_id: Optional[str] = None, response_format: Optional[Mapping[str, Any]] = None) -> Recall:
        """Route ``task`` to ONE block, graft it, prefill the task, answer.

        Below ``min_score`` (default `DEFAULT_MIN_SCORE`) nothing is grafted:
        ``block`` is None and the text says so. ``mode="text"`` answers the same prompt the old way
        (prefill the block's text, no graft), for comparisons; the answers are identical. ``stop`` as
        in [`ask()`][graftmem.Memory.ask], and ``response_format`` too.

        Routing only ever considers blocks whose provenance is not ``unverified`` and whose labels
        were given here or signed by a trusted key (see docs/security.md); a routed block found
        unverified meanwhile is refused unless ``allow_unverified=True``.
        """
        return self._recall_call(task, max_tokens, min_score, mode, sampling, stop, allow_unverified, filters,
                                 user_id, agent_id, session_id, response_format)(None)

    def recall_stream(self, task: str, *, max_tokens: int = 64, min_score: Optional[float] = None,
                      mode: Literal["graft", "text"] = "graft", sampling: Optional[Sampling] = None,
                      stop: "str | Sequence[str] | None" = None,
                      allow_unverified: bool = False, filters: Optional[Mapping[str, Any]] = None,
                      user_id: Optional[str] = None, agent_id: Optional[str] = None,
                      session_id: Optional[str] = None,
                      response_format: Optional[Mapping[str, Any]] = None) -> AnswerStream:
        """[`recall()`][graftmem.Memory.recall], with the answer's text handed out as it is decoded
        (an [`AnswerStream`][graftmem.AnswerStream]; a recall that matches no block yields no
        text and its ``result`` says why)."""
        return AnswerStream(self._recall_call(task, max_tokens, min_score, mode, sampling, stop, allow_unverified,
                                              filters, user_id, agent_id, session_id, response_format))

    def _recall_call(self, task: str, max_tokens: int, min_score: Optional[float], mode: str,
                     sampling: Optional[Sampling], stop: "str | Sequence[str] | None", allow_unverified: bool,
                     filters: Optional[Mapping[str, Any]], user_id: Optional[str], agent_id: Optional[str],
                     session_id: Optional[str],
                     response_format: Optional[Mapping[str, Any]] = None) -> Callable[[Optional[OnText]], Recall]:
        """Check the arguments of recall; return the call that routes, asks consent before the graft,
        and answers."""
        self._check()
        _text("task", task)
        allow = self._filter(_scope(user_id, agent_id, session_id), filters)
        return self._verbs.prepare_recall(lambda: self.router, task, max_tokens=max_tokens, min_score=min_score,
                                          mode=mode, sampling=sampling, stop=stop,
                                          allow_unverified=allow_unverified, allow=allow,
                                          response_format=response_format)

    def reindex(self) -> int:
        """Rebuild the routing index from the store (every block embedded again); returns its size."""
        self._check()
        return self.router.rebuild()

    # ------------------------------------------------------------------ long documents
    def learn_document(self, source: "Source", *, document: Optional[str] = None, name: Optional[str] = None,
                       window: Optional[int] = None, overlap: Optional[int] = None,
                       progress: bool = True) -> "DocumentReport":
        """Cut a long document (a path, a text or an iterable of texts) into pages that fit the window,
        prefill and store each page as a block of kind ``page`` and index its passages for routing.

        Resumable: pages already stored are skipped, so a rerun after a crash or Ctrl-C continues
        where the build stopped. ``window`` defaults to ``n_ctx - 256`` tokens (room for the question).
        """
        self._check()
        if isinstance(source, (bytes, bytearray)):
            raise ConfigError("source must be a path, a str or an iterable of str; decode bytes first")
        if isinstance(source, str):
            _text("source", source)
        _text("document", document, optional=True)
        _text("name", name, optional=True)
        _int("window", window, lo=16, optional=True)
        _int("overlap", overlap, lo=0, optional=True)
        _flag("progress", progress)
        report = learn_document(self._engine, self._store, self.pages, source, document=document, name=name,
                                window=window, overlap=DEFAULT_OVERLAP if overlap is None else overlap,
                                progress=progress)
        self._publish_pages(report.document)
        return report

    def recall_document(self, task: str, *, prompt: Optional[str] = None, document: Optional[str] = None,
                        max_tokens: int = 32, min_score: Optional[float] = None,
                        allow_unverified: bool = False) -> "DocumentAnswer":
        """Route ``task`` to the passage that answers it, graft ONLY its page and answer after ``prompt``
        (default: a blank line and the task); the answer says which page and where in the document.

        A page nothing here vouches for (imported without re-derivation) is refused
        ([`UnverifiedBlock`][graftmem.UnverifiedBlock]) before it is grafted, unless
        ``allow_unverified=True``; ``answer.recall.receipt.provenance`` names what was grafted."""
        self._check()
        _text("task", task)
        _text("prompt", prompt, optional=True, empty=True)
        _text("document", document, optional=True)
        _int("max_tokens", max_tokens, lo=1)
        _score("min_score", min_score)
        _flag("allow_unverified", allow_unverified)
        pages = self.pages
        if document is not None and self._store.remote and not any(
                d["id"] == document for d in pages.documents()):
            self._sync_pages(force=True)  # published by another worker since the last look
        return self._verbs.recall_document(pages, task, prompt=prompt, document=document, max_tokens=max_tokens,
                                           min_score=min_score, allow_unverified=allow_unverified)

    # ------------------------------------------------------------------ store verbs
    def get(self, block_id: str) -> Block:
        """The block with this id (or unique id prefix); [`BlockNotFound`][graftmem.BlockNotFound] otherwise. Its
        ``provenance`` says what this store knows of where its state came from."""
        self._check()
        _text("block_id", block_id)
        return self._store.get(block_id)

    def get_all(self, *, kind: Optional[str] = None, filters: Optional[Mapping[str, Any]] = None,
                user_id: Optional[str] = None, agent_id: Optional[str] = None,
                session_id: Optional[str] = None) -> list[Block]:
        """Every block in the store (of ``kind``, with the ``filters`` metadata values, in the scope),
        whatever engine made it."""
        self._check()
        _text("kind", kind, optional=True)
        allow = self._filter(_scope(user_id, agent_id, session_id), filters)
        return [b for b in self._store.list(kind=kind) if allow is None or allow(b)]

    def delete(self, block_id: str, *, cascade: bool = False) -> list[str]:
        """Delete a block; return the ids deleted. A block with chained children is refused
        ([`ConfigError`][graftmem.ConfigError]) unless ``cascade=True``, which deletes its descendants too."""
        self._check()
        _text("block_id", block_id)
        _flag("cascade", cascade)
        bid = self._store.resolve(block_id)
        gone = self._store.delete(bid, cascade=cascade)
        if self._router is not None:
            self._router.remove(gone)
        self._access.forget(gone, cascade_from=bid)
        return gone

    def history(self, block_id: str) -> list[HistoryEvent]:
        """What happened to a block, oldest first: learned (and by whom), learned again, verified,
        deleted. Works for deleted blocks too (by full id)."""
        self._check()
        try:
            bid = self._store.resolve(block_id)
        except BlockNotFound:
            bid = block_id
        return self.scopes.history(bid)

    def reset(self) -> list[str]:
        """Delete every block of the store (all engines, all scopes); returns the ids deleted.
        The history is kept, so `history()` still says what was there."""
        self._check()
        gone: list[str] = []
        for b in self._store.list():
            if self._store.contains(b.id):  # not already gone with an ancestor's cascade
                gone += self.delete(b.id, cascade=True)
        self.scopes.reset()
        return gone

    def stats(self) -> StoreStats:
        """Counts and sizes of the store: blocks, tokens, bytes on disk, bytes per token, kinds."""
        self._check()
        return self._store.stats()

    # ------------------------------------------------------------------ verification
    def verify(self, block_id: str, *, samples: int = 50, cross_process: bool = True,
               record: bool = True) -> VerifyReport:
        """Prove graft == fresh prefill for ``samples`` queries (see `graftmem.memory.exactness`).
        ``samples`` must be at least 1: zero samples prove nothing and are never recorded as verified."""
        self._check()
        _text("block_id", block_id)
        _int("samples", samples, lo=1, hi=10_000)
        _flag("cross_process", cross_process)
        _flag("record", record)
        # the operator's: a block nothing here vouches for is verified too (the operator owns the home)
        report = self._verbs.verify(block_id, samples=samples, cross_process=cross_process, allow_unverified=True)
        if record and not self._store.read_only:
            record_verification(self._store, self.scopes, report)
        return report

    def rederive(self, block_id: str) -> RederiveReport:
        """Re-prefill the block's own tokens (a chained block: its whole chain, call by call) and compare
        the state with the stored bytes. An ``unverified`` block whose state proves equal becomes
        ``rederived`` (grafted without consent from then on; its labels stay as they were)."""
        self._check()
        _text("block_id", block_id)
        rep = _rederive(self._engine, self._store, block_id)
        if rep.ok and not self._store.read_only and self._store.provenance(rep.block_id) == PROVENANCE_UNVERIFIED:
            self._store.set_provenance(rep.block_id, PROVENANCE_REDERIVED)
        return rep

    # ------------------------------------------------------------------ sharing
    def vetting(self, *, rederive: bool = True, progress: bool = False) -> Vetting:
        """This engine's checks for the admission of foreign blocks, for a server that admits pushes
        (``graftmem serve``): the text must tokenize here to the stored tokens (always), and with
        ``rederive`` every new block is re-prefilled here and its state compared byte for byte (else it
        lands ``unverified``). :meth:`import_bundle`, :meth:`pull` and :meth:`serve` use it."""
        eng = self._engine

        def tokenize(block: Block) -> list[int]:
            return eng.tokenize(block.text, add_special=block.parent is None)

        def rederive_one(block: Block, state: memoryview, segs: list[list[int]]) -> None:
            rederive_state(eng, block, state, segs)

        return Vetting(tokenize=tokenize, rederive=rederive_one if rederive else None, progress=progress)

    def _transfer_args(self, incompatible: Any, policy: Any, rederive: Any, progress: Any) -> None:
        _choice("incompatible", incompatible, _INCOMPATIBLE)
        _instance("policy", policy, TrustPolicy)
        _flag("rederive", rederive)
        _flag("progress", progress)

    def export(self, path: str | os.PathLike[str], block_ids: Optional[list[str]] = None, *,
               kind: Optional[str] = None, where: Optional[Callable[[Block], bool]] = None,
               sign_key: Optional[SigningKey] = None, progress: bool = False) -> ExportReport:
        """Write blocks (by id or prefix, else all, narrowed by ``kind`` and the ``where`` filter)
        to one bundle file that another machine can import."""
        self._check()
        _path("path", path)
        _ids("block_ids", block_ids)
        _text("kind", kind, optional=True)
        if where is not None and not callable(where):
            raise ConfigError(f"where must be a callable(Block) -> bool, got {type(where).__name__}")
        _instance("sign_key", sign_key, SigningKey)
        _flag("progress", progress)
        return export_bundle(self._store, path, block_ids, kind=kind, where=where, sign_key=sign_key,
                              progress=progress)

    def import_bundle(self, path: str | os.PathLike[str], *, incompatible: str = "refuse",
                      policy: Optional[TrustPolicy] = None, rederive: bool = True,
                      progress: bool = False) -> TransferReport:
        """Import a bundle, every digest checked, all or nothing; blocks of another engine are refused
        (or kept apart / skipped). ``policy`` defaults to ``<home>/trust.json``.

        Trust by default: each block's text must tokenize to its tokens and its positions must follow
        its parent's; a bundle signed by a key the policy trusts lands as ``signed:<key>``; otherwise
        every new block is re-prefilled here (one prefill per block, once per machine) and the bundle
        is refused unless each state is byte-equal (``rederived``). ``rederive=False`` skips that
        prefill: the blocks land ``unverified``, never grafted without ``allow_unverified=True``,
        never routed, never deduplicated onto by ``learn``."""
        self._check()
        _path("path", path)
        self._transfer_args(incompatible, policy, rederive, progress)
        return import_bundle(self._store, path, fingerprint=self.fingerprint, policy=policy,
                             incompatible=incompatible, progress=progress,  # type: ignore[arg-type]
                             check=self.vetting(rederive=rederive, progress=progress))

    def pull(self, url: str, block_ids: Optional[list[str]] = None, *, kind: Optional[str] = None,
             incompatible: str = "refuse", policy: Optional[TrustPolicy] = None,
             rederive: bool = True, progress: bool = False, api_key: Optional[str] = None) -> TransferReport:
        """Copy blocks from a ``graftmem serve`` at ``url``: checked as they arrive, resumable;
        provenance as for `import_bundle()` (a listing signed by a trusted key: ``signed``; else
        re-derived here by default, or ``unverified`` with ``rederive=False``). ``api_key``: the
        server's key, if it has one (with tenants: that tenant's blocks and the shared ones)."""
        self._check()
        _text("url", url)
        _ids("block_ids", block_ids)
        _text("kind", kind, optional=True)
        self._transfer_args(incompatible, policy, rederive, progress)
        _text("api_key", api_key, optional=True)
        return pull(self._store, url, block_ids, fingerprint=self.fingerprint, kind=kind,
                    incompatible=incompatible, policy=policy, progress=progress,  # type: ignore[arg-type]
                    check=self.vetting(rederive=rederive, progress=progress), api_key=api_key)

    def push(self, url: str, block_ids: Optional[list[str]] = None, *, token: str,
             kind: Optional[str] = None, sign_key: Optional[SigningKey] = None,
             progress: bool = False) -> TransferReport:
        """Send blocks to a ``graftmem serve`` that accepts pushes (it imports them all or nothing, and
        re-derives them unless it trusts ``sign_key``)."""
        self._check()
        _text("url", url)
        _ids("block_ids", block_ids)
        _text("token", token)
        _text("kind", kind, optional=True)
        _instance("sign_key", sign_key, SigningKey)
        _flag("progress", progress)
        return push(self._store, url, block_ids, token=token, kind=kind, sign_key=sign_key,
                            progress=progress)

    def serve(self, config: Optional[ServeConfig] = None, /, *, runner: Optional[ServerThread] = None,
              **options: Any) -> BlockServer:
        """An HTTP server over this store, with the options of ``config`` (a `ServeConfig`; the
        defaults when None) and ``options`` applied on top (``mem.serve(api=True, port=8765)`` builds
        the config from keywords; an unknown option is a `ConfigError`). Not started: ``.start()``
        serves it in a background thread and returns at once (``.url`` is known from construction,
        ``.close()`` stops it gracefully), a ``with`` block does both, ``.serve_forever()`` blocks.

        Pushed blocks are admitted like an import: texts bound to tokens, positions checked, and
        re-derived here before they are accepted unless the pushed bundle is signed by a key this
        store's trust policy lists; ``rederive=False`` lands unsigned pushes ``unverified``.

        ``api=True`` adds what ``graftmem serve`` answers (it calls this): the OpenAI-compatible,
        Responses and Anthropic APIs (this memory's engine, its persistent prefix cache: prefixes of
        ``min_prefix_tokens`` tokens seen ``sightings`` times are learned) and the memory's REST routes
        (with this memory's router), so an agent written against the ``openai`` package can run in the
        same process as the app; ``api_key`` then guards every route. The engine is shared with this
        `Memory` (its calls and the server's requests take turns); ``engines=N`` opens N - 1 more
        engines of the same model and config for the server, closed when it closes. ``runner`` (with
        ``api``): a socket bound before the model loaded (`graftmem.server.bind`), answering 503 until
        this server starts on it (what ``graftmem serve`` does)."""
        self._check()
        cfg = ServeConfig.of(config, **options)
        check_pushes = self.vetting(rederive=cfg.rederive)
        if not cfg.api:
            return block_server(self._store, cfg, fingerprint=self.fingerprint, check=check_pushes)
        # one loaded model for the pool, threads sized per engine (graftmem.server.pool.pool_engines); the
        # memory's own engine gets its threads back when the server closes (it outlives the server)
        threads, batch = self._engine.n_threads, self._engine.n_threads_batch
        extra = pool_engines(self._engine, cfg.engines)[1:]
        restore = [] if (self._engine.n_threads, self._engine.n_threads_batch) == (threads, batch) \
            else [lambda: self._engine.set_threads(threads, batch)]
        try:
            srv = api_server(self._store, [self._engine, *extra], cfg, check=check_pushes,
                             router=lambda: self.router, runner=runner)  # router: loaded on the first routed request
        except BaseException:
            for e in extra:
                e.close()
            for undo in restore:
                undo()
            raise
        srv.on_close.extend([*(e.close for e in extra), *restore])  # after the server has left them empty
        return srv
