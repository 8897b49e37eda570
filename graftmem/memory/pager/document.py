"""The pager's features: learning a document (every page prefilled and stored through the one learn
path, its passages indexed; resumable) and asking it (route to one passage, graft ONLY its page)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from ...core.blocks import PAGE_KIND, Block, Recall
from ...core.identity import block_id_for
from ...core.errors import BlockNotFound, ConfigError
from ...core.progress import progress_bar
from ..learn import prefill_and_store
from ..recall import answer_graft_way
from .index import PageIndex, PageInfo, PagerModel, PassageHit
from .plan import DEFAULT_OVERLAP, DocumentPlan, Source, plan_document, read_source

if TYPE_CHECKING:
    from ...core.engine import Engine
    from ...store.protocol import BlockStore

__all__ = ["DocumentReport", "DocumentAnswer", "learn_pages", "learn_document", "recall_document",
           "DEFAULT_PAGE_MIN_SCORE"]

log = logging.getLogger("graftmem")

#: passage score (cosine + LEX_WEIGHT * lexical coverage) below which recall_document grafts nothing.
#: Not the block router's threshold: a passage is scored on its own text, without a name or a
#: when_to_use, and a one-sentence answer in a passage of unrelated text scores lower than a manual.
#: On the tuning needles (bench/routing.py --quality-only: 4 in stdlib docstrings) the right passages
#: scored 0.33 or more, off-topic questions over those docstrings at most 0.23. Over the synthetic
#: corpus of bench/needle.py (word salad) off-topic questions reach 0.45, its needles 0.95 or more.
DEFAULT_PAGE_MIN_SCORE = 0.30


class DocumentReport(PagerModel):
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


class DocumentAnswer(PagerModel):
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


def _reusable(store: "BlockStore", block_id: str) -> bool:
    """A page already stored and trusted: skipped (an unverified one is prefilled again)."""
    return store.contains(block_id) and store.get(block_id).trusted


def learn_pages(engine: "Engine", store: "BlockStore", index: PageIndex, plan: DocumentPlan, pages: Optional[Sequence[int]] = None, *,
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
    # the bar counts the pages to prefill, each from position 0 (a rerun that skips every page shows none:
    # it showed the skipped tokens "done" at hundreds of thousands of tokens/s)
    ids = [block_id_for(fp, p.tokens) for p in todo]
    reuse = [_reusable(store, bid) for bid in ids]  # decided once: the bar and the loop agree
    fresh = [p for p, r in zip(todo, reuse) if not r]
    bar = progress_bar(sum(p.n_tokens for p in fresh), f"learn {plan.name}", progress and bool(fresh),
                       leave=True, segments=[(0, p.n_tokens) for p in fresh])
    try:
        for page, bid, reused in zip(todo, ids, reuse):
            if reused:
                skipped += 1
            else:
                stored = store.contains(bid)
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


def learn_document(engine: "Engine", store: "BlockStore", index: PageIndex, source: Source, *, document: Optional[str] = None,
                   name: Optional[str] = None, window: Optional[int] = None,
                   overlap: int = DEFAULT_OVERLAP, progress: bool = True) -> DocumentReport:
    """Cut a document into pages that fit the window, store each page as a block and index its passages."""
    text = read_source(source)
    if name is None and isinstance(source, (os.PathLike, str)) and text is not source:
        name = Path(source).name
    plan = plan_document(engine, text, window=window, overlap=overlap, document=document, name=name)
    return learn_pages(engine, store, index, plan, progress=progress)


# --------------------------------------------------------------------------- asking
def recall_document(engine: "Engine", store: "BlockStore", index: PageIndex, task: str, *, prompt: Optional[str] = None,
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
    for n, top in enumerate(hits):  # noqa: B007 - n is read after the loop: the pages before it are gone
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
    # the runner-up pages are likely asked next: a fleet store brings them into its cache (a local one has them)
    store.prefetch(list(dict.fromkeys(h.page.block_id for h in hits[1:3] if h.page.block_id != block.id)))
    return DocumentAnswer(text=r.text, page=top.page, passage=top, runner_up=hits[1] if len(hits) > 1 else None,
                          recall=r.model_copy(update={"score": top.score}))
