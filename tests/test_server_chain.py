"""A conversation learned as a chain while it is served, grafted after a server restart, in both storage
modes of automatic blocks: ``full`` (the default: each block holds its whole state) and ``delta``. The
greedy tokens and their log-probabilities equal those of the same request served cold."""

from __future__ import annotations

import openai
import pytest

from graftmem.server import api_server
from graftmem.store.local import Store

from .conftest import long_text

SYSTEM = "You are the support agent of a shop. " + long_text(80, seed=5)
TURNS = [("Hello", "Hello! How can I help?"), ("My parcel is late.", "I am sorry. What is the order number?"),
         ("It is 4471.", "Thank you, let me check.")]


def _messages(n: int) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for u, a in TURNS[:n]:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": "When will it arrive?"}]


def _ask(c, msgs, cache=True):
    r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                  top_logprobs=2, extra_body={"graftmem": {"cache": cache}})
    return r, [r.choices[0].message.content, [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                              for t in r.choices[0].logprobs.content]]


@pytest.mark.parametrize("storage", ["full", "delta"])
def test_conversation_chain_is_exact_after_a_restart(smol, tmp_path, storage):
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [smol], min_prefix_tokens=64, sightings=1, auto_storage=storage) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            for n in range(len(TURNS) + 1):  # the conversation grows; each turn learns its prefix
                _ask(c, _messages(n))
        children = [b for b in store.list(kind="auto") if b.parent is not None]  # closing waited for them
        assert children and {b.storage for b in children} == {storage}
        # named from the conversation's words, not the template's markers (`graftmem ls` shows the names)
        names = {b.name for b in store.list(kind="auto")}
        assert "auto: system " + " ".join(SYSTEM.split())[:33] in names, names
        assert not [n for n in names if "<|" in n or "|>" in n], names
        with api_server(store, [smol], auto_storage=storage) as srv2:
            c2 = openai.OpenAI(base_url=srv2.url + "/v1", api_key="unused", max_retries=0)
            warm, warm_bytes = _ask(c2, _messages(len(TURNS)))
            cold, cold_bytes = _ask(c2, _messages(len(TURNS)), cache=False)
            assert warm.usage.prompt_tokens_details.cached_tokens > 64 + 20
            assert warm.model_extra["graftmem"]["block_id"] in {b.id for b in children}
            assert warm_bytes == cold_bytes
    finally:
        store.close()
