"""graftmem: agent memory made of verified, byte-exact KV-cache blocks.

Learn a text once (its KV state goes to disk as a block); later graft the block into a fresh
llama.cpp context at its own positions and prefill only the query. The logits are byte-identical
to a fresh prefill of the same text, and [`Memory.verify()`][graftmem.Memory.verify] proves it.

This module is the public API. The layers below it (``graftmem.core``, ``graftmem.store``,
``graftmem.memory``, ``graftmem.share``, ``graftmem.server``) export documented names for advanced use;
their modules are private. docs/architecture.md explains the layering.
"""

from .api import AsyncMemory, Memory
from .core import (Block, Engine, EngineConfig, Exactness, Fingerprint, HistoryEvent, Recall, Receipt, SampleResult,
                   Sampling, Scope, SearchHit, StoreStats, VerificationRecord, VerifyReport, logits_sha256)
from .core.errors import (AccessDenied, BlockCorrupted, BlockNotFound, BlockRejected, BundleRejected,
                          ClosedError, ConfigError, EngineError, GraftmemError, IncompatibleBlock,
                          ModelNotFound, StoreError, StoreFull, StoreLocked, StoreReadOnly, TransferError,
                          UnverifiedBlock, UntrustedBundle)
from .core.models import MODELS, resolve_model
from .core.version import __version__
from .memory import (Attempt, CallableVerifier, Candidate, DocumentAnswer, DocumentReport, Embedder, ExactMatch,
                     Flywheel, Gate, GateReport, PageInfo, PassageHit, ProgramRun, ProgramVerifier, RederiveReport,
                     SentenceTransformerEmbedder, Solution, SolverOutput, Verdict, Verifier, run_program)
from .server import BlockServer
from .share import BundleManifest, ExportReport, PublicKey, SigningKey, TransferReport, TrustPolicy
from .store import FleetStore, Store

__all__ = [
    "AccessDenied",
    "AsyncMemory",
    "Attempt",
    "Block",
    "BlockCorrupted",
    "BlockNotFound",
    "BlockRejected",
    "BlockServer",
    "BundleManifest",
    "BundleRejected",
    "CallableVerifier",
    "Candidate",
    "ClosedError",
    "ConfigError",
    "DocumentAnswer",
    "DocumentReport",
    "Embedder",
    "Engine",
    "EngineConfig",
    "EngineError",
    "ExactMatch",
    "Exactness",
    "ExportReport",
    "Fingerprint",
    "FleetStore",
    "Flywheel",
    "Gate",
    "GateReport",
    "GraftmemError",
    "HistoryEvent",
    "IncompatibleBlock",
    "MODELS",
    "Memory",
    "ModelNotFound",
    "PageInfo",
    "PassageHit",
    "ProgramRun",
    "ProgramVerifier",
    "PublicKey",
    "Recall",
    "Receipt",
    "RederiveReport",
    "SampleResult",
    "Sampling",
    "Scope",
    "SearchHit",
    "SentenceTransformerEmbedder",
    "SigningKey",
    "Solution",
    "SolverOutput",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreLocked",
    "StoreReadOnly",
    "StoreStats",
    "TransferError",
    "TransferReport",
    "TrustPolicy",
    "UntrustedBundle",
    "UnverifiedBlock",
    "Verdict",
    "VerificationRecord",
    "Verifier",
    "VerifyReport",
    "__version__",
    "logits_sha256",
    "resolve_model",
    "run_program",
]
