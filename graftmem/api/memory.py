"""Memory: the thin coordinator an application holds. It owns one engine and one store and turns
the verbs (learn, ask, get, delete, verify, stats) into engine and store calls. No llama.cpp here.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Sequence

from ..core.blocks import (Block, EngineConfig, Exactness, Fingerprint, HistoryEvent, Recall, Scope, SearchHit,
                           StoreStats, VerificationRecord, VerifyReport)
from ..core.decode import Sampling
from ..core.engine import Engine
from ..core.errors import BlockNotFound, ClosedError, ConfigError
from ..core.prompt import detect_format
from ..memory.answer import ask as ask_block
from ..memory.exactness import verify_block
from ..memory.learn import default_name
from ..memory.learn import learn as learn_text
from ..memory.pager import DEFAULT_OVERLAP, PageIndex, learn_document, recall_document
from ..memory.recall import recall as route_and_answer
from ..memory.recall import search as route_search
from ..memory.rederive import RederiveReport, rederive as _rederive, rederive_file
from ..memory.router import Embedder, Router, SentenceTransformerEmbedder
from ..server.blocks import BlockServer
from ..share.bundle import export as export_bundle
from ..share.bundle import import_bundle
from ..share.client import pull, push
from ..share.admission import BlockCheck
from ..share.manifest import ExportReport, TransferReport
from ..share.trust import SigningKey, TrustPolicy
from ..store.local import Store
from ..store.scopes import ScopeIndex

if TYPE_CHECKING:
    from ..memory.pager import DocumentAnswer, DocumentReport, Source

__all__ = ["Memory"]

log = logging.getLogger("graftmem")


def _count(what: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{what} must be an integer >= 1, got {n!r}")
    return n


class Memory:
    """An agent memory made of verified KV-cache blocks.

    ```python
    with Memory() as mem:
        block = mem.learn("Refunds: always ask for the order number first.", name="refunds")
        print(mem.ask(block.id, "\\nQ: what do I ask first?\\nA:").text)
    ```

    ``model`` is a short name (``"smollm2"``, ``"gemma3-270m"``) or a GGUF path; ``home`` the store
    directory (default ``$GRAFTMEM_HOME`` or the user data dir); ``config`` an :class:`EngineConfig`
    or a dict of its fields (unknown keys are an error). ``engine`` shares an already loaded
    :class:`Engine` between stores (the Memory then does not close it); ``embedder`` replaces the
    packaged MiniLM for routing.

    The Memory owns its resources (engine, store, embedder, router, page index) and exposes them as
    properties; every verb hands them explicitly to the feature that does the work
    (:mod:`graftmem.memory`, :mod:`graftmem.share`), so the features never reach into this object.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *,
                 home: str | os.PathLike[str] | None = None,
                 config: EngineConfig | Mapping[str, Any] | None = None,
                 engine: Engine | None = None, embedder: Embedder | None = None) -> None:
        if engine is not None and (model is not None or config is not None):
            raise ConfigError("pass either engine= or model=/config=, not both")
        if config is not None:
            config = EngineConfig.coerce(config)  # a typo fails here, before the store is opened
        self._store = Store(home)
        self._owns_engine = engine is None
        try:
            self._engine = engine if engine is not None else Engine(model, config)
        except BaseException:
            self._store.close()
            raise
        self._closed = False
        # routing loads torch and MiniLM (seconds): created on the first recall/search, never by learn/ask
        self._embedder = embedder
        self._router: Optional[Router] = None
        self._pages: Optional[PageIndex] = None
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
    def store(self) -> Store:
        """The block store (``home``) this memory learns into and grafts from."""
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
        """A block predicate for a scope, metadata filters (exact values) and a kind; None if no filter."""
        if filters is not None and not isinstance(filters, Mapping):
            raise ConfigError(f"filters must be a mapping of metadata field -> value, got {type(filters).__name__}")
        if scope.empty and not filters and kind is None:
            return None
        owned = None if scope.empty else self.scopes.blocks_of(scope)
        want = dict(filters or {})

        def allow(b: Block) -> bool:
            return ((owned is None or b.id in owned) and (kind is None or b.kind == kind)
                    and all(b.metadata.get(k) == v for k, v in want.items()))
        return allow

    @property
    def pages(self) -> PageIndex:
        """The passage index of long documents (:meth:`learn_document`), opened on first use."""
        self._check()
        embedder = self.embedder
        with self._lazy_lock:
            if self._pages is None:
                self._pages = PageIndex(self._store.home, embedder)
            return self._pages

    # ------------------------------------------------------------------ learn
    def learn(self, text: "str | Sequence[Mapping[str, Any]]", *, name: Optional[str] = None,
              kind: str = "manual", metadata: Optional[Mapping[str, Any]] = None, progress: bool = False,
              when_to_use: Optional[str] = None, chat: bool = False, parent: Optional[str] = None,
              user_id: Optional[str] = None, agent_id: Optional[str] = None,
              session_id: Optional[str] = None) -> Block:
        """Prefill ``text`` once and store its KV state as a block (deduplicated by content).

        ``text`` may also be a list of chat messages (``[{"role": "user", "content": "I like tea"}]``,
        the shape the OpenAI API and mem0 use): they are rendered with the model's chat template and
        stored as a chat block, so that :meth:`recall` continues the conversation with the task as the
        next user turn.

        ``parent`` (a block id) chains the text on that block: the parent is grafted, ``text`` is
        tokenized without BOS and prefilled at positions ``parent.pos_end..``, and the child is
        stored as a delta (its new cells only) when the state layout allows; grafting the child
        equals a fresh sequential prefill of every text of the chain, byte for byte. A shared system
        prompt learned once with many manuals chained on it is the intended use.

        ``when_to_use`` describes the tasks this block serves; the router embeds it with the name and
        the start of the text. ``chat=True`` stores the text as a complete chat turn of the model's
        template (see :mod:`graftmem.core.prompt`), so that :meth:`recall` can append a task as the next
        turn and still match a fresh prefill of the whole prompt token for token.

        ``user_id``, ``agent_id`` and ``session_id`` scope the block: :meth:`get_all`, :meth:`search`
        and :meth:`recall` given a scope see only the blocks learned in it. The same text learned in two
        scopes is one block (one prefill) owned by both.
        """
        self._check()
        scope = Scope(user_id=user_id, agent_id=agent_id, session_id=session_id)
        if not isinstance(text, str):
            text, name, metadata = self._render_messages(text, name, metadata, chat)
        block, changed = learn_text(self._engine, self._store, text, name=name, kind=kind, metadata=metadata,
                                    progress=progress, when_to_use=when_to_use, chat=chat, parent=parent)
        if self._router is not None and changed:
            self._router.add_blocks([block])
        if not scope.empty:
            self.scopes.add(block.id, scope)
        if changed or not scope.empty:
            self.scopes.record(block.id, "learned" if changed else "learned_again",
                               {"name": block.name, "kind": block.kind, **scope.model_dump(exclude_none=True)})
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
            raise ConfigError(f"model {self.fingerprint.model_name!r} has no chat template graftmem knows; "
                              "learn the conversation as a text")
        text = fmt.render(messages)
        last_user = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), text)
        return text, name or default_name(last_user), {**dict(metadata or {}), "chat_format": fmt.name}

    add = learn

    # ------------------------------------------------------------------ ask
    def ask(self, block_id: str, query: str, *, max_tokens: int = 64,
            sampling: Optional[Sampling] = None) -> Recall:
        """Graft the block at its own positions, prefill ``query``, and answer (greedily by default)."""
        self._check()
        return ask_block(self._engine, self._store, self._store.get(block_id), query, max_tokens=max_tokens,
                           sampling=sampling or Sampling())

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
        top_k = _count("top_k" if limit is None else "limit", top_k if limit is None else limit)
        allow = self._filter(Scope(user_id=user_id, agent_id=agent_id, session_id=session_id), filters, kind)
        return route_search(self.router, self._store, self.fingerprint.digest(), task, top_k=top_k, allow=allow)

    def recall(self, task: str, *, max_tokens: int = 64, min_score: Optional[float] = None,
               mode: Literal["graft", "text"] = "graft", sampling: Optional[Sampling] = None,
               filters: Optional[Mapping[str, Any]] = None, user_id: Optional[str] = None,
               agent_id: Optional[str] = None, session_id: Optional[str] = None) -> Recall:
        """Route ``task`` to ONE block, graft it, prefill the task, answer.

        Below ``min_score`` (default :data:`graftmem.memory.router.DEFAULT_MIN_SCORE`) nothing is grafted:
        ``block`` is None and the text says so. ``mode="text"`` answers the same prompt the old way
        (prefill the block's text, no graft), for comparisons; the answers are identical.
        """
        self._check()
        allow = self._filter(Scope(user_id=user_id, agent_id=agent_id, session_id=session_id), filters)
        return route_and_answer(self._engine, self._store, self.router, task, max_tokens=max_tokens,
                                min_score=min_score, mode=mode, sampling=sampling or Sampling(), allow=allow)

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
        return learn_document(self._engine, self._store, self.pages, source, document=document, name=name,
                                     window=window, overlap=DEFAULT_OVERLAP if overlap is None else overlap,
                                     progress=progress)

    def recall_document(self, task: str, *, prompt: Optional[str] = None, document: Optional[str] = None,
                        max_tokens: int = 32, min_score: Optional[float] = None) -> "DocumentAnswer":
        """Route ``task`` to the passage that answers it, graft ONLY its page and answer after ``prompt``
        (default: a blank line and the task); the answer says which page and where in the document."""
        self._check()
        return recall_document(self._engine, self._store, self.pages, task, prompt=prompt,
                                      document=document, max_tokens=max_tokens, min_score=min_score)

    # ------------------------------------------------------------------ store verbs
    def get(self, block_id: str) -> Block:
        """The block with this id (or unique id prefix); :class:`BlockNotFound` otherwise."""
        self._check()
        return self._store.get(block_id)

    def get_all(self, *, kind: Optional[str] = None, filters: Optional[Mapping[str, Any]] = None,
                user_id: Optional[str] = None, agent_id: Optional[str] = None,
                session_id: Optional[str] = None) -> list[Block]:
        """Every block in the store (of ``kind``, with the ``filters`` metadata values, in the scope),
        whatever engine made it."""
        self._check()
        allow = self._filter(Scope(user_id=user_id, agent_id=agent_id, session_id=session_id), filters)
        return [b for b in self._store.list(kind=kind) if allow is None or allow(b)]

    def delete(self, block_id: str, *, cascade: bool = False) -> list[str]:
        """Delete a block; return the ids deleted. A block with chained children is refused
        (:class:`ConfigError`) unless ``cascade=True``, which deletes its descendants too."""
        self._check()
        bid = self._store.resolve(block_id)
        gone = self._store.delete(bid, cascade=cascade)
        if self._router is not None:
            self._router.remove(gone)
        for g in gone:
            self.scopes.remove(g)
            self.scopes.record(g, "deleted", {"cascade_from": bid} if g != bid else {})
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
        The history is kept, so :meth:`history` still says what was there."""
        self._check()
        gone: list[str] = []
        for b in self._store.list():
            if self._store.contains(b.id) and b.parent is None:
                gone += self.delete(b.id, cascade=True)
        for b in self._store.list():  # children whose root was missing
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
        """Prove graft == fresh prefill for ``samples`` queries (see :mod:`graftmem.memory.exactness`)."""
        self._check()
        report = verify_block(self._engine, self._store, block_id, samples=samples,
                                         cross_process=cross_process)
        if record:
            block = self._store.get(report.block_id)
            rec = VerificationRecord(samples=report.samples, sha_equal=report.sha_equal,
                                     max_kl=report.max_kl, argmax_agree=report.argmax_agree,
                                     ok=report.ok)
            self._store.set_manifest(block.model_copy(update={"verification": rec}))
            self.scopes.record(block.id, "verified", rec.model_dump())
        return report

    def rederive(self, block_id: str) -> RederiveReport:
        """Re-prefill the block's own tokens (a chained block: its whole chain, call by call) and compare
        the state with the stored bytes."""
        self._check()
        return _rederive(self._engine, self._store, block_id)

    # ------------------------------------------------------------------ sharing
    def _rederive_check(self) -> BlockCheck:
        """A staged-block check that re-derives the block here (import, pull, a served push)."""
        return lambda block, path: rederive_file(self._engine, block, path)

    def export(self, path: str | os.PathLike[str], block_ids: Optional[list[str]] = None, *,
               kind: Optional[str] = None, where: Optional[Callable[[Block], bool]] = None,
               sign_key: Optional[SigningKey] = None, progress: bool = False) -> ExportReport:
        """Write blocks (by id or prefix, else all, narrowed by ``kind`` and the ``where`` filter)
        to one bundle file that another machine can import."""
        self._check()
        return export_bundle(self._store, path, block_ids, kind=kind, where=where, sign_key=sign_key,
                              progress=progress)

    def import_bundle(self, path: str | os.PathLike[str], *, incompatible: str = "refuse",
                      policy: Optional[TrustPolicy] = None, rederive: bool = False,
                      progress: bool = False) -> TransferReport:
        """Import a bundle, every digest checked, all or nothing; blocks of another engine are refused
        (or kept apart / skipped). ``policy`` defaults to ``<home>/trust.json``. ``rederive`` also
        re-prefills every new block's text and refuses the bundle unless the state bytes are equal."""
        self._check()
        return import_bundle(self._store, path, fingerprint=self.fingerprint, policy=policy,
                                     incompatible=incompatible, progress=progress,  # type: ignore[arg-type]
                                     check=self._rederive_check() if rederive else None)

    def pull(self, url: str, block_ids: Optional[list[str]] = None, *, kind: Optional[str] = None,
             incompatible: str = "refuse", policy: Optional[TrustPolicy] = None,
             rederive: bool = False, progress: bool = False) -> TransferReport:
        """Copy blocks from a ``graftmem serve`` at ``url``: checked as they arrive, resumable;
        ``rederive`` as for :meth:`import_bundle`."""
        self._check()
        return pull(self._store, url, block_ids, fingerprint=self.fingerprint, kind=kind,
                            incompatible=incompatible, policy=policy, progress=progress,  # type: ignore[arg-type]
                            check=self._rederive_check() if rederive else None)

    def push(self, url: str, block_ids: Optional[list[str]] = None, *, token: str,
             kind: Optional[str] = None, sign_key: Optional[SigningKey] = None,
             progress: bool = False) -> TransferReport:
        """Send blocks to a ``graftmem serve`` that accepts pushes (it imports them all or nothing)."""
        self._check()
        return push(self._store, url, block_ids, token=token, kind=kind, sign_key=sign_key,
                            progress=progress)

    def serve(self, *, host: str = "127.0.0.1", port: int = 0, push_token: Optional[str] = None,
              sign_key: Optional[SigningKey] = None, rederive: bool = False) -> BlockServer:
        """An HTTP server over this store (call ``.start()`` or use it as a context manager);
        ``rederive`` re-derives every pushed block before accepting it."""
        self._check()
        return BlockServer(self._store, host=host, port=port, push_token=push_token,
                           fingerprint=self.fingerprint, sign_key=sign_key,
                           check=self._rederive_check() if rederive else None)
