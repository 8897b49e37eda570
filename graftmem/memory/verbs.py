"""The memory's verbs on one engine and one store, with the rules of using memory applied once.

Why this object: `Memory`, the REST routes, the OpenAI routes, the prefix cache and the warm start all
graft blocks and answer from them. When each did it its own way, the rules lived in one door and were
missing from the others: the server's prefix cache grafted a forged ``unverified`` system-prompt block
into every chat (issue 24), REST ``recall`` never asked for consent, and ``recall_stream`` streamed a
block's answer before refusing it. Here, for every door:

* **arguments** are checked first (`graftmem.memory.validate`, `ConfigError`; HTTP answers 400);
* **consent before any graft**: a block whose chain holds a block nothing here vouches for
  (`provenance_is_trusted`) raises `UnverifiedBlock` before a byte of it reaches llama.cpp, unless the
  caller passed ``allow_unverified=True``;
* **the provenance stamp**: the one receipt type ([`Receipt`][graftmem.Receipt]) names the provenance
  of what was grafted (the weakest of the chain).

`graft()` is the only graft the server performs; tests/test_architecture.py fails when a server
module reaches `graftmem.memory.answer` / `graftmem.memory.recall`'s graft and answer functions, or
the engine's ``restore``, without going through this object.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from ..core.blocks import Block, Recall, SearchHit, VerifyReport
from ..core.decoding import Sampling, check_stops
from ..core.errors import ConfigError, UnverifiedBlock
from . import validate as check
from .access import SHARED_BY_KEY
from .answer import OnText
from .answer import ask as ask_block
from .answer import graft as graft_block
from .exactness import verify_block
from .learn import learn as learn_text
from .pager import recall_document as recall_pages
from .recall import continuation_for
from .recall import recall as route_and_answer
from .recall import search as route_search

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.protocol import BlockStore
    from .pager import DocumentAnswer, PageIndex
    from .router import Router

__all__ = ["MemoryVerbs", "first_untrusted", "untrusted_in_chain", "weakest_provenance"]

log = logging.getLogger("graftmem")

BlockFilter = Callable[[Block], bool]


def first_untrusted(chain: Sequence[Block]) -> Optional[Block]:
    """The first block of ``chain`` (root first) whose provenance needs consent, or None."""
    return next((b for b in chain if not b.trusted), None)


def untrusted_in_chain(store: "BlockStore", block: Block) -> Optional[Block]:
    """``block`` or the nearest ancestor of it that nothing here vouches for, or None: a chained block's
    state is its ancestors' cells plus its own, so one forged ancestor forges the whole chain."""
    cur: Optional[Block] = block
    while cur is not None:
        if not cur.trusted:
            return cur
        cur = store.get(cur.parent) if cur.parent is not None else None
    return None


def weakest_provenance(block: Block, untrusted: Optional[Block]) -> Optional[str]:
    """What a receipt says was grafted: the untrusted link's provenance if the chain has one."""
    if untrusted is not None:
        return untrusted.provenance or "unverified"
    return block.provenance


def refusal(block: Block, untrusted: Block) -> UnverifiedBlock:
    what = "it" if untrusted.id == block.id else f"its ancestor {untrusted.short_id}"
    return UnverifiedBlock(
        f"block {block.short_id} ({block.name!r}): {what} is {untrusted.provenance or 'unverified'}: "
        "nothing here proved that its state is its text's (it arrived without re-derivation or "
        "a trusted signature). Re-derive it (Memory.rederive / `graftmem verify --rederive`), "
        "learn its text here, or opt in (CLI: --allow-unverified; Python: allow_unverified=True)")


class MemoryVerbs:
    """learn, ask, search, recall and graft on ``engine`` over ``store``, each checked, consented and
    stamped the same way whichever door called it. One per engine (a server has one per pooled engine);
    it holds no state of its own beyond the two, so creating one costs nothing."""

    def __init__(self, engine: "Engine", store: "BlockStore") -> None:
        self._engine, self._store = engine, store

    @property
    def engine(self) -> "Engine":
        return self._engine

    @property
    def store(self) -> "BlockStore":
        return self._store

    # ------------------------------------------------------------------ consent and provenance
    def untrusted(self, block: Block, chain: Optional[Sequence[Block]] = None) -> Optional[Block]:
        """The link of ``block``'s chain that needs consent (``chain`` if the caller read it already)."""
        return first_untrusted(chain) if chain is not None else untrusted_in_chain(self._store, block)

    def consent(self, block: Block, allow_unverified: bool, chain: Optional[Sequence[Block]] = None) -> None:
        """Refuse a block that nothing here vouches for (itself or an ancestor), unless allowed."""
        check.flag("allow_unverified", allow_unverified)
        if allow_unverified:
            return
        bad = self.untrusted(block, chain)
        if bad is not None:
            raise refusal(block, bad)

    def stamp(self, r: Recall, block: Optional[Block]) -> Recall:
        """The receipt with the provenance of what was grafted."""
        if block is None or r.block is None:
            return r
        prov = weakest_provenance(block, self.untrusted(block))
        return r.model_copy(update={"receipt": r.receipt.model_copy(update={"provenance": prov})})

    # ------------------------------------------------------------------ the one graft
    def graft(self, block: Block, *, allow_unverified: bool, chain: Optional[Sequence[Block]] = None,
              timings: Optional[dict[str, float]] = None) -> int:
        """Consent, then restore ``block`` (its whole chain) at its own positions in this engine; call
        inside an ``Engine.session()``. Returns the end position (`graftmem.memory.answer.graft`)."""
        self.consent(block, allow_unverified, chain)
        return graft_block(self._engine, self._store, block, timings)

    def verify(self, block_id: str, *, samples: int = 50, cross_process: bool = True,
               allow_unverified: bool = False) -> VerifyReport:
        """Prove graft == fresh prefill of a block on ``samples`` queries (`graftmem.memory.exactness`),
        after the consent of a graft: a verification grafts the block's bytes, so a block nothing here
        vouches for is refused unless allowed (`Memory.verify`, the operator's, allows it)."""
        block = self._store.get(block_id)
        self.consent(block, allow_unverified)
        return verify_block(self._engine, self._store, block.id, samples=samples, cross_process=cross_process)

    # ------------------------------------------------------------------ verbs
    def learn(self, text: str, **kw: Any) -> tuple[Block, bool]:
        """`prepare_learn` and run it: (block, whether it is new or changed)."""
        return self.prepare_learn(text, **kw)()

    def prepare_learn(self, text: str, *, name: Optional[str] = None, kind: str = "manual",
                      metadata: Optional[Mapping[str, Any]] = None, progress: bool = False,
                      when_to_use: Optional[str] = None, chat: bool = False,
                      parent: Optional[str] = None, owner: Optional[str] = None,
                      shared_by: Optional[str] = None,
                      may_relabel: Optional[BlockFilter] = None) -> Callable[[], tuple[Block, bool]]:
        """Check the arguments now (before any prefill or write); return the call that learns
        (`graftmem.memory.learn.learn`). ``owner`` / ``shared_by``: the tenant that owns the block, or
        that shared it (`graftmem.memory.access.Access.owns`), given by the server, never by a request;
        ``may_relabel``: whether the caller may change the labels of a block already stored (`Access.may_delete`)."""
        check.text("text", text)
        check.text("name", name, optional=True)
        check.text("kind", kind)
        check.metadata(metadata)
        check.flag("progress", progress)
        check.text("when_to_use", when_to_use, optional=True)
        check.flag("chat", chat)
        check.text("parent", parent, optional=True)
        check.text("owner", owner, optional=True)
        check.text("shared_by", shared_by, optional=True)
        if shared_by is not None:
            metadata = {**(metadata or {}), SHARED_BY_KEY: shared_by}
        return lambda: learn_text(self._engine, self._store, text, name=name, kind=kind, metadata=metadata,
                                  progress=progress, when_to_use=when_to_use, chat=chat, parent=parent,
                                  owner=owner, may_relabel=may_relabel)

    def prepare_ask(self, block_id: str, query: str, *, max_tokens: int = 64, sampling: Optional[Sampling] = None,
                    stop: "str | Sequence[str] | None" = None, allow_unverified: bool = False,
                    turn: bool = False, response_format: Optional[Mapping[str, Any]] = None
                    ) -> Callable[[Optional[OnText]], Recall]:
        """Check everything ``ask`` needs (the block's consent included) now; return the call that
        answers, given an optional text callback (a stream's). ``turn``: put ``query`` after the block as
        the next chat turn for a chat block (`continuation_for`), else as is."""
        check.text("block_id", block_id)
        check.text("query", query, empty=True)
        if not query:
            raise ConfigError("query must not be empty: the answer starts after at least one token")
        check.max_tokens(max_tokens, self._engine.n_ctx)
        check.instance("sampling", sampling, Sampling)
        check.flag("allow_unverified", allow_unverified)
        check.flag("turn", turn)
        stops = check_stops(stop)
        grammar = check.response_format(response_format)
        block = self._store.get(block_id)
        self.consent(block, allow_unverified)
        cont = continuation_for(block, query) if turn else query

        def run(on_text: Optional[OnText]) -> Recall:
            return self.stamp(ask_block(self._engine, self._store, block, cont, max_tokens=max_tokens,
                                        sampling=sampling or Sampling(), stops=stops, on_text=on_text,
                                        grammar=grammar), block)
        return run

    def ask(self, block_id: str, query: str, **kw: Any) -> Recall:
        """`prepare_ask` and run it."""
        return self.prepare_ask(block_id, query, **kw)(None)

    def search(self, router: "Router", task: str, *, top_k: int = 5,
               allow: Optional[BlockFilter] = None) -> list[SearchHit]:
        """Rank this engine's blocks for ``task`` (best first); nothing is grafted."""
        check.text("task", task)
        check.integer("top_k", top_k, lo=1, hi=10_000)
        return route_search(router, self._store, self._engine.fingerprint.digest(), task, top_k=top_k, allow=allow)

    def prepare_recall(self, router: "Callable[[], Router]", task: str, *, max_tokens: int = 64,
                       min_score: Optional[float] = None, mode: str = "graft", sampling: Optional[Sampling] = None,
                       stop: "str | Sequence[str] | None" = None, allow_unverified: bool = False,
                       allow: Optional[BlockFilter] = None, response_format: Optional[Mapping[str, Any]] = None
                       ) -> Callable[[Optional[OnText]], Recall]:
        """Check the arguments of recall now; return the call that routes, asks the routed block's
        consent BEFORE it is grafted (or re-read, ``mode="text"``), answers and stamps the receipt.
        ``router`` is called when the recall runs (loading it takes seconds: a stream starts at once)."""
        check.text("task", task)
        check.max_tokens(max_tokens, self._engine.n_ctx)
        check.score("min_score", min_score)
        check.choice("mode", mode, ("graft", "text"))
        check.instance("sampling", sampling, Sampling)
        check.flag("allow_unverified", allow_unverified)
        stops = check_stops(stop)
        grammar = check.response_format(response_format)

        def run(on_text: Optional[OnText]) -> Recall:
            r = route_and_answer(self._engine, self._store, router(), task, max_tokens=max_tokens,
                                 min_score=min_score, mode=mode,  # type: ignore[arg-type]
                                 sampling=sampling or Sampling(), allow=allow, stops=stops, on_text=on_text,
                                 admit=lambda b: self.consent(b, allow_unverified), grammar=grammar)
            if r.block is None:
                return r
            return self.stamp(r, self._store.get(r.block.id))
        return run

    def recall(self, router: "Callable[[], Router]", task: str, **kw: Any) -> Recall:
        """`prepare_recall` and run it."""
        return self.prepare_recall(router, task, **kw)(None)

    def recall_document(self, index: "PageIndex", task: str, *, prompt: Optional[str] = None,
                        document: Optional[str] = None, max_tokens: int = 32, min_score: Optional[float] = None,
                        allow_unverified: bool = False) -> "DocumentAnswer":
        """Route ``task`` to a page of a long document and answer from it
        (`graftmem.memory.pager.recall_document`), the page's consent asked before it is grafted (a page
        imported unchecked is refused, `UnverifiedBlock`, unless ``allow_unverified``) and the receipt
        stamped with its provenance, as for every other graft."""
        check.text("task", task)
        check.text("prompt", prompt, optional=True, empty=True)
        check.text("document", document, optional=True)
        check.max_tokens(max_tokens, self._engine.n_ctx)
        check.score("min_score", min_score)
        check.flag("allow_unverified", allow_unverified)
        grafted: list[Block] = []

        def admit(block: Block) -> None:
            self.consent(block, allow_unverified)
            grafted.append(block)

        ans = recall_pages(self._engine, self._store, index, task, prompt=prompt, document=document,
                           max_tokens=max_tokens, min_score=min_score, admit=admit)
        return ans.model_copy(update={"recall": self.stamp(ans.recall, grafted[-1] if grafted else None)})
