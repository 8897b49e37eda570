"""The one decode loop: from the logits of the last prefilled token, pick a token, evaluate it, repeat.

Every answer graftmem produces goes through `decode()` (``Memory.ask``/``recall``, the flywheel's
sampled answers), so sampling, stop conditions and log-probabilities are written once. Greedy is
``temperature == 0`` (argmax, the default and the mode every exactness claim is made in); a positive
temperature samples from ``softmax(logits / temperature)``, restricted to the smallest set of tokens whose
probability reaches ``top_p``, with a caller-seeded generator so that a sampled answer is reproducible.

The log-probability of each chosen token is taken from the model's own distribution (``log_softmax`` of
the raw float32 logits in float64), not the tempered one: that is what a confidence score means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from .errors import ConfigError

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Sampling", "Decoded", "OnToken", "decode"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. The default is greedy, the mode exactness is proved in."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise ConfigError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


@dataclass
class Decoded:
    """What `decode()` produced: the tokens (end-of-generation excluded) and their log-probabilities."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (end-of-generation) or "length" (max_tokens / n_ctx)
    stop_logprob: Optional[float] = None  # the end-of-generation token's, when decoding stopped on one
    #: per generated token, the ``top_logprobs`` most likely (token, log-probability) pairs, when asked
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))


def _pick(x: np.ndarray, sampling: Sampling, rng: Optional[np.random.Generator]) -> int:
    if sampling.greedy:
        return int(np.argmax(x))
    z = x / sampling.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), sampling.top_p) + 1)]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    gen = rng if rng is not None else np.random.default_rng(sampling.seed)
    return int(gen.choice(len(p), p=p))


#: ``on_token(token, logprob, top)`` after each generated token (``top``: its alternatives when
#: ``top_logprobs`` is asked, else None): ``None`` to go on, or the finish reason to stop with (a stop
#: string was generated, the client went away); the token is kept either way.
OnToken = Callable[[int, float, Optional[list[tuple[int, float]]]], Optional[str]]


def decode(engine: "Engine", max_tokens: int, *, first_logits: Optional[np.ndarray] = None,
           sampling: Sampling = GREEDY, rng: Optional[np.random.Generator] = None,
           on_token: Optional[OnToken] = None, top_logprobs: int = 0) -> Decoded:
    """Decode up to ``max_tokens`` tokens from the engine's current logits (or ``first_logits``).

    Stops at end-of-generation (not included), when the context is full, or when ``on_token`` returns
    a finish reason (how the server streams tokens, applies stop strings and drops a request whose
    client disconnected, without a second loop). ``top_logprobs`` records that many alternatives per
    token in ``Decoded.top``. ``rng`` overrides the generator made from ``sampling.seed`` (the flywheel
    draws several seeded samples from one prefix). Hold ``engine.lock`` (or an [`Engine.session()`][graftmem.Engine.session])
    around the call and the prefill before it.
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {max_tokens!r}")
    if rng is None and not sampling.greedy:
        rng = np.random.default_rng(sampling.seed)
    out = Decoded()
    with engine.lock:
        logits = engine.logits() if first_logits is None else first_logits
        for _ in range(max_tokens):
            x = logits.astype(np.float64)
            tok = _pick(x, sampling, rng)
            m = x.max()
            lp = float(x[tok] - m - np.log(np.exp(x - m).sum()))
            if engine.is_eog(tok):
                out.finish_reason = "stop"
                out.stop_logprob = lp
                break
            out.tokens.append(tok)
            out.logprobs.append(lp)
            if top_logprobs > 0:
                lse = m + np.log(np.exp(x - m).sum())
                best = np.argsort(-x, kind="stable")[:top_logprobs]
                out.top.append([(int(t), float(x[t] - lse)) for t in best])
            if on_token is not None:
                reason = on_token(tok, lp, out.top[-1] if out.top else None)
                if reason is not None:
                    out.finish_reason = reason
                    break
            if len(out.tokens) == max_tokens or engine.n_past >= engine.n_ctx:
                break
            engine.prefill([tok])
            logits = engine.logits()
    return out
