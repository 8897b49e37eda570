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
from ._bundle import BundleManifest, ExportReport, TransferReport
from ._memory import Memory
from ._server import BlockServer
from ._trust import PublicKey, RederiveReport, SigningKey, TrustPolicy
from ._router import Embedder, SentenceTransformerEmbedder
from ._pager import DocumentAnswer, DocumentReport, PageInfo, PassageHit
from ._flywheel import Attempt, Flywheel, Gate, GateReport, Solution, SolverOutput
from ._verifiers import (CallableVerifier, Candidate, ExactMatch, ProgramRun, ProgramVerifier, Verdict,
                         Verifier, run_program)
from ._models import MODELS, resolve_model

__version__ = "0.1.0"

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
    "EngineConfig",
    "EngineError",
    "ExactMatch",
    "Exactness",
    "ExportReport",
    "Fingerprint",
    "Flywheel",
    "Gate",
    "GateReport",
    "GraftmemError",
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
    "SearchHit",
    "SentenceTransformerEmbedder",
    "SigningKey",
    "Solution",
    "SolverOutput",
    "StoreError",
    "StoreFull",
    "StoreLocked",
    "StoreStats",
    "TransferError",
    "TransferReport",
    "TrustPolicy",
    "UntrustedBundle",
    "Verdict",
    "VerificationRecord",
    "Verifier",
    "VerifyReport",
    "__version__",
    "resolve_model",
    "run_program",
]
