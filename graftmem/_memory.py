"""Memory: the thin coordinator an application holds. It owns one engine and one store and turns
the verbs (learn, ask, get, delete, verify, stats) into engine and store calls. No llama.cpp here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional

from ._blocks import Block, EngineConfig, Exactness, Fingerprint, Recall, StoreStats, VerificationRecord, VerifyReport, block_id_for
from ._engine import Engine
from ._errors import ClosedError, ConfigError
from ._format import state_digest
from ._store import Store, incompatibility

if TYPE_CHECKING:
    from typing import Callable

    from ._bundle import BlockCheck, ExportReport, TransferReport
    from ._server import BlockServer
    from ._trust import RederiveReport, SigningKey, TrustPolicy
    from ._blocks import SearchHit
    from ._router import Embedder, Router
    from ._pager import DocumentAnswer, DocumentReport, Source

__all__ = ["Memory"]

log = logging.getLogger("graftmem")


def _progress(total: int, desc: str, enabled: bool):  # tqdm only for long work
    if not enabled or total < 1024:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", leave=False)


class Memory:
    """An agent memory made of verified KV-cache blocks.

    >>> with Memory() as mem:                                   # doctest: +SKIP
    ...     block = mem.learn("Refunds: always ask for the order number first.", name="refunds")
    ...     mem.ask(block.id, "\\nQ: what do I ask first?\\nA:").text

    ``model`` is a short name (``"smollm2"``, ``"gemma3-270m"``) or a GGUF path; ``home`` the store
    directory (default ``$GRAFTMEM_HOME`` or the user data dir); ``config`` an :class:`EngineConfig`
    or a dict of its fields (unknown keys are an error). ``engine`` shares an already loaded
    :class:`~graftmem._engine.Engine` between stores (the Memory then does not close it).
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *,
                 home: str | os.PathLike[str] | None = None,
                 config: EngineConfig | Mapping[str, Any] | None = None,
                 engine: Engine | None = None, embedder: "Embedder | None" = None) -> None:
        if engine is not None and (model is not None or config is not None):
            raise ConfigError("pass either engine= or model=/config=, not both")
        if config is not None and not isinstance(config, EngineConfig):
            try:
                config = EngineConfig(**dict(config))
            except ValueError as exc:
                raise ConfigError(f"invalid engine config: {exc}") from exc
        self.store = Store(home)
        self._owns_engine = engine is None
        try:
            self.engine = engine if engine is not None else Engine(model, config)
        except BaseException:
            self.store.close()
            raise
        self._closed = False
        # routing loads torch and MiniLM (seconds): created on the first recall/search, never by learn/ask
        self._embedder = embedder
        self._router: "Router | None" = None
        self._router_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._owns_engine:
                self.engine.close()
            self.store.close()

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("this Memory is closed; open a new one")

    @property
    def fingerprint(self) -> Fingerprint:
        return self.engine.fingerprint

    @property
    def exactness(self) -> Exactness:
        return self.engine.exactness

    # ------------------------------------------------------------------ learn
    def learn(self, text: str, *, name: Optional[str] = None, kind: str = "manual",
              metadata: Optional[Mapping[str, Any]] = None, progress: bool = False,
              when_to_use: Optional[str] = None, chat: bool = False,
              parent: Optional[str] = None) -> Block:
        """Prefill ``text`` once and store its KV state as a block (deduplicated by content).

        ``parent`` (a block id) chains the text on that block: the parent is grafted, ``text`` is
        tokenized without BOS and prefilled at positions ``parent.pos_end..``, and the child is
        stored as a delta (its new cells only) when the state layout allows; grafting the child
        equals a fresh sequential prefill of every text of the chain, byte for byte. A shared system
        prompt learned once with many manuals chained on it is the intended use.

        ``when_to_use`` describes the tasks this block serves; the router embeds it with the name and
        the start of the text. ``chat=True`` stores the text as a complete chat turn of the model's
        template (see :mod:`graftmem._prompt`), so that :meth:`recall` can append a task as the next
        turn and still match a fresh prefill of the whole prompt token for token.
        """
        self._check()
        if not text:
            raise ConfigError("cannot learn an empty text")
        eng = self.engine
        if chat or when_to_use is not None:
            from ._recall import prepare_learn

            text, name, metadata = prepare_learn(self, text, name, metadata, when_to_use, chat)
        pblock = None
        if parent is not None:
            if chat:
                raise ConfigError("chat=True cannot be chained on a parent block: learn the chat turn as a root")
            pblock = self.store.get(parent)
            err = incompatibility(pblock, eng.fingerprint)
            if err is not None:
                raise err
        tokens = eng.tokenize(text, add_special=pblock is None)
        if not tokens:
            raise ConfigError("the text has no tokens")
        start = pblock.pos_end if pblock is not None else 0
        if start + len(tokens) >= eng.n_ctx:
            raise ConfigError(f"text is {len(tokens)} tokens after {start} positions, the engine's n_ctx "
                              f"is {eng.n_ctx}: raise n_ctx or split the text")
        bid = block_id_for(eng.fingerprint, tokens, pblock.id if pblock is not None else None)
        if self.store.contains(bid):
            from ._recall import learned_again

            return learned_again(self, self.store.get(bid), metadata)
        bar = _progress(len(tokens), f"learn {name or bid[:12]}", progress)
        with eng.lock:
            eng.reset()
            try:
                if pblock is not None:
                    from ._chain import capture_child

                    state, fields = capture_child(self.store, eng, pblock, tokens,
                                                  progress=bar.update if bar else None)
                else:
                    eng.prefill(tokens, progress=bar.update if bar else None)
                    state = eng.capture()
                    fields = {"state_size": len(state), "state_digest": state_digest(state)}
            finally:
                if bar:
                    bar.close()
            block = Block(
                id=bid, name=name or _default_name(text), kind=kind, text=text, tokens=tokens,
                n_tokens=len(tokens), fingerprint=eng.fingerprint, metadata=dict(metadata or {}),
                **fields)
            stored = self.store.put(block, state)
            eng.reset()
        log.info("learned block %s (%d tokens, %d state bytes)", block.short_id, len(tokens), len(state))
        if self._router is not None:
            self._router.add_blocks([stored])
        return stored

    add = learn

    # ------------------------------------------------------------------ ask
    def ask(self, block_id: str, query: str, *, max_tokens: int = 64) -> Recall:
        """Graft the block at its own positions, prefill ``query``, and answer greedily."""
        self._check()
        eng = self.engine
        block = self.store.get(block_id)
        err = incompatibility(block, eng.fingerprint)
        if err is not None:
            raise err
        qtok = eng.tokenize(query, add_special=False)
        if not qtok:
            raise ConfigError("the query is empty")
        from ._answer import answer
        from ._chain import load_state

        def graft() -> int:
            # digests checked; a chain merged; window-trimmed cells put back at their fresh indices
            _, view = load_state(self.store, block.id, eng.buffer, fingerprint=eng.fingerprint)
            eng.restore(view, block.pos_end)
            return block.pos_end

        return answer(eng, block, qtok, graft, graft=True, max_tokens=max_tokens)

    # ------------------------------------------------------------------ routing (see _router, _recall)
    @property
    def router(self) -> "Router":
        """The routing index, created (and synced with the store) on first use."""
        self._check()
        with self._router_lock:
            if self._router is None:
                from ._router import Router, SentenceTransformerEmbedder

                if self._embedder is None:
                    self._embedder = SentenceTransformerEmbedder()
                self._router = Router(self._embedder, self.store)
            return self._router

    def search(self, task: str, *, top_k: int = 5) -> "list[SearchHit]":
        """Rank this engine's blocks for ``task`` (best first) without restoring anything."""
        from ._recall import search

        self._check()
        return search(self, task, top_k=top_k)

    def recall(self, task: str, *, max_tokens: int = 64, min_score: Optional[float] = None,
               mode: Literal["graft", "text"] = "graft") -> Recall:
        """Route ``task`` to ONE block, graft it, prefill the task, answer greedily.

        Below ``min_score`` (default :data:`graftmem._router.DEFAULT_MIN_SCORE`) nothing is grafted:
        ``block`` is None and the text says so. ``mode="text"`` answers the same prompt the old way
        (prefill the block's text, no graft), for comparisons; the answers are identical.
        """
        from ._recall import recall

        self._check()
        return recall(self, task, max_tokens=max_tokens, min_score=min_score, mode=mode)

    def reindex(self) -> int:
        """Rebuild the routing index from the store (every block embedded again); returns its size."""
        self._check()
        return self.router.rebuild()

    # ------------------------------------------------------------------ long documents (see _pager)
    def learn_document(self, source: "Source", *, document: Optional[str] = None, name: Optional[str] = None,
                       window: Optional[int] = None, overlap: Optional[int] = None,
                       progress: bool = True) -> "DocumentReport":
        """Cut a long document (a path, a text or an iterable of texts) into pages that fit the window,
        prefill and store each page as a block of kind ``page`` and index its passages for routing.

        Resumable: pages already stored are skipped, so a rerun after a crash or Ctrl-C continues
        where the build stopped. ``window`` defaults to ``n_ctx - 256`` tokens (room for the question).
        """
        from ._pager import DEFAULT_OVERLAP, learn_document

        self._check()
        return learn_document(self, source, document=document, name=name, window=window,
                              overlap=DEFAULT_OVERLAP if overlap is None else overlap, progress=progress)

    def recall_document(self, task: str, *, prompt: Optional[str] = None, document: Optional[str] = None,
                        max_tokens: int = 32, min_score: Optional[float] = None) -> "DocumentAnswer":
        """Route ``task`` to the passage that answers it, graft ONLY its page and answer after ``prompt``
        (default: a blank line and the task); the answer says which page and where in the document."""
        from ._pager import recall_document

        self._check()
        return recall_document(self, task, prompt=prompt, document=document, max_tokens=max_tokens,
                               min_score=min_score)

    # ------------------------------------------------------------------ store verbs
    def get(self, block_id: str) -> Block:
        self._check()
        return self.store.get(block_id)

    def get_all(self, *, kind: Optional[str] = None) -> list[Block]:
        self._check()
        return self.store.list(kind=kind)

    def delete(self, block_id: str, *, cascade: bool = False) -> list[str]:
        """Delete a block; return the ids deleted. A block with chained children is refused
        (:class:`ConfigError`) unless ``cascade=True``, which deletes its descendants too."""
        self._check()
        bid = self.store.resolve(block_id)
        gone = self.store.delete(bid, cascade=cascade)
        if self._router is not None:
            self._router.remove(gone)
        return gone

    def stats(self) -> StoreStats:
        self._check()
        s = self.store.summary()
        toks = int(s["tokens"])  # type: ignore[arg-type]
        size = int(s["bytes"])  # type: ignore[arg-type]
        return StoreStats(home=str(self.store.home), blocks=int(s["blocks"]), tokens=toks,  # type: ignore[arg-type]
                          bytes_on_disk=size, bytes_per_token=size / toks if toks else 0.0,
                          kinds=dict(s["kinds"]))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ verification
    def verify(self, block_id: str, *, samples: int = 50, cross_process: bool = True,
               record: bool = True) -> VerifyReport:
        """Prove graft == fresh prefill for ``samples`` queries (see :mod:`graftmem._verify`)."""
        self._check()
        from ._verify import verify_block

        report = verify_block(self, block_id, samples=samples, cross_process=cross_process)
        if record:
            block = self.store.get(report.block_id)
            rec = VerificationRecord(samples=report.samples, sha_equal=report.sha_equal,
                                     max_kl=report.max_kl, argmax_agree=report.argmax_agree,
                                     ok=report.ok)
            self.store.set_manifest(block.model_copy(update={"verification": rec}))
        return report

    # ------------------------------------------------------------------ sharing (see _bundle, _server, _trust)
    def export(self, path: str | os.PathLike[str], block_ids: Optional[list[str]] = None, *,
               kind: Optional[str] = None, where: "Optional[Callable[[Block], bool]]" = None,
               sign_key: "Optional[SigningKey]" = None, progress: bool = False) -> "ExportReport":
        """Write blocks (by id or prefix, else all, narrowed by ``kind`` and the ``where`` filter)
        to one bundle file that another machine can import."""
        self._check()
        from ._bundle import export

        return export(self.store, path, block_ids, kind=kind, where=where, sign_key=sign_key,
                      progress=progress)

    def import_bundle(self, path: str | os.PathLike[str], *, incompatible: str = "refuse",
                      policy: "Optional[TrustPolicy]" = None, rederive: bool = False,
                      progress: bool = False) -> "TransferReport":
        """Import a bundle, every digest checked, all or nothing; blocks of another engine are refused
        (or kept apart / skipped). ``policy`` defaults to ``<home>/trust.json``. ``rederive`` also
        re-prefills every new block's text and refuses the bundle unless the state bytes are equal."""
        self._check()
        from ._bundle import import_bundle

        return import_bundle(self.store, path, fingerprint=self.fingerprint, policy=policy,
                             incompatible=incompatible, progress=progress,  # type: ignore[arg-type]
                             check=self._rederive_check() if rederive else None)

    def _rederive_check(self) -> "BlockCheck":
        """A staged-block check that re-derives the block here (used by import and pull)."""
        from ._trust import rederive_file

        return lambda block, path: rederive_file(self, block, path)

    def pull(self, url: str, block_ids: Optional[list[str]] = None, *, kind: Optional[str] = None,
             incompatible: str = "refuse", policy: "Optional[TrustPolicy]" = None,
             rederive: bool = False, progress: bool = False) -> "TransferReport":
        """Copy blocks from a ``graftmem serve`` at ``url``: checked as they arrive, resumable;
        ``rederive`` as for :meth:`import_bundle`."""
        self._check()
        from ._server import pull

        return pull(self.store, url, block_ids, fingerprint=self.fingerprint, kind=kind,
                    incompatible=incompatible, policy=policy, progress=progress,  # type: ignore[arg-type]
                    check=self._rederive_check() if rederive else None)

    def push(self, url: str, block_ids: Optional[list[str]] = None, *, token: str,
             kind: Optional[str] = None, sign_key: "Optional[SigningKey]" = None,
             progress: bool = False) -> "TransferReport":
        """Send blocks to a ``graftmem serve`` that accepts pushes (it imports them all or nothing)."""
        self._check()
        from ._server import push

        return push(self.store, url, block_ids, token=token, kind=kind, sign_key=sign_key,
                    progress=progress)

    def serve(self, *, host: str = "127.0.0.1", port: int = 0, push_token: Optional[str] = None,
              sign_key: "Optional[SigningKey]" = None, rederive: bool = False) -> "BlockServer":
        """An HTTP server over this store (call ``.start()`` or use it as a context manager);
        ``rederive`` re-derives every pushed block before accepting it."""
        self._check()
        from ._server import BlockServer

        return BlockServer(self.store, host=host, port=port, push_token=push_token,
                           fingerprint=self.fingerprint, sign_key=sign_key,
                           check=self._rederive_check() if rederive else None)

    def rederive(self, block_id: str) -> "RederiveReport":
        """Re-prefill the block's own tokens (a chained block: its whole chain, call by call) and compare
        the state with the stored bytes."""
        self._check()
        from ._trust import rederive

        return rederive(self, block_id)


def _default_name(text: str) -> str:
    first = " ".join(text.strip().split())[:48]
    return first or hashlib.sha256(text.encode()).hexdigest()[:12]
