"""Who may see which block: the tenant rule and the scope rule, in one place for every door.

Why one place: the server answers the same question ("may this requester see, route to, graft or
delete this block?") in the REST verbs, the block-sharing routes (``/v1/blocks``), the OpenAI routes'
routed recall and the prefix cache; `Memory` answers it for scopes. When each route filtered on its
own, REST dropped ``user_id``, recall routed to another tenant's blocks, and a learned block was
readable by every key (issue 24). Every door now asks an `Access`.

The rules (docs/security.md, "Tenants"):

* **Ownership is in the block**, as for automatic blocks: a block a tenant learned through the server
  carries ``metadata["tenant"]`` and its id is salted with the tenant (`graftmem.core.identity`), so two tenants
  learning the same text get two blocks: neither finds, reads, routes to, deletes nor even detects the
  other's (a shared id would answer "not new" and skip the prefill: an oracle for a guessed text).
* **Shared blocks** have no owner: the operator's (learned with the SDK or the CLI into the home, imported,
  pulled), and those a tenant learned with ``shared: true`` (or under ``serve --shared-learned``), which
  carry ``metadata["shared_by"]``. Every tenant sees them; only their sharer (or the operator) deletes them.
* **Scopes** (``user_id`` / ``agent_id`` / ``session_id``) live inside a tenant (`ScopeIndex` rows carry
  the tenant): a scope narrows what a tenant sees, it never widens it.
* ``tenant=None`` on a server is one local trust domain (no key file): it sees every block no tenant
  owns, as before tenants. The operator's view (``operator=True``, what `Memory` uses) sees everything.
* **Seeing is not grafting by itself** (`cache_tenant`): the prompt cache grafts, and chains what it
  learns on, only a chain no other tenant named: the requester's own blocks (owned or shared by it)
  and the operator's. A block another tenant shared is grafted only where the requester names it (REST
  ``ask`` by id, ``recall``, ``learn`` with it as ``parent``): otherwise B could share guesses of A's
  system prompt and read the hit off A's chain hanging on its block (issue 37).
* **Deleting tells nothing of what the requester does not see** (`delete`): another tenant's block is
  "not there" (the same 404, byte for byte); chains another tenant hung on a block the requester
  deletes are neither counted nor named, and go with it.
"""

from __future__ import annotations

import builtins
import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from ..core.blocks import Block, Scope
from ..core.identity import SALTS_KEY, TENANT_KEY
from ..core.errors import AccessDenied, BlockNotFound, ConfigError, GraftmemError
from ..store.local import checked_id
from . import validate as check

if TYPE_CHECKING:
    from ..store.protocol import BlockStore
    from ..store.scopes import ScopeIndex

__all__ = ["Access", "TENANT_KEY", "SHARED_BY_KEY", "RESERVED_METADATA", "owner_of", "visible",
           "reserved_metadata", "cache_tenant"]

#: the metadata key naming the tenant that learned a shared block (it may delete it)
SHARED_BY_KEY = "shared_by"
#: metadata keys a caller may not set: the server derives them from the API key, never from a request,
#: and the record of a block's id salts (`graftmem.core.identity`), which only the maker writes
RESERVED_METADATA = (TENANT_KEY, SHARED_BY_KEY, SALTS_KEY)

log = logging.getLogger("graftmem")

BlockFilter = Callable[[Block], bool]


def owner_of(block: Block) -> Optional[str]:
    """The tenant a block belongs to (None: shared, the operator's or shared by a tenant)."""
    t = block.metadata.get(TENANT_KEY)
    return t if isinstance(t, str) else None


def visible(block: Block, tenant: Optional[str]) -> bool:
    """Whether ``tenant`` (None: a server without tenants) may see (list, read, route to, graft) ``block``:
    a shared block always, an owned one only by its owner."""
    owner = owner_of(block)
    return owner is None or owner == tenant


def named_tenant(block: Block) -> Optional[str]:
    """The tenant a block names: its owner, or the tenant that shared it (None: the operator's)."""
    t = owner_of(block) or block.metadata.get(SHARED_BY_KEY)
    return t if isinstance(t, str) else None


def cache_tenant(chain: Sequence[Block]) -> tuple[bool, Optional[str]]:
    """Whose prompt cache may graft ``chain`` (root first) unasked, and chain what it learns on it:
    (whether any, whose). A chain that names no tenant is the operator's: every requester's (True,
    None); one that names one tenant (blocks it owns or shared) is that tenant's only (True, name); one
    that names two (a tenant chained on another's shared block by naming it as ``parent``) is no prompt
    cache's (False, None): it is grafted where its owner names it (REST ``ask``), never matched against
    a prompt. A block another tenant shared is thus never an oracle on the requester's prompt: a match
    would graft it, hang the requester's chain on it and count its tokens as cached."""
    names = {t for t in map(named_tenant, chain) if t is not None}
    if len(names) > 1:
        return False, None
    return True, (names.pop() if names else None)


def reserved_metadata(metadata: Optional[Mapping[str, Any]]) -> None:
    """A caller's metadata may not claim an owner or a sharer, nor the salts of an id: `ConfigError` naming the key."""
    for k in RESERVED_METADATA:
        if metadata is not None and k in metadata:
            if k == SALTS_KEY:
                raise ConfigError(f"metadata key {k!r} is reserved: it records what went into a block's id, "
                                  "and only graftmem writes it")
            raise ConfigError(f"metadata key {k!r} is reserved: the server derives a block's tenant from the "
                              "API key (learn with shared=true to share it)")


class Access:
    """One requester's view of a store: which blocks it sees (tenant), narrowed by a scope and filters.

    ``tenant``: the requester's tenant (None: no tenants, one trust domain). ``operator``: the home's
    owner (the SDK, the CLI), who sees every block and every tenant's scope rows. ``scopes``: the home's
    `ScopeIndex` (called when a scope is first used: opening it costs a SQLite connection)."""

    def __init__(self, store: "BlockStore", tenant: Optional[str] = None, *,
                 scopes: "Optional[Callable[[], ScopeIndex]]" = None, operator: bool = False) -> None:
        self.store, self.tenant, self.operator = store, tenant, operator
        self._scopes = scopes

    @property
    def scope_tenant(self) -> Optional[str]:
        """The tenant whose scope rows this view reads and writes (None: every tenant's, the operator's)."""
        return None if self.operator else (self.tenant or "")

    def scopes(self) -> "ScopeIndex":
        if self._scopes is None:
            raise ConfigError("scopes (user_id, agent_id, session_id) are not available here")
        return self._scopes()

    # ------------------------------------------------------------------ seeing
    def sees(self, block: Block) -> bool:
        """Whether this requester may see ``block`` at all (its tenant's rule; the operator sees all)."""
        return self.operator or visible(block, self.tenant)

    def allow(self, scope: Optional[Scope] = None, filters: Optional[Mapping[str, Any]] = None,
              kind: Optional[str] = None) -> Optional[BlockFilter]:
        """The predicate of the blocks this requester may see within ``scope``, with the ``filters``
        metadata values and of ``kind``; None when it would accept every block (the operator, no filter)."""
        if filters is not None and not isinstance(filters, Mapping):
            raise ConfigError(f"filters must be a mapping of metadata field -> value, got {type(filters).__name__}")
        scoped = scope is not None and not scope.empty
        if self.operator and not scoped and not filters and kind is None:
            return None
        owned = self.scopes().blocks_of(scope, self.scope_tenant) if scoped else None  # type: ignore[arg-type]
        want = dict(filters or {})

        def allow(b: Block) -> bool:
            return (self.sees(b) and (owned is None or b.id in owned) and (kind is None or b.kind == kind)
                    and all(b.metadata.get(k) == v for k, v in want.items()))
        return allow

    def scopes_of(self, block: Block) -> builtins.list[Scope]:
        """The scopes that own ``block`` as this requester may know them: its tenant's rows only (another
        tenant's ``user_id`` of a shared block is that tenant's business); the operator's view: every row."""
        return self.scopes().owners(block.id, self.scope_tenant)

    def list(self, kind: Optional[str] = None, scope: Optional[Scope] = None,
             filters: Optional[Mapping[str, Any]] = None) -> list[Block]:
        """The blocks of ``kind`` this requester sees within ``scope`` (and ``filters``)."""
        allow = self.allow(scope, filters)
        return [b for b in self.store.list(kind=kind) if allow is None or allow(b)]

    def get(self, block_id: Any, scope: Optional[Scope] = None) -> Block:
        """The block ``block_id`` (id or unique prefix) if this requester sees it within ``scope``; else
        `BlockNotFound`, exactly as for a missing block. A prefix is resolved among the blocks this
        requester sees (one that is ambiguous only with another tenant's block would tell that it exists)."""
        check.text("block id", block_id)
        block: Optional[Block] = None
        try:
            if self.operator or checked_id(block_id):
                block = self.store.get(block_id)
            else:
                hits = [b for b in self.store.list() if b.id.startswith(block_id) and self.sees(b)]
                if len(hits) > 1:
                    raise ConfigError(f"block id prefix {block_id!r} is ambiguous: give more characters")
                block = hits[0] if hits else None
        except BlockNotFound:
            block = None
        allow = self.allow(scope)
        if block is None or (allow is not None and not allow(block)):
            raise BlockNotFound(f"no block {block_id[:64]!r} in this store")
        return block

    # ------------------------------------------------------------------ changing
    def may_delete(self, block: Block) -> bool:
        """Its owner deletes a block; a shared one only its sharer; the operator and a server without
        tenants (one trust domain) delete any block they see."""
        if self.operator or self.tenant is None:
            return self.sees(block)
        return owner_of(block) == self.tenant or block.metadata.get(SHARED_BY_KEY) == self.tenant

    def delete(self, block_id: Any, scope: Optional[Scope] = None,
               cascade: bool = False) -> tuple[str, builtins.list[str], builtins.list[str]]:
        """Delete the block ``block_id`` (`get`: another tenant's is not there) for this requester: (its id,
        every id deleted, the deleted ids it sees). What the requester does not see is neither counted,
        named nor checked: chains another tenant hung on the block (by naming it as ``parent``) go with
        it, so the answer is the same whether they exist or not (their owner chose to depend on a block
        it does not control). Without ``cascade`` a block with children the requester sees is refused,
        naming those; with it, each descendant it sees must be its to delete. `AccessDenied`: a visible
        block this requester may not delete (shared with every tenant by another, or the operator's)."""
        for _ in range(3):
            block = self.get(block_id, scope)
            if not self.may_delete(block):
                raise self._not_yours(block)
            hidden: list[str] = []  # children it does not see: their chains go with the block, unnamed
            seen, kids_seen = {block.id}, []
            todo, walked = [block.id], 0
            while todo and walked < 100_000:
                for kid in map(self.store.get, self.store.children(todo.pop())):
                    walked += 1
                    if not self.sees(kid):
                        hidden.append(kid.id)
                    elif not cascade:
                        kids_seen.append(kid)
                    elif not self.may_delete(kid):
                        raise self._not_yours(kid)
                    else:
                        seen.add(kid.id)
                        todo.append(kid.id)
                if not cascade:
                    break
            if kids_seen:
                raise ConfigError(f"block {block.short_id} has {len(kids_seen)} chained child block(s) "
                                  f"({', '.join(b.short_id for b in kids_seen)}) whose states are rebuilt from "
                                  "its bytes; delete them first, or delete them too (CLI: --cascade; Python: cascade=True; REST: ?cascade=true)")
            try:
                if cascade:
                    gone = self.store.delete(block.id, cascade=True)
                else:
                    gone = [g for kid in hidden for g in self.store.delete(kid, cascade=True)]
                    gone += self.store.delete(block.id)
            except (BlockNotFound, ConfigError):  # chained on or deleted meanwhile: look again
                continue
            return block.id, gone, [g for g in gone if g in seen]
        raise ConfigError(f"block {block_id[:64]!r} kept changing while it was deleted: try again")

    @staticmethod
    def _not_yours(block: Block) -> AccessDenied:
        return AccessDenied(f"block {block.short_id} ({block.name!r}) is shared with every tenant: only the tenant "
                            "that shared it, or the operator (`graftmem delete`), deletes it")

    def owns(self, shared: bool) -> tuple[Optional[str], Optional[str]]:
        """(owner, sharer) of a block this requester learns: an unshared block is its tenant's (salted id,
        ``metadata["tenant"]``), a shared one everybody's (``metadata["shared_by"]`` names the tenant);
        without tenants, or for the operator, neither."""
        if self.operator or self.tenant is None:
            return None, None
        return (None, self.tenant) if shared else (self.tenant, None)

    def own(self, block: Block, scope: Optional[Scope], changed: bool, started: datetime) -> None:
        """Record that ``scope`` (of this requester's tenant) learned ``block``, and the history event.
        All or nothing: when the scope cannot be written (a full disk), a block this learn created
        (``changed`` and created after ``started``) is deleted again and the error raised, so it is not
        left behind unowned and without its history; the caller retries the whole learn."""
        scoped = scope is not None and not scope.empty
        if not scoped and not changed:
            return
        try:
            idx = self.scopes()
            if scoped:
                idx.add(block.id, scope, self.scope_tenant)  # type: ignore[arg-type]
            details = {"name": block.name, "kind": block.kind,
                       **(scope.model_dump(exclude_none=True) if scoped else {}),  # type: ignore[union-attr]
                       **({"tenant": self.tenant} if self.tenant is not None and not self.operator else {})}
            idx.record(block.id, "learned" if changed else "learned_again", details)
        except GraftmemError:
            if changed and block.created_at >= started:
                try:
                    self.store.delete(block.id)
                    self.scopes().remove(block.id)
                except GraftmemError as exc:
                    log.warning("learn: block %s could not be removed after its scope write failed: %s",
                                block.short_id, exc)
            raise

    def forget(self, block_ids: "builtins.list[str]", cascade_from: Optional[str] = None) -> None:
        """Drop every scope row of deleted blocks (a later learn of the same text starts unscoped) and
        record their deletion in the history."""
        if self._scopes is None:
            return
        for bid in block_ids:
            self.scopes().remove(bid)
            self.scopes().record(bid, "deleted", {"cascade_from": cascade_from}
                                 if cascade_from is not None and bid != cascade_from else {})

    def forget_scope(self, scope: Scope, cascade: bool = False) -> tuple[builtins.list[str], builtins.list[str]]:
        """Forget every block of ``scope`` (mem0's ``delete_all(user_id=...)``): a block no other scope
        owns is deleted (`delete`, chained children first, ``cascade`` as there); one that another scope
        also learned stays theirs, only this scope's ownership goes. Returns (ids deleted, ids kept for
        other owners); the history records both. Blocks are content-addressed, so deleting a shared one
        would take it from its other owners too: that is what `delete` by id does, on purpose."""
        if scope.empty:
            raise ConfigError("give a scope (user_id, agent_id or session_id) whose blocks to forget")
        idx = self.scopes()
        mine = sorted(self.list(scope=scope), key=lambda b: -b.pos_start)  # chained children sit later: first
        deleted: builtins.list[str] = []
        kept: builtins.list[str] = []
        for b in mine:
            if b.id in deleted:  # gone with a cascade
                continue
            others = [o for o in idx.owners(b.id) if any(getattr(scope, f) not in (None, getattr(o, f))
                                                          for f in ("user_id", "agent_id", "session_id"))]
            if others:
                idx.remove(b.id, scope, self.scope_tenant)
                idx.record(b.id, "forgotten", scope.model_dump(exclude_none=True))
                kept.append(b.id)
                continue
            _, gone, _ = self.delete(b.id, cascade=cascade)
            self.forget(gone, cascade_from=b.id)
            deleted += gone
        return deleted, kept
