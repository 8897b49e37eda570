"""Re-derivation: the proof that a block holds the state of its own tokens and nothing else.

A digest proves that bytes arrived as they were sent; it cannot prove that they are the state of the
block's text. Only a prefill can: `rederive()` prefills the block's tokens in a clean context
(a chained block: its whole chain, call by call) and compares the captured state with the stored
bytes. It lives with the features (not with the signatures of `graftmem.share.trust`) because it
runs the engine; the share layer receives it as a check callable when a caller asks for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..core.blocks import Block
from ..core.errors import BlockCorrupted, ConfigError
from ..core.format import state_digest
from ..store.chain import calls_of, full_state, segments
from ..core.identity import check_block_id, incompatibility
from ..store.local import read_block_file

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..store.protocol import BlockStore

__all__ = ["RederiveReport", "compare_rederived", "rederive", "rederive_file", "rederive_state"]


class RederiveReport(BaseModel):
    """Stored state vs the state re-derived from the block's own tokens, byte for byte."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_id: str
    n_tokens: int
    stored_digest: str
    derived_digest: str
    stored_size: int
    derived_size: int
    first_difference: Optional[int] = None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.stored_size == self.derived_size and self.first_difference is None


def compare_rederived(engine: "Engine", block: Block, stored: memoryview,
                       segs: Optional[list[list[int]]] = None) -> RederiveReport:
    """Prefill ``block.tokens`` (in the calls it records, `calls_of`; for a chain, each of ``segs`` in its
    own call) in a clean context and compare the captured state with ``stored``. A block whose id is not
    its content address (`graftmem.core.identity.check_block_id`) is
    [`BlockCorrupted`][graftmem.BlockCorrupted] before any prefill."""
    t0 = time.perf_counter()
    eng = engine
    # a state proven for tokens under a forged id would answer, in this store, for whatever text owns that id
    check_block_id(block)
    if segs is None and (block.parent is not None or block.pos_start != 0):
        raise ConfigError(f"block {block.short_id} continues block {str(block.parent)[:12]}: it cannot "
                          "be re-derived alone; re-derive it from a store that holds its chain")
    err = incompatibility(block, eng.fingerprint)
    if err is not None:
        raise err
    with eng.session():
        for seg in (segs if segs is not None else calls_of(block)):
            eng.prefill(seg)
        derived = eng.capture()
        a = np.frombuffer(stored, dtype=np.uint8)
        b = np.frombuffer(derived, dtype=np.uint8)
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        first = int(diff[0]) if len(diff) else (n if len(a) != len(b) else None)
        ddig = state_digest(derived)
    return RederiveReport(block_id=block.id, n_tokens=block.n_tokens, stored_digest=state_digest(stored),
                          derived_digest=ddig, stored_size=len(a), derived_size=len(b),
                          first_difference=first, seconds=time.perf_counter() - t0)


def rederive(engine: "Engine", store: "BlockStore", block_id: str) -> RederiveReport:
    """Prefill the block's stored tokens in a clean context and compare the captured state with the
    stored state bytes (read through the digest check): equal bytes prove the block holds exactly
    the text it claims and no hidden state. A block whose state was swapped for another text's, with
    its digests rewritten to match, passes every digest check and fails here.

    A chained block is re-derived as its chain: every block from the root prefilled in its own call
    (the sequential fresh reference of `graftmem.store.chain`), compared with the full state the store
    rebuilds from the parent and the delta.
    """
    block = store.get(block_id)
    return compare_rederived(engine, block, memoryview(full_state(store, block)), segs=segments(store, block))


def rederive_file(engine: "Engine", block: Block, path: Path) -> None:
    """Re-derive a block from a (checked) block file that is not in the store yet, such as a staged
    import; raise [`BlockCorrupted`][graftmem.BlockCorrupted] if its state is not what its tokens produce."""
    _, view = read_block_file(path, lambda n: memoryview(bytearray(n)), expect_id=block.id)
    rep = compare_rederived(engine, block, view)
    if not rep.ok:
        raise BlockCorrupted(f"block {block.short_id} ({block.name!r}): its state is not what its "
                             f"{block.n_tokens} tokens produce (first difference at byte "
                             f"{rep.first_difference:,}): it holds something other than its text; "
                             "refusing it", path=str(path), expected=rep.derived_digest,
                             actual=rep.stored_digest)


def rederive_state(engine: "Engine", block: Block, state: memoryview, segs: list[list[int]]) -> None:
    """The admission's re-derivation (`Vetting`): prefill ``segs`` (the
    chain's token ids, root first, each in its own call) and raise [`BlockCorrupted`][graftmem.BlockCorrupted] unless the
    captured state equals ``state`` (the block's full state) byte for byte."""
    rep = compare_rederived(engine, block, state, segs=segs)
    if not rep.ok:
        raise BlockCorrupted(f"block {block.short_id} ({block.name!r}): its state is not what its "
                             f"{block.n_tokens} tokens produce (first difference at byte "
                             f"{rep.first_difference:,}): it holds something other than its text; "
                             "refusing it", expected=rep.derived_digest, actual=rep.stored_digest)
