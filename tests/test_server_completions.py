"""/v1/completions with the persistent prefix cache, through the official `openai` client: a raw prompt
is cut into ~256-token segments at clean cuts; a long prefix seen twice is learned and grafted, after a
restart too, and the greedy tokens and their log-probabilities equal those of the same request with
grafting disabled, float for float.

The server test runs on the tiny Llama 3.1 of tests/tiny.py (a real llama.cpp engine on a dense llama
body, as SmolLM2 is, with the real Llama 3.1 tokenizer): what it checks is the endpoint's plumbing
(segments, sightings, learning from the served cells, grafting, a restart), and each of its requests
prefills ~650 tokens several times over, seconds each on SmolLM2. Graft == fresh on SmolLM2 itself is
tests/test_exactness.py's and tests/test_server_openai.py's."""

from __future__ import annotations

import openai
import pytest

from graftmem.core.engine import Engine
from graftmem.server import api_server
from graftmem.server.chat import chunk_prompt
from graftmem.store.local import Store

from .conftest import long_text
from .tiny import tiny_path

PROMPT = "Notes of the support team.\n" + long_text(560, seed=77) + "\nQuestion: what is the first step?\nAnswer:"


@pytest.fixture(scope="module")
def tiny():
    with Engine(tiny_path("llama31")) as e:
        yield e


def _complete(c: openai.OpenAI, prompt: str, cache: bool = True):
    return c.completions.create(model="tiny-llama31", prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                extra_body={"graftmem": {"cache": cache}})


def _bytes(r) -> list:
    lp = r.choices[0].logprobs
    return [r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs]


def test_chunks_are_clean_and_prefix_stable(smol):
    segs, texts = chunk_prompt(smol, PROMPT)
    assert len(segs) >= 3 and sum(segs, []) == smol.tokenize(PROMPT)
    for i, (s, t) in enumerate(zip(segs[:-1], texts[:-1])):
        assert 256 <= len(s) < 256 + 32 and smol.tokenize(t, add_special=i == 0) == s
    longer, _ = chunk_prompt(smol, PROMPT + " The receipt.")
    assert longer[:len(segs) - 1] == segs[:-1]  # a shared prefix gives shared segments


def test_completions_graft_a_learned_prefix_exactly(tiny, tmp_path):
    assert len(chunk_prompt(tiny, PROMPT)[0]) >= 3  # at least two whole segments to learn, then the rest
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [tiny], min_prefix_tokens=256, sightings=2) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            cold = _complete(c, PROMPT, cache=False)
            assert cold.choices[0].logprobs.tokens  # something to compare: the tiny model did not stop at once
            first, second = _complete(c, PROMPT), _complete(c, PROMPT)  # learned during the second
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            warm = _complete(c, PROMPT)  # the same prompt again: its cells and first logits, kept in RAM
            assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens
            assert warm.model_extra["graftmem"]["source"] == "ram"
            assert _bytes(warm) == _bytes(cold) == _bytes(first) == _bytes(second)
            other = PROMPT.replace("first step?", "last step?")  # same prefix, another ending
            o = _complete(c, other)
            n = o.usage.prompt_tokens_details.cached_tokens  # the learned prefix: all but the last chunk
            assert 512 <= n < o.usage.prompt_tokens and o.model_extra["graftmem"]["tokens_restored"] == n
            assert _bytes(o) == _bytes(_complete(c, other, cache=False))
            assert _complete(c, other).usage.prompt_tokens_details.cached_tokens == n
        with api_server(store, [tiny]) as srv2:  # a restart
            c2 = openai.OpenAI(base_url=srv2.url + "/v1", api_key="unused", max_retries=0)
            again = _complete(c2, PROMPT)
            assert again.usage.prompt_tokens_details.cached_tokens == n and _bytes(again) == _bytes(cold)
    finally:
        store.close()
