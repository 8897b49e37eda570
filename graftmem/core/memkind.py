"""What a model's per-sequence memory IS, and which graftmem features can be exact on it. Pure: no
llama_cpp (the engine reads the model and builds a `MemoryKind`).

Why one place: every feature that reuses a state in some other way than a whole graft at its own end
rests on a property of the memory, and the properties differ per architecture (docs/models.md has the
table, measured on tiny random-weight GGUFs of each, tests/test_architectures.py):

* **attention** (llama, Qwen3-MoE, DeepSeek 2's latent attention): a KV cache writes one cell per
  position, never touched by later tokens. Trimming the cells back to a prefix (``llama_memory_seq_rm``)
  leaves exactly the cells a fresh prefill of the prefix leaves, and the state of a prefix can be cut
  out of a longer state's bytes (`graftmem.core.statefmt.cut`).
* **window** (Gemma 3, GPT-OSS: interleaved sliding-window layers): trimming is exact with a full-size
  window cache (``swa_full``, which the exactness rules already require); a state longer than the window
  lacks the cells a shorter prefix's window holds, so it cannot be cut: capture at the prefix's end.
* **recurrent** (Mamba, Mamba-2) and **hybrid** (Qwen 3.5 / Qwen3-Next: gated delta net; Granite 4 and
  Nemotron-H: Mamba-2; LFM2: short convolutions; each with attention layers): the recurrent layers keep
  ONE state, the one after the last position, overwritten by every token. Nothing shorter can be
  trimmed or cut out of it. A whole graft at the block's own end is exact (the state is exactly what
  the prefill left); so is a chain of blocks, each captured at its own end. What needs a shorter
  prefix is refused by name (`UnsupportedFeature`) or done another exact way: the server captures each
  learned prefix at its segment's end during the prefill it runs anyway, verify re-prefills instead of
  trimming, the in-RAM prompt reuse only continues cells that end where the new prompt's shared part
  does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import UnsupportedFeature

__all__ = ["MemoryKind", "KINDS"]

Kind = Literal["attention", "window", "recurrent", "hybrid"]

#: What each kind's state holds, in words (errors and docs/models.md).
KINDS: dict[str, str] = {
    "attention": "a KV cache: one cell per position",
    "window": "KV caches, some of them sliding windows that keep only the last positions",
    "recurrent": "recurrent layers only: one state, the one after the last position",
    "hybrid": "attention layers (one KV cell per position) and recurrent layers (one state, the one after "
              "the last position)",
}


@dataclass(frozen=True)
class MemoryKind:
    """A model's memory as graftmem needs to know it: its llama.cpp architecture name, its kind, its
    sliding window (0: none) and whether its attention caches a latent (MLA) instead of K and V."""

    arch: str
    kind: Kind
    n_swa: int = 0
    latent: bool = False

    @property
    def trims(self) -> bool:
        """Whether cells can be removed from the end (``Engine.trim``) leaving a fresh prefix's state."""
        return self.kind in ("attention", "window")

    @property
    def cuts(self) -> bool:
        """Whether the state of a prefix can be cut out of one capture of a longer sequence."""
        return self.kind == "attention"

    @property
    def recurrent(self) -> bool:
        """Whether some layers keep a recurrent state (recurrent or hybrid)."""
        return self.kind in ("recurrent", "hybrid")

    def describe(self) -> str:
        extra = f", sliding window {self.n_swa}" if self.n_swa else ""
        extra += ", latent attention (MLA)" if self.latent else ""
        return f"{self.arch} ({self.kind} memory: {KINDS[self.kind]}{extra})"

    def refusal(self, feature: str, instead: str) -> UnsupportedFeature:
        """The error for a feature this memory cannot do exactly: names the architecture, the feature,
        why, and what works instead."""
        return UnsupportedFeature(f"{feature} is not exact on {self.describe()}: the state of a shorter "
                                  f"prefix is not kept. {instead}", arch=self.arch, feature=feature)
