"""The engine: one llama.cpp context on a loaded model: load, tokenize, prefill, capture, restore, logits,
fingerprint, exactness probe. Every llama.cpp failure becomes an [`EngineError`][graftmem.EngineError].

Why the low-level API and not ``llama_cpp.Llama``: ``Llama`` keeps an ``n_ctx x n_vocab`` scores
array, re-evaluates prompts through its own cache logic and saves state with ``save_state`` (which
drags that array along). Grafting needs exactly four primitives, used directly:

* ``llama_decode`` over a batch at explicit positions (prefill and generation),
* ``llama_state_seq_get_data`` / ``llama_state_seq_set_data`` for sequence 0 (capture / restore),
  called as their ``_ext`` forms (flags 0 is the plain call) so that ``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``
  (a copy kept in the context's own buffers, `Engine.copy_on_device`) goes through the same two calls,
* ``llama_memory_clear`` so every graft starts from an empty cache whose head is cell 0,
* ``llama_get_logits_ith`` for the float32 logits we hash.

The per-sequence state API is used rather than the whole-context one: a whole-context restore resets
the cache head to 0 and the next tokens can land on cells that masked positions still occupy (see
docs/exactness.md for the measurements on Gemma 3).

Its neighbours, split by idea: `graftmem.core.backend` (the only importer of ``llama_cpp``: the library,
its log, the shared weights), `graftmem.core.kernels` (the child-process kernel probe and the
``extra_bufts`` rule), `graftmem.core.grammar` (grammar samplers and JSON-schema grammars). Their
public names are re-exported here, so ``from graftmem.core.engine import Grammar`` keeps working.
"""


from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, TypeVar

import numpy as np

from .backend import C, KV_TYPES, file_sha256, init_backend, library_identity, llama_build, llama_cpp_version
from .backend import _LoadedModel as _LoadedModel  # re-exported: tests count the loaded models
from .backend import _backend_of, _cpu_features
from .backend import _weight_buffers as _weight_buffers  # re-exported: tests read load logs with it
from .backend import system_report
from .blocks import FORMAT_VERSION, EngineConfig, Exactness, Fingerprint
from .errors import ClosedError, ConfigError, EngineError, UnsupportedFeature
from .grammar import Grammar, json_grammar, json_rules
from .grammar_limits import DEFAULT_GRAMMAR_LIMITS, GrammarLimits
from .kernels import _CHILD_ENV, _CRASH_ENV, KernelVerdict, _child_stage, _read_verdict, _keep_verdict
from .kernels import choose_extra_bufts, kernel_verdict, probe_kernels
from .memkind import KINDS, MemoryKind
from .models import model_cache_dir, resolve_model

__all__ = ["DeviceCopy", "Engine", "Grammar", "json_grammar", "json_rules", "logits_sha256", "system_report", "KernelVerdict", "probe_kernels",
           "kernel_verdict", "threads_per_engine", "usable_cores"]

log = logging.getLogger("graftmem")

_Buf = TypeVar("_Buf", memoryview, bytearray)  #: where a state capture writes


def logits_sha256(logits: np.ndarray) -> str:
    """SHA-256 of float32 logits in little-endian byte order: the exactness currency."""
    return hashlib.sha256(np.ascontiguousarray(logits, dtype="<f4").tobytes()).hexdigest()



def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's cpuset), not
    the host's count: more llama.cpp threads than usable cores makes every decode wait on a thread
    that is not running."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def threads_per_engine(n_engines: int, cores: Optional[int] = None) -> int:
    """Threads for each of ``n_engines`` contexts decoding at once on ``cores`` usable cores (default:
    `usable_cores`): ``max(1, cores // n_engines)``, so that N concurrent decodes do not run N x cores
    spinning threads that wait on each other."""
    if n_engines < 1:
        raise ConfigError(f"a pool needs at least one engine, not {n_engines}")
    return max(1, (cores or usable_cores()) // n_engines)



#: The load-time probe's text and rule; a change here must change this, so cached verdicts are not reused.
_PROBE_VERSION = 1


def _probe_child_main(model_path: str, config_json: str) -> None:
    """Entry point of the probe child: load, probe, print one JSON line (see `kernel_verdict`)."""
    _child_stage("load")
    if os.environ.get(_CRASH_ENV) == "load":
        ctypes.string_at(0)  # the fault the crash-path tests inject while loading
    with Engine(model_path, EngineConfig.model_validate_json(config_json)) as eng:
        ex = eng.exactness
        sys.stdout.write(json.dumps({"exact": ex.exact, "reason": ex.reason,
                                     "weight_buffers": eng.fingerprint.weight_buffers}) + "\n")




#: KV cache types whose tensors llama.cpp's on-device copy handles whole (one element, one value)
_WHOLE_ELEMENT_TYPES = frozenset({"f32", "f16", "bf16"})


@dataclass(frozen=True, eq=False)
class DeviceCopy:
    """A state llama.cpp holds in one engine's context buffers (`Engine.copy_on_device`): the
    description of its cells that llama.cpp reads back on a restore, and what the engine must know again
    (the tokens it covers, where its one-token calls begin). Compared by identity: only the engine that
    made it, and only while it is that engine's latest, can restore it. ``key``: what the caller says
    the state is (`graftmem.memory.answer.graft` gives the block's id and state digest)."""

    description: bytes
    n_tokens: int
    one_token_from: Optional[int]
    key: object = None


class Engine:
    """One llama.cpp model and context under a pinned configuration (see [`EngineConfig`][graftmem.EngineConfig]).

    All context operations are serialized by a lock, so one engine may be shared by threads.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None,
                 config: EngineConfig | Mapping[str, Any] | None = None) -> None:
        self.config = EngineConfig.coerce(config)
        self._model_arg = model
        self.model_name, self.model_path = resolve_model(model)
        if self.config.n_ubatch > self.config.n_batch:
            raise ConfigError(f"n_ubatch={self.config.n_ubatch} must not exceed n_batch={self.config.n_batch}")
        init_backend()
        self._lock = threading.RLock()
        self.lock = self._lock  #: hold it to run several steps (restore, prefill, logits) atomically
        self._closed = False
        model_sha256 = file_sha256(self.model_path)
        #: whether llama.cpp's extra weight buffer types are in use (see `EngineConfig.extra_bufts`)
        self.extra_bufts = choose_extra_bufts(self.model_path, model_sha256, self.config)
        offload = self.config.n_gpu_layers if C.llama_supports_gpu_offload() else 0
        if self.config.n_gpu_layers and not offload:
            log.warning("n_gpu_layers=%d asked, but this llama-cpp-python build has no GPU backend: running on "
                        "the CPU (docs/exactness.md says how to build it with CUDA or Metal)", self.config.n_gpu_layers)
        self._loaded = _LoadedModel.acquire(self.model_path, model_sha256, offload, self.extra_bufts)
        self._model = self._loaded.ptr
        #: the weight buffer types llama.cpp used, from its load log ("CPU", "CPU+CPU_REPACK", "AMX+CPU")
        self.weight_buffers = self._loaded.weight_buffers
        self._ctx: Any = None
        self._has_batch = False
        try:
            self._open_context(model_sha256, offload)
        except BaseException:  # a context that failed to open (or to probe) gives its model reference back
            self._closed = True
            self._free()
            raise

    def _open_context(self, model_sha256: str, offload: int) -> None:
        """The context on the loaded model, its batch, fingerprint and exactness (the load-time probe)."""
        threads = self.config.n_threads or usable_cores()
        self.n_threads = self.n_threads_batch = threads
        cp = C.llama_context_default_params()
        cp.n_ctx = self.config.n_ctx
        cp.n_batch = self.config.n_batch
        cp.n_ubatch = self.config.n_ubatch
        cp.n_seq_max = 1
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.type_k = KV_TYPES[self.config.type_k]
        cp.type_v = KV_TYPES[self.config.type_v]
        cp.flash_attn_type = (C.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.config.flash_attn
                              else C.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.swa_full = self.config.swa_full
        cp.no_perf = True
        self._ctx = C.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise EngineError(f"llama.cpp could not create a context for {self.model_path} "
                              f"with {self.config.model_dump()} (a quantized V cache needs flash_attn=True)")
        self._vocab = C.llama_model_get_vocab(self._model)
        self.n_vocab = C.llama_vocab_n_tokens(self._vocab)
        self.n_ctx = C.llama_n_ctx(self._ctx)
        self.n_swa = C.llama_model_n_swa(self._model)
        #: what this model's per-sequence memory is (attention, window, recurrent, hybrid) and so which
        #: features can be exact on it (`graftmem.core.memkind`); a function of the model file, which the
        #: fingerprint pins by its SHA-256
        self.memory = self._memory_kind()
        self._batch = C.llama_batch_init(self.config.n_batch, 0, 1)
        self._has_batch = True
        self._buf = bytearray()
        self._n_past = 0
        #: the lowest position evaluated by a one-token call in the cells now (None: none), see `one_token_calls`
        self._one_token_from: Optional[int] = None
        #: the copy of sequence 0's cells llama.cpp keeps in this context's buffers (`copy_on_device`)
        self._device_copy: Optional[DeviceCopy] = None
        #: What the last holder left in the cache for a later ``session(resume=True)`` (opaque here:
        #: the holder's own description); None whenever the cells changed since (see `session()`).
        self.kept: Optional[object] = None
        self.fingerprint = Fingerprint(
            model_sha256=model_sha256, model_name=self.model_name,
            llama_cpp_version=llama_cpp_version(), llama_build=llama_build(),
            n_ctx=self.n_ctx, n_batch=self.config.n_batch, n_ubatch=self.config.n_ubatch,
            type_k=self.config.type_k, type_v=self.config.type_v, flash_attn=self.config.flash_attn,
            swa_full=self.config.swa_full, backend=_backend_of(self.weight_buffers), cpu_features=_cpu_features(),
            n_threads=threads, format_version=FORMAT_VERSION, weight_buffers=self.weight_buffers,
            n_gpu_layers=offload,
        )
        if self.config.keep_on_device:
            self._check_device_copies()  # at load, not at the first graft
        self.exactness = self._static_exactness()
        if self.exactness.exact and self.config.probe:
            self.exactness = self._probe_once()

    def _memory_kind(self) -> MemoryKind:
        """The memory kind, from llama.cpp's own answers (recurrent, hybrid, sliding window) and the GGUF's
        architecture name; latent attention (MLA) from its ``<arch>.attention.kv_lora_rank`` key."""
        meta = self.metadata()
        arch = meta.get("general.architecture", "unknown")
        if C.llama_model_is_hybrid(self._model):
            kind = "hybrid"
        elif C.llama_model_is_recurrent(self._model):
            kind = "recurrent"
        elif self.n_swa > 0:
            kind = "window"
        else:
            kind = "attention"
        return MemoryKind(arch=arch, kind=kind, n_swa=int(self.n_swa),  # type: ignore[arg-type]
                          latent=f"{arch}.attention.kv_lora_rank" in meta)

    # ----------------------------------------------------------------- sharing the model
    def sibling(self) -> "Engine":
        """Another engine (its own context, KV cache and lock) on this engine's loaded model, with the
        same configuration, hence the same fingerprint: what a server's pool of N contexts is made of.

        The weights are loaded once per process for a model file and its model parameters (see
        `_LoadedModel`), so the sibling costs a context, not another copy of the model; it stays
        usable when this engine is closed, and the weights are freed with the last engine on them.
        """
        self._check()
        return Engine(self._model_arg, self.config)

    @property
    def model_handle(self) -> int:
        """The address of the llama.cpp model this engine's context runs on: engines with equal
        handles share one copy of the weights."""
        return int(ctypes.cast(self._model, ctypes.c_void_p).value or 0)

    @property
    def model_users(self) -> int:
        """How many open engines of this process use this engine's loaded model (itself included)."""
        return self._loaded.refs

    def set_threads(self, n_threads: int, n_threads_batch: Optional[int] = None) -> None:
        """Run this context's one-token calls on ``n_threads`` threads and its calls of two tokens or
        more on ``n_threads_batch`` (default: the same) from now on (``llama_set_n_threads``).

        Why they may differ: a pool of N contexts on C cores sizes the batch threads to C // N (see
        `threads_per_engine`) so that N concurrent prefills do not oversubscribe the cores, and keeps the
        one-token threads, whose count changes the bytes those calls compute (`one_token_calls_split`):
        a request's answer on a pool is then the answer of the same request on one engine. The
        fingerprint records ``n_threads`` (the one-token count); blocks whose cells include one-token
        calls record it too and are refused by an engine with another (docs/exactness.md).
        """
        batch = n_threads if n_threads_batch is None else n_threads_batch
        if n_threads < 1 or batch < 1:
            raise ConfigError(f"n_threads must be >= 1, not {min(n_threads, batch)}")
        with self._lock:
            self._check()
            C.llama_set_n_threads(self._ctx, n_threads, batch)
            self.n_threads, self.n_threads_batch = n_threads, batch
            self.fingerprint = self.fingerprint.model_copy(update={"n_threads": n_threads})

    @property
    def one_token_calls_split(self) -> bool:
        """Whether this engine's one-token calls compute other bytes on another thread count.

        Measured (SmolLM2 and the tiny Llama, 1 vs 2 threads, after 300-1,000 cells): llama.cpp's CPU
        flash-attention kernel splits the attention of a one-token batch over the keys into one chunk
        per thread once the cache view holds 512 cells or more (``use_split_kv_path`` in
        ggml-cpu/ops.cpp: f16 or f32 K and V of one type), and adds the chunks' partial sums in that
        order: another thread count, other bytes. Batches of two tokens or more take the per-row path,
        which is the same on any thread count. So a state holds thread-count-dependent cells exactly
        where a one-token call (a decoded token; a prompt or chunk of one token) computed them."""
        return bool(self.config.flash_attn) and self.config.type_k == self.config.type_v \
            and self.config.type_k in ("f16", "f32")

    def ends_with_one_token_call(self, n_tokens: int) -> bool:
        """Whether `prefill` of ``n_tokens`` tokens makes its last call (``n_batch`` tokens a call) a
        one-token call whose bytes depend on the thread count (`one_token_calls_split`)."""
        return self.one_token_calls_split and n_tokens % self.config.n_batch == 1

    def one_token_calls(self, end: Optional[int] = None) -> Optional[dict[str, int]]:
        """What a block of the cells up to ``end`` (default: all) records of their one-token calls, when
        they have any whose bytes depend on the thread count (`one_token_calls_split`): ``{"threads":
        n_threads, "from": position}``; None when they have none. A block carrying it is refused by an
        engine whose one-token calls run on another number of threads (`graftmem.core.identity.incompatibility`)."""
        end = self._n_past if end is None else end
        if self._one_token_from is None or self._one_token_from >= end:
            return None
        return {"threads": int(self.n_threads), "from": int(self._one_token_from)}

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free()

    def _free(self) -> None:
        self._device_copy = None
        if self._has_batch:
            C.llama_batch_free(self._batch)
            self._has_batch = False
        if self._ctx:
            C.llama_free(self._ctx)
            self._ctx = None
        self._loaded.release()  # the weights go with the last context on them

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("this engine is closed")

    # ----------------------------------------------------------------- tokens
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS where the model wants one."""
        self._check()
        raw = text.encode("utf-8")
        n_max = len(raw) + 8
        arr = (C.llama_token * n_max)()
        n = C.llama_tokenize(self._vocab, raw, len(raw), arr, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            arr = (C.llama_token * n_max)()
            n = C.llama_tokenize(self._vocab, raw, len(raw), arr, n_max, add_special, parse_special)
        if n < 0:
            raise EngineError(f"tokenization failed for a {len(raw)}-byte text")
        return list(arr[:n])

    def detokenize(self, tokens: Iterable[int]) -> str:
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        for t in tokens:
            n = C.llama_token_to_piece(self._vocab, int(t), buf, 256, 0, False)
            if n > 0:
                out += buf.raw[:n]
        return out.decode("utf-8", "replace")

    def piece(self, token: int) -> bytes:
        """The raw bytes of one token's text (not decoded: a UTF-8 character may span two tokens, so
        a streamed answer joins bytes and decodes only what is complete)."""
        buf = ctypes.create_string_buffer(256)
        n = C.llama_token_to_piece(self._vocab, int(token), buf, 256, 0, False)
        return buf.raw[:n] if n > 0 else b""

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self._vocab, token))

    def grammar(self, gbnf: str, root: str = "root", limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS) -> Grammar:
        """A [`Grammar`][graftmem.core.Grammar] over this engine's vocabulary, for `decode(grammar=)`;
        a grammar over ``limits`` (its size, its nesting) is a `ConfigError` before llama.cpp parses it."""
        return Grammar(self, gbnf, root, limits)

    # ----------------------------------------------------------------- model metadata (chat templates)
    def metadata(self) -> dict[str, str]:
        """The GGUF's scalar metadata as strings (llama.cpp prints arrays as a summary), for the chat
        template layer: ``tokenizer.chat_template``, ``general.name``, ..."""
        self._check()
        out: dict[str, str] = {}
        for i in range(C.llama_model_meta_count(self._model)):
            out[self._meta_str(C.llama_model_meta_key_by_index, i)] = self._meta_str(
                C.llama_model_meta_val_str_by_index, i)
        return out

    def _meta_str(self, fn: Callable[..., int], i: int) -> str:
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = fn(self._model, i, buf, size)
            if n < 0:
                return ""
            if n < size:
                return buf.value.decode("utf-8", "replace")
            size = n + 1

    def chat_template(self, name: Optional[str] = None) -> Optional[str]:
        """The GGUF's ``tokenizer.chat_template`` (or ``tokenizer.chat_template.<name>``), None if absent."""
        self._check()
        ptr = C.llama_model_chat_template(self._model, name.encode() if name else None)
        return ptr.decode("utf-8", "replace") if ptr else None

    def token_text(self, token: int) -> str:
        """A token's text as the vocabulary spells it (special tokens included: ``<|eot_id|>``)."""
        self._check()
        raw = C.llama_vocab_get_text(self._vocab, int(token))
        return raw.decode("utf-8", "replace") if raw else ""

    def special_tokens(self) -> dict[str, Any]:
        """BOS / EOS ids and texts and whether tokenizing adds BOS: what a chat template is rendered with."""
        self._check()
        bos, eos = C.llama_vocab_bos(self._vocab), C.llama_vocab_eos(self._vocab)
        return {"bos": bos, "eos": eos, "bos_text": self.token_text(bos) if bos >= 0 else "",
                "eos_text": self.token_text(eos) if eos >= 0 else "",
                "add_bos": bool(C.llama_vocab_get_add_bos(self._vocab))}

    def is_control(self, token: int) -> bool:
        """Whether ``token`` is a control (special) token: a chat template's marker, never user text."""
        return bool(C.llama_vocab_is_control(self._vocab, int(token)))

    # ----------------------------------------------------------------- compute
    @contextlib.contextmanager
    def session(self, *, resume: bool = False, keep: bool = False) -> Iterator["Engine"]:
        """Hold the context for one unit of work that starts and ends on an empty cache.

        The lock serializes threads; the reset before makes the work start at cell 0 whatever the
        previous holder left; the reset after (in ``finally``, so also on an error or a refused graft)
        leaves no state of this work for the next holder to see. Every caller that prefills, grafts or
        decodes goes through here instead of copying the discipline.

        The server's in-RAM prompt reuse (llama-server's slot reuse) bends the rule in two explicit
        steps: ``keep=True`` leaves this work's cells in place after a *normal* exit (an error still
        clears them) and the holder describes them in `kept`; ``resume=True`` starts from whatever
        is there instead of clearing it. The resuming holder must read `kept` to know what the cells
        are: every operation that changes them (reset, prefill, restore, trim, shift) sets `kept` to
        None, so a stale description cannot survive another holder's work.
        """
        with self._lock:
            if not resume:
                self.kept = None
                if self._n_past:  # a clear costs a memset of the whole cache: skip it when already empty
                    self.reset()
            ok = False
            try:
                yield self
                ok = True
            finally:
                if not self._closed and not (keep and ok):
                    self.reset()

    @property
    def n_past(self) -> int:
        """Number of positions currently held by sequence 0."""
        return self._n_past

    def reset(self) -> None:
        """Empty the KV cache (data too) so the next graft or prefill starts at cell 0."""
        with self._lock:
            self.kept = None
            self._check()
            C.llama_memory_clear(C.llama_get_memory(self._ctx), True)
            self._n_past = 0
            self._one_token_from = None

    def reset_at(self, position: int) -> None:
        """Empty the KV cache and make the next prefill start at ``position`` instead of 0.

        For measurements only (bench/position.py): a fresh prefill "at offset M" is the reference a
        re-based block is compared with. Blocks are never learned this way.
        """
        with self._lock:
            self.reset()
            if not 0 <= position < self.n_ctx:
                raise ConfigError(f"position {position} is outside 0..{self.n_ctx - 1}")
            self._n_past = position

    def shift_positions(self, delta: int) -> None:
        """Move every cell of sequence 0 by ``delta`` positions (``llama_memory_seq_add``).

        llama.cpp re-rotates the cached keys (RoPE) on the next decode. This is APPROXIMATE: the
        re-rotated keys are not the bytes a prefill at the new positions computes (measured in
        bench/position.py), so nothing exact may be built on it; it exists to measure re-basing.
        """
        with self._lock:
            self._check()
            mem = C.llama_get_memory(self._ctx)
            if not C.llama_memory_can_shift(mem):
                raise EngineError("this model's KV cache cannot shift positions")
            if self._n_past + delta < 0 or self._n_past + delta > self.n_ctx:
                raise ConfigError(f"shifting {self._n_past} positions by {delta} leaves 0..{self.n_ctx}")
            self.kept = None
            C.llama_memory_seq_add(mem, 0, 0, -1, delta)
            self._n_past = C.llama_memory_seq_pos_max(mem, 0) + 1
            if self._one_token_from is not None:
                self._one_token_from = max(0, self._one_token_from + delta)

    def trim(self, n_keep: int) -> None:
        """Drop the cells at positions >= n_keep (what a query added), keeping the prefix intact.

        On a model whose memory cannot be trimmed (recurrent layers: `MemoryKind.trims`), a trim that
        would drop cells raises `UnsupportedFeature` before anything changes; one that drops nothing
        (``n_keep >= n_past``) is allowed: the state already is the prefix's."""
        with self._lock:
            self._check()
            if n_keep < self._n_past and not self.memory.trims:
                raise self.memory.refusal(
                    "trimming the cells back to a shorter prefix",
                    f"Graft a block captured at position {n_keep} instead, or prefill from empty.")
            self.kept = None
            if not C.llama_memory_seq_rm(C.llama_get_memory(self._ctx), 0, n_keep, -1):
                raise EngineError(f"could not trim sequence 0 to {n_keep} positions")
            self._n_past = min(self._n_past, n_keep)
            if self._one_token_from is not None and self._one_token_from >= n_keep:
                self._one_token_from = None

    def prefill(self, tokens: Sequence[int],
                progress: Optional[Callable[[int], None]] = None) -> None:
        """Evaluate ``tokens`` at positions ``n_past ..``, in n_batch chunks; logits of the last one kept."""
        with self._lock:
            self._check()
            n = len(tokens)
            if n == 0:
                raise ConfigError("cannot prefill an empty token list")
            self.kept = None
            if self._n_past + n > self.n_ctx:
                raise EngineError(f"context full: {self._n_past} + {n} tokens exceed n_ctx={self.n_ctx}")
            b = self._batch
            step = self.config.n_batch
            for start in range(0, n, step):
                chunk = tokens[start:start + step]
                last = start + len(chunk) == n
                for j, tok in enumerate(chunk):
                    b.token[j] = tok
                    b.pos[j] = self._n_past + j
                    b.n_seq_id[j] = 1
                    b.seq_id[j][0] = 0
                    b.logits[j] = last and j == len(chunk) - 1
                b.n_tokens = len(chunk)
                rc = C.llama_decode(self._ctx, b)
                if rc != 0:
                    raise EngineError(f"llama_decode failed with code {rc} at position {self._n_past}")
                if len(chunk) == 1 and self._one_token_from is None and self.one_token_calls_split:
                    self._one_token_from = self._n_past
                self._n_past += len(chunk)
                if progress is not None:
                    progress(len(chunk))

    def logits(self) -> np.ndarray:
        """A float32 copy of the logits of the last evaluated token."""
        with self._lock:
            self._check()
            ptr = C.llama_get_logits_ith(self._ctx, -1)
            if not ptr:
                raise EngineError("no logits available: evaluate at least one token first")
            return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32, copy=True)

    # ----------------------------------------------------------------- state
    def buffer(self, size: int) -> memoryview:
        """A writable view of ``size`` bytes of the engine's reusable state buffer.

        Capture writes into it and the store reads block files straight into it, so a restore is
        one read and one llama call, with no intermediate copies; the buffer only grows.
        """
        if len(self._buf) < size:
            self._buf = bytearray(size)
        return memoryview(self._buf)[:size]

    def capture(self) -> memoryview:
        """The per-sequence state of sequence 0, in the engine buffer (valid until the next capture)."""
        return self._state_into(self.buffer)

    def capture_copy(self) -> bytearray:
        """The per-sequence state of sequence 0 in a new buffer the caller owns: what `capture()` then
        ``bytes()`` gives, written once instead of twice (the server keeps it past the engine's release
        to learn prefixes from it on another thread; 69 MB for 3,000 SmolLM2 tokens)."""
        return self._state_into(bytearray)

    def _state_into(self, alloc: Callable[[int], _Buf], flags: int = 0) -> _Buf:
        """``llama_state_seq_get_data_ext`` of sequence 0 into ``alloc(size)`` (a writable buffer); ``flags``
        0 is ``llama_state_seq_get_data`` (llama.cpp's plain call is this one with 0)."""
        with self._lock:
            self._check()
            size = C.llama_state_seq_get_size_ext(self._ctx, 0, flags)
            out = alloc(size)
            arr = (ctypes.c_uint8 * size).from_buffer(out)
            written = C.llama_state_seq_get_data_ext(self._ctx, arr, size, 0, flags)
            del arr
            if written != size:
                raise EngineError(f"state capture wrote {written} of {size} bytes")
            return out

    def restore(self, state: memoryview | bytes, n_tokens: int, one_token_from: Optional[int] = None) -> float:
        """Clear the cache and graft ``state`` (read-only is fine) as sequence 0; return the milliseconds of the clear and
        the llama call. ``one_token_from``: where the state's one-token calls begin, from the block's
        record (`one_token_calls`; None: it has none).

        The clear empties the cells' metadata only (``data=False``): zeroing the whole KV buffer is a
        memset of every layer's K and V (94 MB for SmolLM2 at n_ctx 4096, ~2 ms) that changes nothing
        a graft computes: the restored cells are overwritten, and the cells left with stale bytes are
        empty, hence masked, and the flash-attention kernel skips masked cells (measured byte-exact:
        tests/test_speed_paths.py grafts after a longer block left its bytes behind).
        `reset()` still zeroes the data, so a session ends with nothing of its work left behind.
        """
        # a read-only state (the hot tier's, `graftmem.store.hot`) is passed by address, not copied
        return self._set_state(state, 0, n_tokens, one_token_from,
                               refused="llama.cpp refused the state bytes (size or layout mismatch)", holder="block says")

    def _set_state(self, state: memoryview | bytes, flags: int, n_tokens: int, one_token_from: Optional[int], *,
                   refused: str, holder: str) -> float:
        """The one restore: clear the cells' metadata, ``llama_state_seq_set_data_ext`` of ``state`` as
        sequence 0, check where it ends, set what the engine knows of the cells; the milliseconds of the clear
        and the llama call. ``refused`` / ``holder``: how the errors name what was restored."""
        with self._lock:
            self._check()
            t0 = time.perf_counter()
            self.kept = None
            C.llama_memory_clear(C.llama_get_memory(self._ctx), False)
            self._n_past = 0
            self._one_token_from = None
            src = np.frombuffer(state, dtype=np.uint8)
            ok = C.llama_state_seq_set_data_ext(self._ctx, src.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                len(state), 0, flags)
            ms = (time.perf_counter() - t0) * 1e3
            del src
            if ok == 0:
                raise EngineError(refused)
            pos_max = C.llama_memory_seq_pos_max(C.llama_get_memory(self._ctx), 0)
            if pos_max + 1 != n_tokens:
                C.llama_memory_clear(C.llama_get_memory(self._ctx), True)
                raise EngineError(f"restored state ends at position {pos_max}, {holder} {n_tokens} tokens")
            self._n_past = n_tokens
            self._one_token_from = one_token_from if one_token_from is not None and one_token_from < n_tokens else None
            return ms

    def copy_on_device(self, key: object = None) -> "DeviceCopy":
        """Copy sequence 0's cells into buffers of this context, on the device that holds the KV cache, and
        return the handle `restore_on_device` takes; the copy replaces the previous one (llama.cpp keeps
        one per sequence and context) and lives until the next one or `close`.

        Why: a restore from host memory goes through ``set_data`` from pageable RAM (8 GB/s measured on an
        H200: ~0.2 s for a 12k-token f16 state of an 8B model), where a copy inside the device's memory
        runs at its bandwidth. This is llama.cpp's own mechanism (``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``,
        what llama-server's slot checkpoints use): the tensors stay in the context's buffers and only
        their description (cell positions, sequence ids, sizes: ~30 kB) comes back to the host. On a
        CPU build the "device" is host RAM and the copy is a memcpy (docs/benchmarks.md has both).

        Refused for recurrent and hybrid memory (llama.cpp aborts the process instead of raising on some
        of their layouts), for a block-quantized KV cache (q8_0, q4_0: llama.cpp copies part of it) and on
        a closed engine. The copy costs its size again in the device's memory.
        """
        with self._lock:
            self._check()
            self._check_device_copies()
            self._device_copy = None  # a failed copy leaves none the old handle could name
            desc = self._state_into(bytearray, C.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE)
            if not desc:
                raise EngineError("llama.cpp kept no description of the on-device copy")
            copy = DeviceCopy(description=bytes(desc), n_tokens=self._n_past, one_token_from=self._one_token_from,
                              key=key)
            self._device_copy = copy
            return copy

    @property
    def device_copy(self) -> Optional["DeviceCopy"]:
        """The copy `copy_on_device` made last (None: none, or the engine is closed)."""
        return self._device_copy

    def _check_device_copies(self) -> None:
        """Refuse, by name, what llama.cpp's on-device copy gets wrong or aborts on (`copy_on_device`)."""
        if self.memory.kind not in ("attention", "window"):
            raise UnsupportedFeature(
                f"keeping a state on the device is measured for KV caches only; {self.memory.arch} has "
                f"{KINDS[self.memory.kind]}: restore it from bytes (keep_on_device=False)")
        quantized = sorted({self.config.type_k, self.config.type_v} - _WHOLE_ELEMENT_TYPES)
        if quantized:
            # llama.cpp 0.3.36 views each copied range as ``size / type_size`` elements, which for a
            # block-quantized type is a 32nd of its bytes: the copy comes back wrong (measured: 96 %
            # of a q8_0 state's bytes, tests/test_on_device.py refuses it)
            raise UnsupportedFeature(
                f"keeping a state on the device copies only part of a {'/'.join(quantized)} KV cache in this "
                "llama.cpp build: use type_k / type_v f16, bf16 or f32 for it, or keep_on_device=False")

    def restore_on_device(self, copy: "DeviceCopy") -> float:
        """Clear the cache and put back the cells `copy_on_device` copied (the same bytes as a `restore`
        of that state: tests/test_on_device.py); return the milliseconds of the clear and the llama call.

        Only the handle this engine's last `copy_on_device` returned is taken: llama.cpp aborts the
        process when a description does not match the copy it holds, so any other (an older one, another
        engine's) is refused here with `EngineError` and the cells are left as they were.
        """
        with self._lock:
            self._check()
            if copy is not self._device_copy:
                raise EngineError("this engine holds no on-device copy of that state (it was replaced by a later "
                                  "copy_on_device, made by another engine, or never made): restore it from bytes")
            return self._set_state(copy.description, C.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE, copy.n_tokens,
                                   copy.one_token_from, refused="llama.cpp refused the on-device copy's description",
                                   holder="the copy holds")

    # ----------------------------------------------------------------- exactness
    def _static_exactness(self) -> Exactness:
        if self.n_swa > 0 and not self.config.swa_full:
            # measured: Gemma 3 with swa_full=False grafts inexactly past the window (1,500 tokens);
            # the probe is too short to see it, so this rule is static. docs/exactness.md
            return Exactness(exact=False, reason=(
                f"sliding-window model (n_swa={self.n_swa}) needs swa_full=True for byte-exact "
                "grafts; with a window-sized cache restored cells change order past the window"))
        return Exactness(exact=True, reason="configuration measured exact; probe not run")

    def _probe_once(self) -> Exactness:
        """`probe()`'s verdict for this fingerprint on this machine: run the first time, then read back.

        Why a cache: the verdict is a function of what the fingerprint records (model file, llama.cpp
        build, CPU features, weight buffers, context and KV settings) and of the probe's own text,
        both in the key; rerunning it decides nothing new, and on Gemma 3 it prefills 550 tokens twice,
        seconds per load, in every CLI call, worker and child process. The verdict is written only
        by a process that ran the probe (atomically; a read-only cache costs another probe), never
        in a kernel-probe child (that child exists to run its first decode)."""
        if os.environ.get(_CHILD_ENV):
            return self.probe()
        blob = json.dumps({"probe": _PROBE_VERSION, "n_swa": self.n_swa, "fingerprint": self.fingerprint.model_dump(),
                           "libraries": library_identity()}, sort_keys=True, default=str)
        path = model_cache_dir() / "exactness-probes" / f"{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json"
        cached = _read_verdict(path, Exactness)
        if cached is not None:
            return cached
        verdict = self.probe()
        _keep_verdict(path, verdict)
        return verdict

    def probe(self) -> Exactness:
        """Graft vs fresh prefill on a synthetic text, at load time (once per fingerprint and machine:
        `_probe_once` keeps the verdict).

        The probe block is longer than the sliding window for SWA models (that is where inexact
        configurations fail) and short for dense ones, so loading stays cheap.
        """
        n = min(self.n_swa + 40 if self.n_swa > 0 else 72, self.n_ctx - 8)
        words = ("graft state cell order window exact bytes logits prefill restore token "
                 "position cache layer head value key").split()
        text = " ".join(words[(i * 7) % len(words)] for i in range(n))
        tokens = self.tokenize(text)[:n]
        query = self.tokenize(" and then", add_special=False)
        crash = os.environ.get(_CRASH_ENV) if os.environ.get(_CHILD_ENV) else None
        if os.environ.get(_CHILD_ENV):
            _child_stage("decode")
        if crash and crash != "load" and (crash not in ("on", "off") or (crash == "on") == self.extra_bufts):
            ctypes.string_at(0)  # the fault the crash-path tests inject: SIGSEGV before the first decode
        with self.session():
            self.prefill(tokens)
            state = bytes(self.capture())
            self.prefill(query)
            fresh = logits_sha256(self.logits())
            self.restore(memoryview(bytearray(state)), len(tokens))
            self.prefill(query)
            graft = logits_sha256(self.logits())
        if fresh != graft:
            return Exactness(exact=False, probe_tokens=len(tokens), reason=(
                f"load-time probe: graft logits {graft[:16]} != fresh prefill {fresh[:16]} "
                f"after {len(tokens)} tokens; grafts in this configuration are not exact"))
        return Exactness(exact=True, probe_tokens=len(tokens),
                         reason=f"load-time probe: graft == fresh prefill, byte for byte, at {len(tokens)} tokens")
