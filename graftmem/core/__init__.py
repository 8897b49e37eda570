"""Core: what a block IS and the one engine that makes and grafts it. Pure or engine-only: no store,
no HTTP, no routing. ``graftmem.core.backend`` is the only module of the package that imports llama_cpp.

Public for advanced use (benches, custom pipelines): [`Engine`][graftmem.Engine] (load, tokenize, prefill, capture,
restore, logits, [`Engine.session()`][graftmem.Engine.session]), `decode()` and [`Sampling`][graftmem.Sampling] (the one decode loop),
`logits_sha256()` (the exactness currency), the block and fingerprint models, a block's identity
(`block_id_for`, `check_block_id`, `incompatibility`: `graftmem.core.identity`), `state_digest()`
and the error tree (also re-exported by `graftmem`).
"""

import importlib
from typing import TYPE_CHECKING, Any

from .errors import *  # noqa: F403 - the error tree, one name per class
from .errors import __all__ as _errors_all
from .version import __version__

# Imported on first use (PEP 562): ``graftmem.core.errors`` and the version must not load llama.cpp,
# numpy or pydantic for a client that only talks to a running server. The imports below are what
# type checkers, the docs and tests/test_architecture.py read.
if TYPE_CHECKING:
    from .blocks import (FORMAT_VERSION, Block, EngineConfig, Exactness, Fingerprint, HistoryEvent, Recall, Receipt,
                         SampleResult, Scope, SearchHit, StoreStats, VerificationRecord, VerifyReport)
    from .identity import Salts, block_id_for, check_block_id, content_id, incompatibility, salts_of
    from .decoding import Decoded, Sampling, decode
    from .backend import system_report
    from .openmp import environ_without_ours
    from .engine import DeviceCopy, Engine, logits_sha256, threads_per_engine, usable_cores
    from .grammar import Grammar, json_grammar
    from .kernels import KernelVerdict, probe_kernels
    from .format import state_digest
    from .models import DEFAULT_MODEL, MODELS, resolve_model
    from .progress import prefill_work, progress_bar
    from .statefmt import join as join_states
    from .statefmt import needs_placing, place_cells_into
    from .prompt import CHATML, FORMATS, GEMMA, ChatFormat, split_ids
    from .segments import detect_format, request_template
    from .template import ChatTemplate, TemplateError, load_template, model_template

_LAZY: dict[str, tuple[str, str]] = {
    "FORMAT_VERSION": (".blocks", "FORMAT_VERSION"),
    "Block": (".blocks", "Block"),
    "EngineConfig": (".blocks", "EngineConfig"),
    "Exactness": (".blocks", "Exactness"),
    "Fingerprint": (".blocks", "Fingerprint"),
    "HistoryEvent": (".blocks", "HistoryEvent"),
    "Recall": (".blocks", "Recall"),
    "Receipt": (".blocks", "Receipt"),
    "SampleResult": (".blocks", "SampleResult"),
    "Scope": (".blocks", "Scope"),
    "SearchHit": (".blocks", "SearchHit"),
    "StoreStats": (".blocks", "StoreStats"),
    "VerificationRecord": (".blocks", "VerificationRecord"),
    "VerifyReport": (".blocks", "VerifyReport"),
    "block_id_for": (".identity", "block_id_for"),
    "Salts": (".identity", "Salts"),
    "salts_of": (".identity", "salts_of"),
    "content_id": (".identity", "content_id"),
    "check_block_id": (".identity", "check_block_id"),
    "incompatibility": (".identity", "incompatibility"),
    "Decoded": (".decoding", "Decoded"),
    "Sampling": (".decoding", "Sampling"),
    "decode": (".decoding", "decode"),
    "Engine": (".engine", "Engine"),
    "DeviceCopy": (".engine", "DeviceCopy"),
    "logits_sha256": (".engine", "logits_sha256"),
    "usable_cores": (".engine", "usable_cores"),
    "threads_per_engine": (".engine", "threads_per_engine"),
    "system_report": (".backend", "system_report"),
    "environ_without_ours": (".openmp", "environ_without_ours"),
    "probe_kernels": (".kernels", "probe_kernels"),
    "Grammar": (".grammar", "Grammar"),
    "json_grammar": (".grammar", "json_grammar"),
    "KernelVerdict": (".kernels", "KernelVerdict"),
    "state_digest": (".format", "state_digest"),
    "DEFAULT_MODEL": (".models", "DEFAULT_MODEL"),
    "MODELS": (".models", "MODELS"),
    "resolve_model": (".models", "resolve_model"),
    "progress_bar": (".progress", "progress_bar"),
    "prefill_work": (".progress", "prefill_work"),
    "join_states": (".statefmt", "join"),
    "needs_placing": (".statefmt", "needs_placing"),
    "place_cells_into": (".statefmt", "place_cells_into"),
    "CHATML": (".prompt", "CHATML"),
    "FORMATS": (".prompt", "FORMATS"),
    "GEMMA": (".prompt", "GEMMA"),
    "ChatFormat": (".prompt", "ChatFormat"),
    "detect_format": (".segments", "detect_format"),
    "split_ids": (".prompt", "split_ids"),
    "request_template": (".segments", "request_template"),
    "ChatTemplate": (".template", "ChatTemplate"),
    "TemplateError": (".template", "TemplateError"),
    "load_template": (".template", "load_template"),
    "model_template": (".template", "model_template"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value
    return value


__all__ = [
    "Block", "CHATML", "ChatFormat", "ChatTemplate", "DEFAULT_MODEL", "Decoded", "DeviceCopy", "Engine", "EngineConfig", "Exactness",
    "FORMATS", "FORMAT_VERSION", "Fingerprint", "GEMMA", "Grammar", "HistoryEvent", "KernelVerdict", "MODELS", "Recall",
    "Receipt", "Salts", "SampleResult", "Sampling", "Scope", "SearchHit", "StoreStats", "TemplateError",
    "VerificationRecord", "VerifyReport", "__version__", "block_id_for", "check_block_id", "content_id", "decode",
    "detect_format", "environ_without_ours", "incompatibility", "join_states", "json_grammar", "load_template", "logits_sha256",
    "model_template", "needs_placing", "place_cells_into", "prefill_work", "probe_kernels", "progress_bar", "request_template",
    "resolve_model", "salts_of", "split_ids", "state_digest", "system_report", "threads_per_engine", "usable_cores"]
__all__ += _errors_all  # noqa: PLE0605 - the error tree: graftmem.core.errors.__all__, the one list of its names
