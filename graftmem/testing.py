"""Helpers for testing code that uses graftmem: an embedder that needs no torch.

Why: routing needs an embedder, and the packaged MiniLM costs torch, sentence-transformers and a few
seconds of loading in every process that routes. A test of *your* code's plumbing (that it learns the
right texts, passes ``when_to_use``, handles "no block matched") does not need semantic similarity,
only a deterministic one. `HashEmbedder` gives that: texts that share words get close vectors, texts
that share none are nearly orthogonal, and the same text always gets the same vector, in any process,
on any machine (the hashing is BLAKE2, not Python's salted ``hash``).

It is NOT a routing model: "reimburse" and "refund" share no word, so it cannot tell that they are
close. Tests of routing *quality* keep the real embedder (graftmem's own do).

    from graftmem import Memory
    from graftmem.testing import HashEmbedder

    with Memory(embedder=HashEmbedder()) as mem:
        mem.learn("Refunds: ask for the order number first.", name="refunds",
                  when_to_use="refund an order")
        print(mem.search("refund order NW-1", top_k=1)[0].name)   # refunds
"""

from __future__ import annotations

import hashlib
import re
from typing import Sequence

import numpy as np

__all__ = ["HashEmbedder"]

_WORD = re.compile(r"\w+", re.UNICODE)


class HashEmbedder:
    """A deterministic bag-of-words embedder: each lower-cased word (and each pair of neighbouring
    words, weighted half) adds +-1 to one of ``dim`` coordinates chosen by its BLAKE2b digest; rows are
    L2-normalized. Implements `graftmem.memory.router.Embedder` (and ``count_tokens``, which the
    server's ``/v1/embeddings`` reports as usage)."""

    def __init__(self, dim: int = 256) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 8:
            raise ValueError(f"dim must be an integer >= 8, got {dim!r}")
        self.dim = dim
        #: recorded by the router's index: an index built with another embedder (or another dim) is rebuilt
        self.model_id = f"graftmem.testing.HashEmbedder/{dim}"

    def _slot(self, feature: str) -> tuple[int, float]:
        h = hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest()
        value = int.from_bytes(h, "little")
        return value % self.dim, 1.0 if (value >> 63) & 1 else -1.0

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            words = _WORD.findall(text.lower())
            features = [(w, 1.0) for w in words] + [(f"{a} {b}", 0.5) for a, b in zip(words, words[1:])]
            for feature, weight in features:
                slot, sign = self._slot(feature)
                out[row, slot] += sign * weight
            norm = float(np.linalg.norm(out[row]))
            if norm > 0:
                out[row] /= norm
        return out

    def count_tokens(self, texts: Sequence[str]) -> int:
        """Words read for ``texts`` (what an embeddings API reports as usage)."""
        return sum(len(_WORD.findall(t)) for t in texts)
