"""Core: what a block IS and the one engine that makes and grafts it. Pure or engine-only: no store,
no HTTP, no routing. ``graftmem.core.engine`` is the only module of the package that imports llama_cpp.

Public for advanced use (benches, custom pipelines): [`Engine`][graftmem.Engine] (load, tokenize, prefill, capture,
restore, logits, [`Engine.session()`][graftmem.Engine.session]), `decode()` and [`Sampling`][graftmem.Sampling] (the one decode loop),
`logits_sha256()` (the exactness currency), the block and fingerprint models, `state_digest()`
and the error tree (also re-exported by `graftmem`).
"""

from .blocks import (FORMAT_VERSION, Block, EngineConfig, Exactness, Fingerprint, HistoryEvent, Recall, Receipt,
                     SampleResult, Scope, SearchHit, StoreStats, VerificationRecord, VerifyReport, block_id_for)
from .decode import Decoded, Sampling, decode
from .engine import Engine, logits_sha256, usable_cores
from .errors import *  # noqa: F401,F403 - the error tree, one name per class
from .errors import __all__ as _errors_all
from .format import state_digest
from .models import DEFAULT_MODEL, MODELS, resolve_model
from .progress import progress_bar
from .statefmt import join as join_states
from .statefmt import needs_placing, place_cells_into
from .prompt import CHATML, FORMATS, GEMMA, ChatFormat, detect_format, split_ids
from .version import __version__

__all__ = sorted([
    "FORMAT_VERSION", "Block", "HistoryEvent", "Scope", "EngineConfig", "Exactness", "Fingerprint", "Recall", "Receipt", "SampleResult",
    "SearchHit", "StoreStats", "VerificationRecord", "VerifyReport", "block_id_for", "Decoded", "Sampling",
    "decode", "Engine", "logits_sha256", "usable_cores", "state_digest", "DEFAULT_MODEL", "MODELS",
    "resolve_model", "progress_bar", "join_states", "needs_placing", "place_cells_into", "CHATML", "FORMATS", "GEMMA", "ChatFormat", "detect_format", "split_ids",
    "__version__", *_errors_all])
