"""Typed data: engine configuration, fingerprints, block manifests and results. Pure, no I/O.

A block's identity lives inside its id (the LMCache lesson): the id is a hash of the engine
fingerprint's identity digest, the parent id, the token ids and the block's salts, made and checked in
one place (`graftmem.core.identity`), so the same text learned twice under the same engine is one
block, and the same text under another engine is another block.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from typing import Any, ClassVar, Literal, Mapping, Optional, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError

__all__ = [
    "FORMAT_VERSION", "KVType", "EngineConfig", "Fingerprint", "Exactness", "Block",
    "VerificationRecord", "Receipt", "Recall", "SampleResult", "VerifyReport", "StoreStats",
    "SearchHit", "Scope", "HistoryEvent", "Provenance", "PROVENANCE_LOCAL",
    "PROVENANCE_REDERIVED", "PROVENANCE_UNVERIFIED", "provenance_is_trusted",
    "MANUAL_KIND", "PAGE_KIND", "AUTO_KIND", "SOLUTION_KIND", "UNROUTED_KINDS",
]

# ------------------------------------------------------------------------------------ block kinds
#: the default kind: a text an application learned (a skill manual, a system prompt, a note)
MANUAL_KIND = "manual"
#: the page blocks of long documents (`graftmem.memory.pager`): routed per passage by the page index,
#: never by the block router
PAGE_KIND = "page"
#: the prefix blocks the server keeps automatically (pieces of conversations, not knowledge anyone
#: learned for tasks): never routed, in the server or in a Memory opened on the same home
AUTO_KIND = "auto"
#: verified solutions the flywheel deposits (`graftmem.memory.flywheel`)
SOLUTION_KIND = "solution"
#: kinds the block router leaves out
UNROUTED_KINDS = (PAGE_KIND, AUTO_KIND)

#: Version of the block file layout and of the state payload convention (per-sequence state of seq 0).
FORMAT_VERSION = 1

KVType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]

#: llama.cpp's "extra buffer types" for weights (CPU repack, AMX): ``off`` (the default: plain buffers),
#: ``on`` (llama.cpp's own default), ``auto`` (on only where a probe in a child process has shown that
#: they decode without crashing and graft exactly on this build and CPU; the verdict is cached).
ExtraBufts = Literal["off", "on", "auto"]

#: Environment variable that sets the default of `EngineConfig.extra_bufts` (an explicit config wins).
EXTRA_BUFTS_ENV = "GRAFTMEM_EXTRA_BUFTS"


def _default_extra_bufts() -> ExtraBufts:
    value = os.environ.get(EXTRA_BUFTS_ENV, "off").strip().lower() or "off"
    if value not in ("off", "on", "auto"):
        raise ConfigError(f"{EXTRA_BUFTS_ENV}={value!r}: expected off, on or auto")
    return cast(ExtraBufts, value)  # one of the three: checked above


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineConfig(_Strict):
    """Engine settings. Unknown keys are rejected so a typo can never silently change the bytes.

    The defaults are the configuration measured byte-exact on both dense and sliding-window models:
    flash attention on (the CPU kernel accumulates valid cells in cell order and skips masked ones)
    and a full-size SWA cache (so restored cells keep their order). See docs/exactness.md.
    """

    n_ctx: int = Field(8192, ge=64)
    n_batch: int = Field(512, ge=1)
    n_ubatch: int = Field(512, ge=1)
    n_threads: Optional[int] = Field(None, ge=1, description="None: every core this process may use (its CPU affinity)")
    type_k: KVType = "f16"
    type_v: KVType = "f16"
    flash_attn: bool = True
    swa_full: bool = True
    probe: bool = Field(True, description="run the graft-vs-fresh exactness probe at load time")
    extra_bufts: ExtraBufts = Field(default_factory=_default_extra_bufts, description=(
        "llama.cpp's extra weight buffer types (CPU repack, AMX): off (default, safe), on, or auto "
        "(on where a child-process probe showed they run and stay exact here); default from "
        f"${EXTRA_BUFTS_ENV}"))
    n_gpu_layers: int = Field(0, ge=0, description=(
        "layers offloaded to a GPU backend (needs a llama-cpp-python built with CUDA/Metal/Vulkan; "
        "999 offloads all); 0 keeps the CPU backend, the one measured exact"))
    keep_on_device: bool = Field(False, description=(
        "keep the last grafted block's state in the context's own buffers (the GPU's memory where the "
        "KV cache is offloaded) and graft it again from there instead of from RAM or disk: the same "
        "cells (docs/exactness.md), one state's size of extra device memory per engine; f16/bf16/f32 KV caches "
        "and attention models only; off until its speed is measured on a GPU (docs/benchmarks.md)"))

    @classmethod
    def coerce(cls, config: "EngineConfig | Mapping[str, Any] | None") -> "EngineConfig":
        """An EngineConfig from a config, a mapping of its fields, or None (the defaults), with one
        readable [`ConfigError`][graftmem.ConfigError] naming every bad field (no validator internals, no URLs).
        ``kv`` in a mapping is the shorthand for the same ``type_k`` and ``type_v`` (``{"kv": "q8_0"}``:
        a q8_0 K and V cache, half the bytes of every graft, exact in its own fingerprint)."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if not isinstance(config, Mapping):
            raise ConfigError(f"config must be an EngineConfig or a mapping of its fields (a JSON object such "
                              f"as {{\"n_ctx\": 4096}}), got {type(config).__name__}; fields: "
                              f"{', '.join(cls.model_fields)}")
        fields = dict(config)
        if "kv" in fields:  # the shorthand for both cache types: {"kv": "q8_0"} (docs/exactness.md, KV types)
            kv = fields.pop("kv")
            both = {k: fields[k] for k in ("type_k", "type_v") if k in fields and fields[k] != kv}
            if both:
                raise ConfigError(f"kv={kv!r} sets type_k and type_v; it contradicts "
                                  + ", ".join(f"{k}={v!r}" for k, v in both.items()))
            fields.update(type_k=kv, type_v=kv)
        try:
            return cls(**fields)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                field = ".".join(str(x) for x in err["loc"]) or "config"
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown field {field!r}")
                else:
                    problems.append(f"{field}: {err['msg']} (got {err.get('input')!r})")
            raise ConfigError(f"invalid engine config: {'; '.join(problems)}; fields: "
                              f"{', '.join(cls.model_fields)}") from None
        except TypeError as exc:
            raise ConfigError(f"invalid engine config: {exc}") from None


class Fingerprint(_Strict):
    """Everything that decides the bytes of a KV state. Two engines may share blocks only if the
    identity fields are equal; ``n_threads`` and ``model_name`` are recorded for information only
    (thread count was measured not to change the bytes on this CPU backend: docs/exactness.md)."""

    model_sha256: str
    model_name: str
    llama_cpp_version: str
    llama_build: str
    n_ctx: int
    n_batch: int
    n_ubatch: int
    type_k: str
    type_v: str
    flash_attn: bool
    swa_full: bool
    backend: str
    cpu_features: str
    n_threads: int
    format_version: int = FORMAT_VERSION
    #: The buffer types llama.cpp put the weights in, as its load log names them ("CPU" for plain
    #: host memory, mapped or not; "CPU+CPU_REPACK" or "AMX+CPU" where extra buffer types repacked
    #: tensors; a GPU's name where layers were offloaded). Repacked weights run other kernels: another
    #: computation. None in fingerprints written before graftmem 0.3 (see `identity`).
    weight_buffers: Optional[str] = None
    #: Layers offloaded to a GPU backend (0: none).
    n_gpu_layers: int = 0

    INFO_FIELDS: ClassVar[frozenset[str]] = frozenset({"model_name", "n_threads"})
    #: Identity fields left out of the digest while they hold the value every block before them had
    #: (plain CPU weight buffers, no offload), so the ids of those blocks do not change; any other
    #: value is part of the identity and of the diff.
    LEGACY_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {"weight_buffers": (None, "CPU"), "n_gpu_layers": (0,)}

    def identity(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items()
                if k not in self.INFO_FIELDS and v not in self.LEGACY_VALUES.get(k, ())}

    @property
    def settings(self) -> str:
        """The engine settings a user chooses that a block grafts only under, short (``n_ctx=8192 kv=f16``):
        what ``graftmem ls`` shows and ``--config`` must give again (`IncompatibleBlock` names any that differ)."""
        kv = self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"
        return f"n_ctx={self.n_ctx} kv={kv}"

    def digest(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def diff(self, other: "Fingerprint") -> dict[str, tuple[Any, Any]]:
        """Identity fields whose values differ, as ``{field: (self, other)}``."""
        a, b = self.identity(), other.identity()
        full_a, full_b = self.model_dump(), other.model_dump()
        return {k: (full_a.get(k), full_b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


class Exactness(_Strict):
    """Whether grafts in this engine may be called exact, and why."""

    exact: bool
    reason: str
    probe_tokens: int = 0


#: Where a block's state came from, as THIS store knows it (local knowledge, never in the block file):
#: ``local`` (prefilled here), ``rederived`` (re-prefilled here and compared byte for byte),
#: ``signed:<key id>`` (a key of the trust policy signed the manifest that pins it), ``unverified``
#: (nothing here vouches for it: digests only prove the bytes arrived as sent). See docs/security.md.
Provenance = str
PROVENANCE_LOCAL = "local"
PROVENANCE_REDERIVED = "rederived"
PROVENANCE_UNVERIFIED = "unverified"
_LOCAL_FIELDS = frozenset({"provenance", "labels_trusted"})


def provenance_is_trusted(provenance: Optional[str]) -> bool:
    """Whether a block with this provenance may be grafted without the caller's explicit consent."""
    return provenance is not None and (provenance in (PROVENANCE_LOCAL, PROVENANCE_REDERIVED)
                                       or provenance.startswith("signed:"))


def _now() -> datetime:
    return datetime.now(timezone.utc)


class VerificationRecord(_Strict):
    """The outcome of the last verification of a block, stored in its manifest."""

    checked_at: datetime = Field(default_factory=_now)
    samples: int
    sha_equal: int
    max_kl: float
    argmax_agree: int
    ok: bool


class Block(_Strict):
    """A learned text and the identity of the KV state that holds it (the manifest of a block file).

    Provenance: the token ids and the text are stored, so anyone can re-derive the state from the
    text and compare bytes. Positions are always ``[pos_start, pos_start + n_tokens)``: a block is
    only ever grafted where it was computed.
    """

    id: str
    name: str
    kind: str = MANUAL_KIND
    text: str
    tokens: list[int]
    n_tokens: int
    pos_start: int = 0
    parent: Optional[str] = None
    fingerprint: Fingerprint
    created_at: datetime = Field(default_factory=_now)
    state_size: int
    state_digest: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    verification: Optional[VerificationRecord] = None
    #: ``"full"``: the file holds the whole per-sequence state. ``"delta"`` (chained blocks only): the
    #: file holds only this block's new cells and the full state is rebuilt from the parent's (see
    #: `graftmem.core.statefmt`); ``state_size``/``state_digest`` then describe the stored delta and
    #: ``full_state_size``/``full_state_digest`` the rebuilt state, checked before it is grafted.
    storage: Literal["full", "delta"] = "full"
    full_state_size: Optional[int] = None
    full_state_digest: Optional[str] = None
    #: This store's knowledge of where the state came from (see `Provenance`); filled in by the
    #: store from its index, never read from or written to the block file (``exclude=True`` keeps the
    #: file's manifest bytes identical; a manifest that carries the key is refused as forged).
    provenance: Optional[str] = Field(None, exclude=True)
    #: Whether the labels (``name``, ``metadata`` such as ``when_to_use``) were given here or are covered
    #: by a trusted signature. Labels of a foreign, unsigned block are shown but never embedded for
    #: routing: only its tokens (and the text they are checked against) are bound to its state.
    labels_trusted: Optional[bool] = Field(None, exclude=True)

    @field_validator("provenance", "labels_trusted", mode="before")
    @classmethod
    def _local_only(cls, v: Any) -> Any:
        # set only by the store (model_copy skips validation); a value coming from parsed JSON is a
        # manifest that tries to claim a provenance for itself
        if v is not None:
            raise ValueError("provenance and labels_trusted are local knowledge of a store; a block "
                             "manifest may not carry them")
        return v

    def __eq__(self, other: object) -> bool:
        """Two blocks are equal when their manifests are: provenance is what one store knows of a
        block, not part of it (a block read from its file equals the same block from the index)."""
        if not isinstance(other, Block):
            return NotImplemented
        return ({k: v for k, v in self.__dict__.items() if k not in _LOCAL_FIELDS}
                == {k: v for k, v in other.__dict__.items() if k not in _LOCAL_FIELDS})

    def __hash__(self) -> int:
        return hash((self.id, self.state_digest))

    @property
    def trusted(self) -> bool:
        """Whether its provenance lets it be grafted without ``allow_unverified=True``."""
        return provenance_is_trusted(self.provenance)

    @property
    def verified_here(self) -> Optional[bool]:
        """What a listing shows as "verified": the verify record's verdict (None without one), and None for
        a block whose state nothing here vouches for (provenance ``unverified``): the record travels inside
        the block, so after an import without re-derivation it is the source's claim, not a proof here."""
        if self.verification is None or not self.trusted:
            return None
        return self.verification.ok

    @property
    def short_id(self) -> str:
        return self.id[:12]

    @property
    def pos_end(self) -> int:
        return self.pos_start + self.n_tokens

    @property
    def one_token_calls(self) -> Optional[dict[str, Any]]:
        """What this block's state records of its one-token calls (``{"threads", "from"}``, from
        `graftmem.Engine.one_token_calls`; None: it has none): such cells depend on the thread count."""
        calls = self.metadata.get("one_token_calls")
        return calls if isinstance(calls, dict) else None

    @property
    def one_token_from(self) -> Optional[int]:
        """Where the first cell computed by a one-token call lies in this block's state (None: there is none)."""
        got = (self.one_token_calls or {}).get("from")
        return got if isinstance(got, int) else None

    @property
    def restored_size(self) -> int:
        """Bytes of the full state a graft restores (the stored size, or the rebuilt size of a delta)."""
        return self.full_state_size if self.full_state_size is not None else self.state_size


class Receipt(_Strict):
    """What a graft did, so a caller can audit and reproduce it."""

    block_id: Optional[str]
    tokens_restored: int
    tokens_prefilled: int
    restore_ms: float
    prefill_ms: float
    decode_ms: float
    decode_tokens: int
    first_logits_sha256: str
    exact: bool
    #: provenance of the grafted block (see `Provenance`), None when nothing was grafted
    provenance: Optional[str] = None
    # Where a recall's time went (milliseconds; None where the phase did not run or was not timed).
    # ``restore_ms`` is their sum for the graft steps (read + check + place + set_data), plus the
    # small bookkeeping between them; ``prefill_ms`` is the task's prefill and ``decode_ms`` the decode.
    route_ms: Optional[float] = None  #: routing the task to a block (embedding + vector search)
    #: downloading the block from object storage, its parts copied and hashed as they land (a fleet
    #: store's cache miss)
    fetch_ms: Optional[float] = None
    read_ms: Optional[float] = None  #: reading the block file(s) into the engine's buffer
    check_ms: Optional[float] = None  #: header, trailer, fingerprint and state digest checks
    place_ms: Optional[float] = None  #: sliding-window cells put back at their fresh indices (Gemma)
    set_data_ms: Optional[float] = None  #: clearing the cache and ``llama_state_seq_set_data``
    # The server's doors (OpenAI routes) fill these too: the same receipt type on every door.
    #: where the restored prompt prefix came from: ``"store"`` (a graft), ``"ram"`` (cells kept in the
    #: engine by the previous request or the warm start), None (served cold)
    source: Optional[str] = None
    cache: Optional[bool] = None  #: whether the request allowed the prefix cache (``graftmem.cache``)
    #: what routed recall chose on a server door: ``{"block_id", "score", "min_score"}``
    recall: Optional[dict[str, Any]] = None

    def __str__(self) -> str:
        """One readable line, rounded: what a person wants from ``print(answer.receipt)``."""
        if self.block_id is None:
            return f"nothing grafted; exact={self.exact}"
        return (f"block {self.block_id[:12]}: {self.tokens_restored} tokens restored in {self.restore_ms:.1f} ms, "
                f"{self.tokens_prefilled} prefilled in {self.prefill_ms:.1f} ms, {self.decode_tokens} decoded in "
                f"{self.decode_ms:.1f} ms; first logits sha256 {self.first_logits_sha256[:16]}…; exact={self.exact}"
                + (f"; provenance {self.provenance}" if self.provenance else ""))


class Recall(_Strict):
    """The answer to a query over a grafted block, with its receipt.

    ``matched`` is False when routing found no block above ``min_score``: then nothing was grafted,
    ``text`` is empty (an agent that returns ``r.text`` never shows its user a diagnostic) and ``reason``
    says why, naming the best candidate and, when blocks of other engines are in the store, what differs.
    """

    text: str
    tokens: list[int]
    block: Optional[Block]
    receipt: Receipt
    score: Optional[float] = None
    runner_up: Optional[str] = None
    runner_up_score: Optional[float] = None
    matched: bool = True
    reason: Optional[str] = None
    finish_reason: Optional[str] = None  #: "stop" (end of generation) or "length" (max_tokens / context)


class Scope(_Strict):
    """Who a block belongs to: any of a user, an agent, a session (None = not scoped on that field)."""

    user_id: Optional[str] = None
    agent_id: Optional[str] = None
    session_id: Optional[str] = None

    @property
    def empty(self) -> bool:
        return self.user_id is None and self.agent_id is None and self.session_id is None


class HistoryEvent(_Strict):
    """One thing that happened to a block: ``learned``, ``learned_again``, ``labels_updated``,
    ``verified``, ``scope_added``, ``forgotten`` (for one scope), ``deleted``."""

    seq: int
    block_id: str
    event: str
    at: float  #: seconds since the epoch
    details: dict[str, Any] = Field(default_factory=dict)


class SampleResult(_Strict):
    query: str
    n_query_tokens: int
    graft_sha256: str
    fresh_sha256: str
    sha_equal: bool
    kl: float
    argmax_equal: bool


class VerifyReport(_Strict):
    """Graft vs fresh prefill, per sample; ``ok`` only when every sample is byte-identical and so is the
    fresh-vs-fresh floor: graft == fresh says nothing on an engine whose fresh prefills differ from each other."""

    block_id: str
    n_tokens: int
    samples: int
    sha_equal: int
    max_kl: float
    mean_kl: float
    argmax_agree: int
    floor_sha_equal: int
    floor_samples: int
    cross_process: Optional[bool] = None
    exact_engine: bool
    rows: list[SampleResult]

    @property
    def ok(self) -> bool:
        return (self.sha_equal == self.samples and self.argmax_agree == self.samples
                and self.max_kl == 0.0 and self.cross_process is not False
                and self.floor_sha_equal == self.floor_samples)


class StoreStats(_Strict):
    home: str
    blocks: int
    tokens: int
    bytes_on_disk: int
    bytes_per_token: float
    kinds: dict[str, int]


class SearchHit(_Strict):
    """One candidate of a routing search: a block and its routing score against the task.

    The score is the dense part (cosines of normalized embeddings, in [-1, 1]) plus 0.5 x the lexical
    coverage (in [0, 1]): see docs/routing.md. Compare it with ``min_score``, not across embedders.
    """

    block_id: str
    name: str
    score: float
    kind: str
    n_tokens: int
    when_to_use: Optional[str] = None
