"""The one decode loop (greedy, temperature, top-p, seed) and the engine session discipline."""

from __future__ import annotations

import numpy as np
import pytest

from graftmem import ConfigError, EngineError, Sampling
from graftmem.core import decode


PROMPT = "The three primary colours are"


def _decode(eng, sampling, n=12):
    with eng.session():
        eng.prefill(eng.tokenize(PROMPT))
        return decode(eng, n, sampling=sampling)


def test_greedy_is_the_argmax_chain(smol):
    """Greedy decode == taking the argmax of the real logits step by step, by hand."""
    got = _decode(smol, Sampling(), n=8)
    with smol.session():
        smol.prefill(smol.tokenize(PROMPT))
        want = []
        for _ in range(8):
            tok = int(np.argmax(smol.logits()))
            if smol.is_eog(tok):
                break
            want.append(tok)
            smol.prefill([tok])
    assert got.tokens == want and len(got.logprobs) == len(want)
    assert all(lp <= 0.0 for lp in got.logprobs)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(smol):
    hot = Sampling(temperature=1.5, seed=7)
    a, b = _decode(smol, hot), _decode(smol, hot)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    runs = {tuple(_decode(smol, Sampling(temperature=1.5, seed=s)).tokens) for s in range(4)}
    greedy = tuple(_decode(smol, Sampling()).tokens)
    assert len(runs | {greedy}) > 1  # a hot temperature over 4 seeds leaves the greedy path


def test_tiny_top_p_is_greedy(smol):
    """top_p so small that only the most likely token is left: sampling collapses to argmax."""
    assert _decode(smol, Sampling(temperature=1.0, top_p=1e-9, seed=3)).tokens == _decode(smol, Sampling()).tokens


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_is_a_config_error(kw):
    with pytest.raises(ConfigError):
        Sampling(**kw)


def test_max_tokens_below_one_is_refused(smol):
    with smol.session():
        smol.prefill(smol.tokenize(PROMPT))
        with pytest.raises(ConfigError, match="max_tokens"):
            decode(smol, 0)


def test_session_resets_after_an_error(smol):
    """The session's finally leaves an empty cache even when the work inside fails."""
    with pytest.raises(EngineError):
        with smol.session():
            smol.prefill(smol.tokenize(PROMPT))
            assert smol.n_past > 0
            smol.prefill([0] * (smol.n_ctx + 1))  # more than the context holds
    assert smol.n_past == 0


def test_ask_and_recall_take_a_sampling(mem):
    b = mem.learn("Colours: red, green and blue are the primary colours of light.", name="colours")
    greedy = mem.ask(b.id, "\nQ: name one.\nA:", max_tokens=6)
    hot = [mem.ask(b.id, "\nQ: name one.\nA:", max_tokens=6, sampling=Sampling(temperature=2.0, seed=s))
           for s in range(3)]
    again = mem.ask(b.id, "\nQ: name one.\nA:", max_tokens=6, sampling=Sampling(temperature=2.0, seed=0))
    assert again.tokens == hot[0].tokens
    # the graft is the same whatever the sampling: the first-step logits hash does not change
    assert {r.receipt.first_logits_sha256 for r in hot} == {greedy.receipt.first_logits_sha256}
