"""`BlockSummary`: one line of a server's block listing, the typed result of `RemoteMemory.ls`."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from pydantic import BaseModel, ConfigDict

__all__ = ["BlockSummary"]


class BlockSummary(BaseModel):
    """One line of a server's block listing (``GET /v1/memory/blocks``): what ``graftmem ls`` shows,
    without the block's tokens and text (`RemoteMemory.get` fetches the whole `Block`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    name: str
    kind: str
    n_tokens: int
    parent: Optional[str] = None
    created_at: datetime
    when_to_use: Optional[str] = None
    state_size: int
    #: shared with every tenant of the server (the operator's blocks, and those a tenant shared)
    shared: bool = True
    #: the model that made it (its fingerprint's name)
    model: Optional[str] = None
    #: the engine settings it grafts under (``n_ctx=8192 kv=f16``: `Fingerprint.settings`)
    settings: Optional[str] = None
    #: the last exactness check (`Memory.verify`): passed, failed, or never run (None)
    verified: Optional[bool] = None
    #: where the state came from in the server's store (``"local"``, ``"rederived"``, ``"unverified"``, ...)
    provenance: Optional[str] = None
    #: whether the name and labels were given there or are covered by a trusted signature
    labels_trusted: Optional[bool] = None

    @property
    def short_id(self) -> str:
        return self.id[:12]
