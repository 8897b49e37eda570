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
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from .errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from .engine import Engine, Grammar

__all__ = ["Sampling", "Decoded", "OnToken", "decode", "AnswerText", "check_stops", "MAX_STOPS"]

#: Stop strings per request (OpenAI allows 4; more is allowed here, but not without bound)
MAX_STOPS = 16


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
    import numpy as np

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
           on_token: Optional[OnToken] = None, top_logprobs: int = 0,
           grammar: Optional["Grammar"] = None) -> Decoded:
    """Decode up to ``max_tokens`` tokens from the engine's current logits (or ``first_logits``).

    Stops at end-of-generation (not included), when the context is full, or when ``on_token`` returns
    a finish reason (how the server streams tokens, applies stop strings and drops a request whose
    client disconnected, without a second loop). ``top_logprobs`` records that many alternatives per
    token in ``Decoded.top``. ``grammar`` (an [`Engine.grammar()`][graftmem.Engine.grammar]) masks the
    tokens it forbids before the pick; log-probabilities stay the model's own. ``rng`` overrides the generator made from ``sampling.seed`` (the flywheel
    draws several seeded samples from one prefix). Hold ``engine.lock`` (or an [`Engine.session()`][graftmem.Engine.session])
    around the call and the prefill before it.
    """
    import numpy as np  # here, not at the top: a CLI client of a running server never decodes

    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {max_tokens!r}")
    if rng is None and not sampling.greedy:
        rng = np.random.default_rng(sampling.seed)
    out = Decoded()
    with engine.lock:
        logits = engine.logits() if first_logits is None else first_logits
        for _ in range(max_tokens):
            x = logits.astype(np.float64)
            if grammar is None:
                tok = _pick(x, sampling, rng)
            else:
                allowed = grammar.mask(logits).astype(np.float64)
                if not np.isfinite(allowed).any():
                    raise ConfigError("the grammar allows no token here (the output cannot be completed)")
                tok = _pick(allowed, sampling, rng)
            m = x.max()
            lp = float(x[tok] - m - np.log(np.exp(x - m).sum()))
            if engine.is_eog(tok):
                out.finish_reason = "stop"
                out.stop_logprob = lp
                break
            if grammar is not None:
                grammar.accept(tok)
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


def check_stops(stop: "str | Sequence[str] | None") -> list[str]:
    """``stop`` as a list of non-empty strings (one string is a list of one), or a `ConfigError`."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops):
        raise ConfigError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if len(stops) > MAX_STOPS:
        raise ConfigError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    return list(stops)


class AnswerText:
    """The text of an answer while its tokens arrive: what is final, and where a stop string cut it.

    Why a class: a UTF-8 character may span two tokens and a stop string may span several, so the
    bytes are joined before decoding, the text is searched for stop strings as a whole, and a stream
    hands out only text that can no longer change (no half character, nothing that may still turn
    out to be the start of a stop string). Both the Python API's streams and the HTTP server's use it.
    """

    def __init__(self, piece: Callable[[int], bytes], stops: Sequence[str] = ()) -> None:
        self._piece = piece
        self.stops = [s for s in stops if s]
        self._raw = bytearray()
        self._emitted = 0
        self.stop_at: Optional[int] = None  #: index in the decoded text where a stop string begins
        #: the stop string that ended the answer (Anthropic's ``stop_sequence`` names it)
        self.stopped_by: Optional[str] = None
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def add(self, token: int) -> bool:
        """Append one generated token; True when a stop string is now complete (stop decoding)."""
        self._raw.extend(self._piece(token))
        if self.stops:
            text = self._raw.decode("utf-8", "replace")
            hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
            if hits:
                self.stop_at, self.stopped_by = min(hits)
                return True
        return False

    @property
    def text(self) -> str:
        """The answer so far, cut before the first stop string."""
        text = self._raw.decode("utf-8", "replace")
        return text if self.stop_at is None else text[:self.stop_at]

    def delta(self, final: bool = False) -> str:
        """The text that became final since the last call (all of the rest with ``final=True``)."""
        text = self.text
        if final or self.stop_at is not None:
            safe = len(text)
        else:
            safe = min(len(text) - self._hold, len(text.rstrip("\ufffd")))
        if safe <= self._emitted:
            return ""
        out = text[self._emitted:safe]
        self._emitted = safe
        return out
