"""The one learn path: prefill a text (or graft its parent and prefill the rest), capture the state,
write it as a block. [`Memory.learn()`][graftmem.Memory.learn] and the pager's page builds both end here, so a
block is written one way whatever feature made it.

`learn()` is the whole verb (labels, chat turn, dedup, chaining); `prefill_and_store()` the
part the pager shares (tokens already cut, no labels to prepare).
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from ..core.blocks import PROVENANCE_LOCAL, Block
from ..core.errors import ConfigError, UnverifiedBlock
from ..core.format import state_digest
from ..core.progress import progress_bar
from ..core.segments import chat_block, detect_format, no_format_reason
from ..core.identity import NO_SALTS, SALTS_KEY, TENANT_KEY, Salts, block_id_for, check_block_id, incompatibility
from ..store.chain import admit_written, capture_child

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.protocol import BlockStore

__all__ = ["learn", "prefill_and_store", "prepare_labels", "learned_again", "default_name"]

log = logging.getLogger("graftmem")


def default_name(text: str) -> str:
    """A block's name when none is given: the start of its text on one line."""
    first = " ".join(text.strip().split())[:48]
    return first or hashlib.sha256(text.encode()).hexdigest()[:12]


def prepare_labels(engine: "Engine", text: str, name: Optional[str], metadata: Optional[Mapping[str, Any]],
                   when_to_use: Optional[str], chat: bool) -> tuple[str, Optional[str], dict[str, Any]]:
    """The text, name and metadata stored for ``when_to_use`` / ``chat`` (the chat turn wraps the text)."""
    meta = dict(metadata or {})
    if when_to_use is not None:
        if not isinstance(when_to_use, str) or not when_to_use.strip():
            raise ConfigError("when_to_use must be a non-empty description of the tasks this block serves")
        meta["when_to_use"] = when_to_use.strip()
    if chat:
        fmt = detect_format(engine)
        if fmt is None:
            raise ConfigError(f"model {engine.fingerprint.model_name!r} cannot learn a chat turn: "
                              f"{no_format_reason(engine)}; learn with chat=False")
        name = name or default_name(text)
        meta["chat_format"] = fmt.name
        if fmt.template is not None:  # derived from the model's template: recall rebuilds it from these
            meta["chat_parts"] = fmt.parts
            meta["chat_template_sha256"] = fmt.template.digest
        text = chat_block(engine, fmt, text)  # the server's first segment of a chat opening with it
    return text, name, meta


def learned_again(store: "BlockStore", block: Block, metadata: Optional[Mapping[str, Any]],
                  name: Optional[str] = None) -> Block:
    """A text learned twice is one block; a new ``when_to_use`` replaces the old one in its manifest.

    Labels of a block that came from elsewhere (``labels_trusted`` False: shown, never routed) become
    this store's own when the caller gives them here: ``name`` and ``when_to_use`` are written and
    the labels are trusted from then on (the caller vouches for what they typed)."""
    wtu = (metadata or {}).get("when_to_use")
    adopt_labels = block.labels_trusted is False and (wtu is not None or name is not None)
    if not adopt_labels and (wtu is None or block.metadata.get("when_to_use") == wtu):
        return block
    update: dict[str, Any] = {}
    if wtu is not None:
        update["metadata"] = {**block.metadata, "when_to_use": wtu}
    if adopt_labels and name is not None:
        update["name"] = name
    if adopt_labels:
        update["labels_trusted"] = True
    updated = block.model_copy(update=update)
    store.set_manifest(updated)
    log.info("block %s: labels updated%s", block.short_id, " and trusted" if adopt_labels else "")
    return store.get(block.id)


def prefill_and_store(engine: "Engine", store: "BlockStore", *, block_id: str, tokens: Sequence[int], text: str,
                      name: str, kind: str, metadata: Mapping[str, Any], parent: Optional[Block] = None,
                      progress: Optional[Callable[[int], None]] = None, replace: bool = False,
                      salts: Salts = NO_SALTS) -> Block:
    """Prefill ``tokens`` in a clean context (after grafting ``parent``, stored then as a delta), capture
    the state and put the block in ``store`` as ``local``; returns the stored block. ``replace``
    overwrites a block of the same id (an ``unverified`` one: this engine's own state replaces it).
    ``salts``: what ``block_id`` was salted with (`block_id_for`), recorded in the metadata; a block whose
    id is not the content address of what it records is never written."""
    with engine.session():
        if parent is not None:
            state, fields = capture_child(store, engine, parent, list(tokens), progress=progress)
        else:
            engine.prefill(tokens, progress=progress)
            state = engine.capture()
            fields = {"state_size": len(state), "state_digest": state_digest(state)}
        calls = engine.one_token_calls()  # thread-count-dependent cells (a one-token chunk): recorded
        block = Block(id=block_id, name=name, kind=kind, text=text, tokens=list(tokens), n_tokens=len(tokens),
                      fingerprint=engine.fingerprint,
                      metadata=salts.stamp({**metadata, **({"one_token_calls": calls} if calls else {})}),
                      **fields)
        check_block_id(block)
        stored = store.put(block, state, replace=replace, provenance=PROVENANCE_LOCAL, labels_trusted=True)
        if parent is None:  # the next graft of it comes from RAM (a copy: capture() reuses the engine buffer)
            admit_written(stored, bytes(state))
    log.info("learned block %s (%d tokens, %d state bytes)", stored.short_id, len(tokens), len(state))
    return stored


def learn(engine: "Engine", store: "BlockStore", text: str, *, name: Optional[str] = None, kind: str = "manual",
          metadata: Optional[Mapping[str, Any]] = None, progress: bool = False,
          when_to_use: Optional[str] = None, chat: bool = False, parent: Optional[str] = None,
          owner: Optional[str] = None,
          may_relabel: Optional[Callable[[Block], bool]] = None) -> tuple[Block, bool]:
    """Learn ``text`` as a block (see [`Memory.learn()`][graftmem.Memory.learn]); returns it and whether it changed
    (a new block, or new labels on a block learned before), which tells the caller to re-route it.

    ``owner``: the tenant the block belongs to (`graftmem.memory.access`): its name goes into the
    metadata and is mixed into the id, so another tenant's block of the same text is another block. A
    ``tenant`` in ``metadata`` (the operator naming an owner through the SDK) is the owner too: an
    owner is always in the id (`graftmem.core.identity`).
    ``may_relabel(existing)``: whether this caller may change the labels of a block already stored (a
    tenant may not relabel a block shared by the operator or another tenant); if not, it is returned as is."""
    if not text:
        raise ConfigError("cannot learn an empty text")
    if metadata is not None and SALTS_KEY in metadata:
        raise ConfigError(f"metadata key {SALTS_KEY!r} is reserved: it records what went into a block's id, "
                          "and only graftmem writes it")
    if owner is None and metadata is not None and isinstance(metadata.get(TENANT_KEY), str):
        owner = metadata[TENANT_KEY]
    if chat or when_to_use is not None:
        text, name, metadata = prepare_labels(engine, text, name, metadata, when_to_use, chat)
    pblock = None
    if parent is not None:
        if chat:
            raise ConfigError("chat=True cannot be chained on a parent block: learn the chat turn as a root")
        pblock = store.get(parent)
        err = incompatibility(pblock, engine.fingerprint)
        if err is not None:
            raise err
        if not pblock.trusted:
            raise UnverifiedBlock(f"block {pblock.short_id} ({pblock.name!r}) is {pblock.provenance}: a text "
                                  "chained on it would be prefilled after a state nothing here vouches for; "
                                  "re-derive it first (Memory.rederive) or learn its text here")
    tokens = engine.tokenize(text, add_special=pblock is None)
    if not tokens:
        raise ConfigError("the text has no tokens")
    start = pblock.pos_end if pblock is not None else 0
    if start + len(tokens) >= engine.n_ctx:
        raise ConfigError(f"text is {len(tokens)} tokens after {start} positions, the engine's n_ctx "
                          f"is {engine.n_ctx}: learn a long text as pages with learn_document (CLI: graftmem "
                          "learn-document FILE), or raise n_ctx (--config '{\"n_ctx\": N}')")
    # a prefill that ends with a one-token chunk (or grafts a parent with one) computes bytes of this thread
    # count (`Engine.one_token_calls`): engines with other thread counts learn other blocks
    one_token = engine.ends_with_one_token_call(len(tokens)) or \
        (pblock is not None and pblock.one_token_from is not None)
    salts = Salts(tenant=owner, one_token_threads=engine.n_threads if one_token else None)
    bid = block_id_for(engine.fingerprint, tokens, pblock.id if pblock is not None else None, salts)
    replace = False
    if store.contains(bid):
        existing = store.get(bid)
        if existing.trusted:
            if may_relabel is not None and not may_relabel(existing):
                return existing, False
            again = learned_again(store, existing, metadata, name)
            return again, again is not existing
        # never deduplicate onto an unverified block: its state may be another text's. This engine's
        # own prefill replaces it (one prefill, the same cost as a re-derivation, and always right)
        log.warning("block %s is %s: replacing its state with this engine's own prefill", existing.short_id,
                    existing.provenance)
        replace = True
    bar = progress_bar(len(tokens), f"learn {name or bid[:12]}", progress, min_total=1024,
                       segments=[(pblock.pos_end if pblock is not None else 0, len(tokens))])
    try:
        stored = prefill_and_store(engine, store, block_id=bid, tokens=tokens, text=text,
                                   name=name or default_name(text), kind=kind, metadata=metadata or {},
                                   parent=pblock, progress=bar.update if bar else None, replace=replace,
                                   salts=salts)
    finally:
        if bar:
            bar.close()
    return stored, True
