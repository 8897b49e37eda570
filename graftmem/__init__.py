"""graftmem: agent memory made of verified, byte-exact KV-cache blocks.

Learn a text once (its KV state goes to disk as a block); later graft the block into a fresh
llama.cpp context at its own positions and prefill only the query. The logits are byte-identical
to a fresh prefill of the same text, and :meth:`Memory.verify` proves it.
"""

from ._blocks import (Block, EngineConfig, Exactness, Fingerprint, Recall, Receipt, SampleResult,
                      StoreStats, VerificationRecord, VerifyReport)
from ._errors import (AccessDenied, BlockCorrupted, BlockNotFound, BlockRejected, BundleRejected,
                      ClosedError, ConfigError, EngineError, GraftmemError, IncompatibleBlock,
                      ModelNotFound, StoreError, StoreFull, StoreLocked, TransferError,
                      UntrustedBundle)
from ._async import AsyncMemory
from ._blocks import SearchHit
from ._memory import Memory
from ._router import Embedder, SentenceTransformerEmbedder
from ._models import MODELS, resolve_model

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
    "AsyncMemory",
    "Block",
    "BlockCorrupted",
    "BlockNotFound",
    "BlockRejected",
    "BundleRejected",
    "ClosedError",
    "ConfigError",
    "Embedder",
    "EngineConfig",
    "EngineError",
    "Exactness",
    "Fingerprint",
    "GraftmemError",
    "IncompatibleBlock",
    "MODELS",
    "Memory",
    "ModelNotFound",
    "Recall",
    "Receipt",
    "SampleResult",
    "SearchHit",
    "SentenceTransformerEmbedder",
    "StoreError",
    "StoreFull",
    "StoreLocked",
    "StoreStats",
    "TransferError",
    "UntrustedBundle",
    "VerificationRecord",
    "VerifyReport",
    "__version__",
    "resolve_model",
]
