"""graftmem: agent memory made of verified, byte-exact KV-cache blocks.

Learn a text once (its KV state goes to disk as a block); later graft the block into a fresh
llama.cpp context at its own positions and prefill only the query. The logits are byte-identical
to a fresh prefill of the same text, and [`Memory.verify()`][graftmem.Memory.verify] proves it.

This module is the public API. The layers below it (``graftmem.core``, ``graftmem.store``,
``graftmem.memory``, ``graftmem.share``, ``graftmem.server``) export documented names for advanced use;
their modules are private. docs/architecture.md explains the layering.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .core.version import __version__

# Names are imported on first use (PEP 562), so that a light client of a running server
# (``graftmem search --url``) does not load llama.cpp, torch or the HTTP server just by importing the
# package. The imports below are what a type checker, the docs and tests/test_architecture.py read.
if TYPE_CHECKING:
    from .api import AnswerStream, AsyncAnswerStream, AsyncMemory, BlockSummary, Memory, RemoteMemory
    from .core import (Block, Engine, EngineConfig, Exactness, Fingerprint, HistoryEvent, Recall, Receipt, SampleResult,
                       Sampling, Scope, SearchHit, StoreStats, VerificationRecord, VerifyReport, logits_sha256,
                       system_report)
    from .core.errors import (AccessDenied, BlockCorrupted, BlockNotFound, BlockRejected, BundleRejected,
                              ClosedError, ConfigError, EngineError, GraftmemError, IncompatibleBlock,
                              ModelNotFound, StoreError, StoreFull, StoreLocked, StoreReadOnly, TransferError,
                              UnsupportedFeature, UnverifiedBlock, UntrustedBundle)
    from .core.models import MODELS, resolve_model
    from .memory import (Attempt, CallableVerifier, Candidate, DocumentAnswer, DocumentReport, Embedder, ExactMatch,
                         Flywheel, Gate, GateReport, PageInfo, PassageHit, ProgramRun, ProgramVerifier, RederiveReport,
                         SentenceTransformerEmbedder, Solution, SolverOutput, Verdict, Verifier, run_program)
    from .server import BlockServer, ServeConfig
    from .share import BundleManifest, ExportReport, PublicKey, SigningKey, TransferReport, TrustPolicy
    from .store import FleetStore, Store

_LAZY: dict[str, str] = {
    "AnswerStream": ".api",
    "AsyncAnswerStream": ".api",
    "AsyncMemory": ".api",
    "BlockSummary": ".api",
    "Memory": ".api",
    "RemoteMemory": ".api",
    "Block": ".core",
    "Engine": ".core",
    "EngineConfig": ".core",
    "Exactness": ".core",
    "Fingerprint": ".core",
    "HistoryEvent": ".core",
    "Recall": ".core",
    "Receipt": ".core",
    "SampleResult": ".core",
    "Sampling": ".core",
    "Scope": ".core",
    "SearchHit": ".core",
    "StoreStats": ".core",
    "VerificationRecord": ".core",
    "VerifyReport": ".core",
    "logits_sha256": ".core",
    "system_report": ".core",
    "AccessDenied": ".core.errors",
    "BlockCorrupted": ".core.errors",
    "BlockNotFound": ".core.errors",
    "BlockRejected": ".core.errors",
    "BundleRejected": ".core.errors",
    "ClosedError": ".core.errors",
    "ConfigError": ".core.errors",
    "EngineError": ".core.errors",
    "GraftmemError": ".core.errors",
    "IncompatibleBlock": ".core.errors",
    "ModelNotFound": ".core.errors",
    "StoreError": ".core.errors",
    "StoreFull": ".core.errors",
    "StoreLocked": ".core.errors",
    "StoreReadOnly": ".core.errors",
    "TransferError": ".core.errors",
    "UnsupportedFeature": ".core.errors",
    "UnverifiedBlock": ".core.errors",
    "UntrustedBundle": ".core.errors",
    "MODELS": ".core.models",
    "resolve_model": ".core.models",
    "Attempt": ".memory",
    "CallableVerifier": ".memory",
    "Candidate": ".memory",
    "DocumentAnswer": ".memory",
    "DocumentReport": ".memory",
    "Embedder": ".memory",
    "ExactMatch": ".memory",
    "Flywheel": ".memory",
    "Gate": ".memory",
    "GateReport": ".memory",
    "PageInfo": ".memory",
    "PassageHit": ".memory",
    "ProgramRun": ".memory",
    "ProgramVerifier": ".memory",
    "RederiveReport": ".memory",
    "SentenceTransformerEmbedder": ".memory",
    "Solution": ".memory",
    "SolverOutput": ".memory",
    "Verdict": ".memory",
    "Verifier": ".memory",
    "run_program": ".memory",
    "BlockServer": ".server",
    "ServeConfig": ".server",
    "BundleManifest": ".share",
    "ExportReport": ".share",
    "PublicKey": ".share",
    "SigningKey": ".share",
    "TransferReport": ".share",
    "TrustPolicy": ".share",
    "FleetStore": ".store",
    "Store": ".store",
}
_SUBPACKAGES = {"api", "cli", "core", "memory", "server", "share", "store"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # once imported, a plain attribute
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AccessDenied",
    "AnswerStream",
    "AsyncAnswerStream",
    "AsyncMemory",
    "Attempt",
    "Block",
    "BlockCorrupted",
    "BlockNotFound",
    "BlockRejected",
    "BlockServer",
    "BlockSummary",
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
    "RemoteMemory",
    "SampleResult",
    "Sampling",
    "Scope",
    "SearchHit",
    "SentenceTransformerEmbedder",
    "ServeConfig",
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
    "UnsupportedFeature",
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
    "system_report",
]
