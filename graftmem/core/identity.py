"""A block's identity, made and checked in one place: its content id, and whether it may graft here.

Why one place: a block's id is its content address (the LMCache lesson: identity inside the key), and
it was made in four places (learn, the prefix cache, stored responses, the pager) with salts that only
the makers knew, while the readers (bundle import and export, pull, push) recomputed it without them:
every block a server had made was refused as "forged" on its way out (issue 38). Now every maker calls
`block_id_for` with the block's `Salts`, records them in the block's metadata, and every reader
recomputes the id with `content_id` from the block alone.

What decides an id: the engine fingerprint's identity digest, the parent id, the token ids, and the
salts, each mixed in only when present (so the ids of unsalted blocks, and of every block written
before this module, are unchanged):

* ``tenant``: the tenant that owns the block (`graftmem.memory.access`); its SHA-256 is mixed in, so
  two tenants' blocks of one text are two blocks (a shared id would be an oracle for a guessed text);
* ``response``: the id of the stored response the block holds (`graftmem.server.responses`), so each
  stored turn is its own block even when two responses generated the same tokens;
* ``one_token_threads``: the thread count of the one-token calls whose cells the state holds
  (`graftmem.core.engine.Engine.one_token_calls`: each count computes its own bytes).

Where a reader finds them: each value lives in its own metadata field (``tenant``, ``response.id``,
``one_token_calls.threads``: what the rest of graftmem reads them from), and ``id_salts`` lists the
names of those that went into the id, in order. A block written before ``id_salts`` existed has the
fields but not the list: its salts are inferred from the fields (`salts_of`), see `check_block_id`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .blocks import Block, EngineConfig, Fingerprint
from .errors import BlockCorrupted, IncompatibleBlock

__all__ = ["Salts", "NO_SALTS", "SALT_NAMES", "SALTS_KEY", "TENANT_KEY", "RESPONSE_KEY", "ONE_TOKEN_KEY",
           "block_id_for", "salts_of", "content_id", "check_block_id", "id_problem", "incompatibility"]

#: the metadata key listing the salts mixed into a block's id (their names, in `SALT_NAMES` order)
SALTS_KEY = "id_salts"
#: the metadata key naming the tenant that owns a block (the value of its ``tenant`` salt)
TENANT_KEY = "tenant"
#: the metadata key of a stored response's record; its ``id`` is the value of the ``response`` salt
RESPONSE_KEY = "response"
#: the metadata key of what a state records of its one-token calls; its ``threads`` is the
#: ``one_token_threads`` salt (`Block.one_token_calls`)
ONE_TOKEN_KEY = "one_token_calls"
#: every salt, in the order they are mixed in (the order the makers used before they were named)
SALT_NAMES = ("tenant", "response", "one_token_threads")


@dataclass(frozen=True)
class Salts:
    """What a block's id is salted with, besides fingerprint, parent and tokens (None: not salted with it)."""

    tenant: Optional[str] = None
    response: Optional[str] = None
    one_token_threads: Optional[int] = None

    def names(self) -> list[str]:
        """The names of the salts present, in `SALT_NAMES` order: what ``metadata["id_salts"]`` records."""
        return [n for n in SALT_NAMES if getattr(self, n) is not None]

    def without(self, *names: str) -> "Salts":
        return Salts(**{n: (None if n in names else getattr(self, n)) for n in SALT_NAMES})

    def _suffix(self) -> str:
        # the exact strings the makers mixed in before this module (ids on disk must not change)
        out = ""
        if self.tenant is not None:
            out += f"|tenant:{hashlib.sha256(self.tenant.encode('utf-8')).hexdigest()}"
        if self.response is not None:
            out += f"|response:{self.response}"
        if self.one_token_threads is not None:
            out += f"|one-token-threads={self.one_token_threads}"
        return out

    def stamp(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """``metadata`` with the record of these salts, for a new block: the tenant's name in ``tenant``
        and the list in ``id_salts``. The list is written wherever a salt went in, and also where a field
        that could be one is present without it (a page with one-token calls: `graftmem.memory.pager`),
        so a reader never has to infer; a block with neither keeps its metadata as before."""
        out = dict(metadata)
        if self.tenant is not None:
            out[TENANT_KEY] = self.tenant
        names = self.names()
        if names or any(k in out for k in (TENANT_KEY, RESPONSE_KEY, ONE_TOKEN_KEY)):
            out[SALTS_KEY] = names
        else:
            out.pop(SALTS_KEY, None)
        return out


NO_SALTS = Salts()


def block_id_for(fingerprint: Fingerprint, tokens: Sequence[int] | np.ndarray, parent: Optional[str] = None,
                 salts: Salts = NO_SALTS) -> str:
    """The content address of a block: SHA-256 over the fingerprint's identity digest, the parent id
    followed by each salt present (see `Salts`), and the token ids (little-endian int32). The one
    function every maker of a block and every reader of one calls."""
    if not isinstance(salts, Salts):  # the fourth argument was the one-token thread count before issue 38
        raise TypeError(f"salts must be a graftmem.core.identity.Salts (e.g. Salts(one_token_threads=2)), "
                        f"not {type(salts).__name__}")
    h = hashlib.sha256()
    h.update(fingerprint.digest().encode())
    h.update(b"\0" + ((parent or "") + salts._suffix()).encode() + b"\0")
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()


def _fields(block: Block) -> Salts:
    """The salt values a block's metadata holds in their own fields (whether or not they went in)."""
    meta = block.metadata
    tenant = meta.get(TENANT_KEY)
    rec = meta.get(RESPONSE_KEY)
    rid = rec.get("id") if isinstance(rec, dict) else None
    calls = meta.get(ONE_TOKEN_KEY)
    threads = calls.get("threads") if isinstance(calls, dict) else None
    return Salts(tenant=tenant if isinstance(tenant, str) else None, response=rid if isinstance(rid, str) else None,
                 one_token_threads=threads if isinstance(threads, int) and not isinstance(threads, bool) else None)


def salts_of(block: Block) -> Salts:
    """The salts of ``block``'s id, read from the block alone.

    A block that records ``id_salts`` gets exactly those, each value read from its field; a listed salt
    whose field is missing, an unknown name (a newer graftmem's salt) or an owner that is not in the id
    is [`BlockCorrupted`][graftmem.BlockCorrupted]. A block without the record (written before it) gets
    every salt its fields hold: its most likely id (`check_block_id` tries the others it may have)."""
    fields = _fields(block)
    names = block.metadata.get(SALTS_KEY)
    if names is None:
        return fields
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BlockCorrupted(f"block {block.short_id}: metadata {SALTS_KEY!r} must be a list of salt names, "
                             f"not {names!r}")
    unknown = [n for n in names if n not in SALT_NAMES]
    if unknown:
        raise BlockCorrupted(f"block {block.short_id}: its id is salted with {', '.join(unknown)}, which this "
                             f"graftmem does not know (it knows {', '.join(SALT_NAMES)}): upgrade graftmem to "
                             "check it")
    missing = [n for n in names if getattr(fields, n) is None]
    if missing:
        raise BlockCorrupted(f"block {block.short_id}: its id is salted with {', '.join(missing)} but its "
                             "metadata does not hold the value: the manifest was forged or damaged")
    if fields.tenant is not None and "tenant" not in names:
        # an owner outside the id: two tenants' blocks of one text could share it (the oracle it prevents)
        raise BlockCorrupted(f"block {block.short_id}: it names tenant {fields.tenant!r} as its owner but its "
                             "id is not salted with it: the manifest was forged or damaged")
    return Salts(**{n: getattr(fields, n) for n in names})


def content_id(block: Block) -> str:
    """The id ``block`` must have: `block_id_for` over its fingerprint, tokens, parent and `salts_of`."""
    return block_id_for(block.fingerprint, block.tokens, block.parent, salts_of(block))


def id_problem(block: Block) -> Optional[str]:
    """Why ``block.id`` is not the content address of what the block says it is (None: it is).

    Tenant, tokens, parent, fingerprint and every recorded salt are bound: a block relabelled with
    another owner (or none), other tokens or another parent is refused. A block without the
    ``id_salts`` record (written before it) is checked against the salts its fields hold, and, where that
    fails, without its ``response`` and/or ``one_token_threads`` salt: blocks that held those fields
    without salting with them were written (a page with one-token calls: `graftmem.memory.pager` never
    salted them; metadata a caller named ``response``). Its tenant is never dropped: an owner must be in
    the id. So an old block may carry a one-token thread count its id does not bind, which only ever
    made it refuse to graft on other thread counts; re-derivation (the default on import) proves its
    state either way."""
    try:
        salts = salts_of(block)
    except BlockCorrupted as exc:
        return str(exc)
    if block_id_for(block.fingerprint, block.tokens, block.parent, salts) == block.id:
        return None
    if SALTS_KEY not in block.metadata:
        for drop in (("response",), ("one_token_threads",), ("response", "one_token_threads")):
            alt = salts.without(*drop)
            if alt != salts and block_id_for(block.fingerprint, block.tokens, block.parent, alt) == block.id:
                return None
    said = ", ".join(f"{n}={getattr(salts, n)!r}" for n in salts.names()) or "none"
    return (f"block id {block.short_id} is not the content address of its fingerprint, parent, tokens and "
            f"salts ({said}): the manifest was forged or damaged")


def check_block_id(block: Block, where: Optional[str] = None) -> Block:
    """``block`` if its id is its content address (`id_problem`), else [`BlockCorrupted`][graftmem.BlockCorrupted]."""
    why = id_problem(block)
    if why is not None:
        raise BlockCorrupted(f"{where}: {why}" if where else why, path=where)
    return block


def incompatibility(block: Block, fingerprint: Fingerprint) -> IncompatibleBlock | None:
    """An [`IncompatibleBlock`][graftmem.IncompatibleBlock] naming every differing identity field, or None:
    the one rule of whether a block may graft into an engine of ``fingerprint``.

    The thread count is not an identity field (a prefill's bytes do not depend on it), except for a block
    whose cells include one-token calls (a decoded answer, a one-token prompt chunk): it records their
    thread count (``metadata["one_token_calls"]``, `Engine.one_token_calls`), which must then be this
    engine's ``n_threads`` (llama.cpp's flash attention splits a one-token call by thread)."""
    diff = block.fingerprint.diff(fingerprint)
    calls = block.one_token_calls
    if calls is not None and calls.get("threads") != fingerprint.n_threads:
        diff = {**diff, "n_threads": (calls.get("threads"), fingerprint.n_threads)}
        if len(diff) == 1:
            return IncompatibleBlock(
                f"block {block.short_id} holds cells computed by one-token calls on {calls.get('threads')!r} "
                f"thread(s) and this engine runs them on {fingerprint.n_threads} (llama.cpp's flash-attention "
                f"kernel splits a one-token call's attention by thread, so the bytes differ): open the engine "
                f"with n_threads={calls.get('threads')!r} to graft it, or learn it again here", fields=diff)
    if not diff:
        return None
    parts = ", ".join(f"{k}={a!r} (this engine has {b!r})" for k, (a, b) in diff.items())
    return IncompatibleBlock(f"block {block.short_id} was made with {parts}; it cannot be grafted "
                             f"into this engine: {same_settings(diff)}, or learn it again here", fields=diff)


def same_settings(diff: dict[str, tuple[object, object]]) -> str:
    """How to open an engine like the one a block was made in, for the fingerprint fields that differ
    (``diff``: field -> (the block's, this engine's)): the settings a user gives (config keys, the model),
    or, for what no setting chooses (llama.cpp's build, the CPU), where the block must be used."""
    config = {k: a for k, (a, _) in diff.items() if k in EngineConfig.model_fields}
    said = []
    if config:
        said.append(f"open the engine with the same settings (config {json.dumps(config)}; CLI: the same "
                    f"--config, `graftmem ls` shows each block's)")
    if any(k.startswith("model") for k in diff):
        said.append("the same model (--model)")
    if not said:
        said.append("use it where it was made (same llama.cpp build and CPU features)")
    return " and ".join(said)
