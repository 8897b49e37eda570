"""In-RAM prompt reuse (llama-server's slot reuse): a request keeps its prompt's cells in its engine and
the next request there trims them to the segments it shares and prefills the rest. Checked through the
`openai` client against the same requests served cold (cache off): same tokens, same log-probabilities,
with two engines (each conversation goes back to the engine that holds it; on the tiny Llama 3.1 of
tests/tiny.py), on SmolLM2 after a warm start and on Gemma 3 past its sliding window."""

from __future__ import annotations

import json

import openai

from graftmem.core.engine import Engine
from graftmem.server import RECEIPT_HEADER, api_server
from graftmem.store.local import Store

from .conftest import long_text
from .tiny import tiny_path


def _turns(system: str, n: int, who: str = "") -> list[list[dict]]:
    """The prompts of an n-turn conversation (fixed assistant answers, so the prompts are known ahead);
    ``who`` starts each question (another conversation on the same system prompt)."""
    msgs = [{"role": "system", "content": system}]
    out = []
    for i in range(n):
        msgs = msgs + [{"role": "user", "content": f"{who}Question {i}: what is {i} plus {i}?"}]
        out.append(msgs)
        msgs = msgs + [{"role": "assistant", "content": f"It is {2 * i}."}]
    return out


def _ask(c: openai.OpenAI, model: str, messages, *, cache: bool = True):
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"graftmem": {"cache": cache}})
    r = raw.parse()
    return r, json.loads(raw.headers[RECEIPT_HEADER])


def _bytes(r) -> list:
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]


def test_two_engines_each_conversation_finds_its_engine(tmp_path):
    a = _turns("You are a shop's support agent. " + long_text(60, seed=3), 2)
    b = _turns("You are a travel agent. " + long_text(60, seed=4), 2)
    store = Store(tmp_path / "home")
    # the tiny Llama 3.1 of tests/tiny.py (real engine, real tokenizer and template): which engine a turn
    # goes to is the server's plumbing, and SmolLM2 spent seconds prefilling the same prompts
    with Engine(tiny_path("llama31")) as e1, Engine(e1.model_path, e1.config) as e2:
        try:
            with api_server(store, [e1, e2], learn=False) as srv:
                c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
                cold = {k: _ask(c, "tiny-llama31", m, cache=False)[0] for k, m in
                        {"a2": a[1], "b2": b[1]}.items()}
                assert all(_bytes(r) for r in cold.values())  # tokens to compare: the tiny model did not stop at once
                # each turn after the previous one released its engine (a non-streamed answer is sent just
                # before that: a client that asks again at once can find only the other engine free)
                _, ra1 = _ask(c, "tiny-llama31", a[0])
                assert srv.pipeline.wait_idle()
                _, rb1 = _ask(c, "tiny-llama31", b[0])
                assert srv.pipeline.wait_idle()
                assert ra1["source"] is None and rb1["source"] is None  # nothing stored, nothing kept yet
                # B's next turn first: the engine that served A is first in line, the one holding B is chosen
                b2, rb2 = _ask(c, "tiny-llama31", b[1])
                assert srv.pipeline.wait_idle()
                a2, ra2 = _ask(c, "tiny-llama31", a[1])
                for r, rec, prev in ((b2, rb2, rb1), (a2, ra2, ra1)):
                    assert rec["source"] == "ram", rec
                    # everything up to the previous turn's question was kept (its header and answer trimmed)
                    assert rec["tokens_restored"] >= prev["tokens_prefilled"] - 8
                    assert r.usage.prompt_tokens_details.cached_tokens == rec["tokens_restored"]
                assert _bytes(b2) == _bytes(cold["b2"]) and _bytes(a2) == _bytes(cold["a2"])
                assert b2.choices[0].message.content == cold["b2"].choices[0].message.content
        finally:
            store.close()
        assert all(e.kept is None and e.n_past == 0 for e in (e1, e2))  # a closed server leaves its engines empty


def test_conversations_sharing_a_system_prompt_keep_their_own_engines(smol, tmp_path):
    """Two conversations with ONE system prompt, alternating on three engines: each turn after the first
    finds its whole conversation in RAM, on the engine that holds it. Before `engine_fit`, the second
    conversation's first turn took the engine holding the first one (it held the shared system prompt:
    most of the prompt) while the other engines sat empty, and from then on each turn overwrote the other
    conversation's history: every "ram" hit was the system prompt alone (measured behind SMG, issue 42).
    The third engine stays empty: a conversation's next turn must prefer its own engine to an empty one
    (the previous prompt's generation header, which the next turn replaces, is no loss)."""
    system = "You are a shop's support agent. " + long_text(60, seed=11)
    a, b = _turns(system, 3), _turns(system, 3, who="Another customer. ")
    with smol.sibling() as e2, smol.sibling() as e3:
        store = Store(tmp_path / "home")
        try:
            with api_server(store, [smol, e2, e3], learn=False) as srv:
                c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
                cold = {k: _ask(c, "smollm2", m, cache=False)[0] for k, m in {"a3": a[2], "b3": b[2]}.items()}
                prev: dict[str, dict] = {}
                got: dict[str, object] = {}
                for t in range(3):
                    for name, conv in (("a", a), ("b", b)):
                        # one turn after the other released its engine (a non-streamed answer is sent just before)
                        assert srv.pipeline.wait_idle()
                        r, rec = _ask(c, "smollm2", conv[t])
                        if t == 0:  # nothing stored (learn=False); B's first turn takes the empty engine,
                            assert rec["source"] is None, (name, rec)  # not A's (which holds the shared prompt)
                        else:
                            # the whole previous prompt is restored, not only the system prompt both share
                            # (all but the previous turn's generation header, trimmed with its answer)
                            assert rec["source"] == "ram", rec
                            assert rec["tokens_restored"] >= prev[name]["tokens_restored"] + \
                                prev[name]["tokens_prefilled"] - 8, (name, t, rec, prev[name])
                        prev[name], got[name] = rec, r
                assert _bytes(got["a"]) == _bytes(cold["a3"]) and _bytes(got["b"]) == _bytes(cold["b3"])
        finally:
            store.close()
    assert smol.kept is None and smol.n_past == 0


def test_gemma_reuse_past_the_sliding_window_is_exact(gemma, tmp_path):
    turns = _turns("You are a librarian. " + long_text(520, seed=8), 3)
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [gemma], learn=False) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            colds = [_ask(c, "gemma3-270m", m, cache=False)[0] for m in turns[1:]]
            _ask(c, "gemma3-270m", turns[0])
            for m, cold in zip(turns[1:], colds):
                r, rec = _ask(c, "gemma3-270m", m)
                assert rec["source"] == "ram" and rec["tokens_restored"] > gemma.n_swa, rec
                assert _bytes(r) == _bytes(cold)
    finally:
        store.close()


def _remembered(store: Store, block) -> bool:
    import os

    from graftmem.store import verified

    fd = os.open(store.path_of(block.id), os.O_RDONLY)
    try:
        return verified.recall(verified.file_version(fd, block.state_digest)) is not None
    finally:
        os.close(fd)


def _forget(store: Store, block) -> None:
    import os

    from graftmem.store import verified

    fd = os.open(store.path_of(block.id), os.O_RDONLY)
    try:
        verified.forget(verified.file_version(fd, block.state_digest))
    finally:
        os.close(fd)


def test_warm_start_grafts_the_latest_chain_and_checks_its_earlier_blocks(smol, tmp_path):
    turns = _turns("You are a shop's support agent. " + long_text(60, seed=9), 4)
    store = Store(tmp_path / "home")
    try:
        with api_server(store, [smol], min_prefix_tokens=16, sightings=1) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            for m in turns:
                _ask(c, "smollm2", m)
        autos = store.list(kind="auto")
        leaves = [b for b in autos if not store.children(b.id)]
        assert len(autos) >= 3 and len(leaves) == 1, [b.name for b in autos]
        for warm in (False, True):
            for b in autos:  # as in a new process: no file version checked yet
                _forget(store, b)
            with api_server(store, [smol], warm=warm) as srv:
                assert [w["block_id"] for w in srv.warm] == ([leaves[0].id] if warm else [])
                assert smol.n_past == (leaves[0].pos_end if warm else 0)
                # warm: every block of the chain is checked now (their grafts will check xxh3 only);
                # cold: none is (nothing was grafted yet)
                assert [_remembered(store, b) for b in autos] == [warm] * len(autos)
                if warm:  # the conversation's next turn: its earlier turns come from RAM
                    r, rec = _ask(openai.OpenAI(base_url=srv.url + "/v1", api_key="u", max_retries=0), "smollm2",
                                  turns[-1])
                    assert rec["source"] == "ram" and rec["tokens_restored"] >= leaves[0].pos_end - 16, rec
    finally:
        store.close()


def test_token_cache_returns_what_tokenizing_returns(smol):
    from graftmem.server.chat import TokenCache

    cache = TokenCache(max_chars=300)
    texts = ["<|im_start|>system\n" + long_text(30, seed=i) for i in range(4)]
    for t in texts + texts[::-1]:
        for bos in (True, False):
            ids = cache.tokenize(smol, t, bos)
            assert ids == smol.tokenize(t, add_special=bos)
            ids.append(-1)  # the caller's list is its own
            assert cache.tokenize(smol, t, bos) == smol.tokenize(t, add_special=bos)
    assert cache._chars <= 300 and len(cache._ids) < 8  # bounded: the oldest texts were dropped
