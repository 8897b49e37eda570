"""The thread count and the bytes: llama.cpp's CPU flash attention splits a ONE-token call's attention over
its threads (once the cache view holds 512 cells), so those calls compute other bytes on another thread
count, while calls of two tokens or more do not. What graftmem does about it, checked here on the tiny
Llama 3.1: a pool decodes on the lone engine's thread count (answers do not depend on `--engines`), and a
block whose cells include one-token calls records their thread count and is refused by an engine with
another (docs/exactness.md, "One-token calls and the thread count")."""

from __future__ import annotations

import pytest

from graftmem import IncompatibleBlock, Memory
from graftmem.core import engine as engine_module
from graftmem.core.engine import Engine, logits_sha256
from graftmem.server import pool_engines

from .conftest import long_text
from .tiny import tiny_path

CFG = {"n_ctx": 1024, "n_batch": 128, "n_ubatch": 128, "probe": False}
PREFIX = list(range(100, 700))  # 600 cells: the cache view holds 1,024 (padded), past the split's 512
QUERY = "What is the third word?"


def _engine(**over) -> Engine:
    return Engine(tiny_path("llama31"), {**CFG, **over})


def _calls(threads: int, flash_attn: bool = True) -> list[str]:
    """Logits after the 600-token prefix and then calls of 1, 2 and 5 tokens (each from the prefix)."""
    with _engine(n_threads=threads, flash_attn=flash_attn) as e, e.session():
        e.prefill(PREFIX)
        out = []
        for n in (1, 2, 5):
            e.prefill(list(range(800, 800 + n)))
            out.append(logits_sha256(e.logits()))
            e.trim(len(PREFIX))
        return out


def test_one_token_calls_depend_on_the_thread_count_and_longer_calls_do_not():
    one, two = _calls(1), _calls(2)
    assert one[0] != two[0], "a one-token call gave the same bytes on 1 and 2 threads: the split rule is moot"
    assert one[1:] == two[1:]  # 2 and 5 tokens: the per-row path, any thread count
    assert _calls(1, flash_attn=False) == _calls(2, flash_attn=False)  # no split without flash attention
    with _engine(n_threads=1) as fa, _engine(n_threads=1, flash_attn=False) as plain:
        assert fa.one_token_calls_split and not plain.one_token_calls_split


def test_a_quantized_cache_s_one_token_calls_do_not_depend_on_the_thread_count():
    """The split path takes f16 / f32 K and V only (``kv_is_f32_or_f16``): with a q8_0 cache a one-token
    call gives the same bytes on 1 and 2 threads, and the engine says so (its blocks record nothing). On
    SmolLM2: the tiny model's heads are too small for q8_0 blocks. If llama.cpp ever splits these calls
    too, this fails and `Engine.one_token_calls_split` must learn it."""
    def one_token(threads: int) -> tuple[bool, str]:
        with Engine("smollm2", {**CFG, "n_threads": threads, "type_k": "q8_0", "type_v": "q8_0"}) as e, e.session():
            e.prefill(e.tokenize(long_text(500, seed=3))[:300])  # > 256 cells: a view of 512
            e.prefill([1000])
            return e.one_token_calls_split, logits_sha256(e.logits())

    one, two = one_token(1), one_token(2)
    assert one == two and one[0] is False


def test_a_pool_decodes_on_the_lone_engine_s_thread_count(monkeypatch):
    """On a 2-core host a pool of 2 prefills on 1 thread per engine and still decodes on 2, as a lone
    engine does: the same greedy tokens, the same logits at every step (with both sized, the pool
    engine's one-token calls ran on 1 thread and its logits differed from the first decoded token on)."""
    monkeypatch.setattr(engine_module, "usable_cores", lambda: 2)

    def decode(e: Engine) -> list[tuple[int, str]]:
        out = []
        with e.session():
            e.prefill(PREFIX)
            for _ in range(6):
                tok = int(e.logits().argmax())
                e.prefill([tok])
                out.append((tok, logits_sha256(e.logits())))
        return out

    with _engine() as lone:
        assert lone.n_threads == 2
        want = decode(lone)
    first = _engine()
    engines = pool_engines(first, 2)
    try:
        assert decode(engines[1]) == want
        assert [(e.n_threads, e.n_threads_batch) for e in engines] == [(2, 1), (2, 1)]
    finally:
        for e in engines[1:]:
            e.close()
        first.close()


def _text_with_tokens(e: Engine, one: bool) -> str:
    """A text of more than 300 tokens whose last prefill chunk (n_batch) is one token (``one``) or more
    than one: the chunk then lies at position >= 256, where the cache view reaches 512 cells."""
    words = long_text(900, seed=5).split()
    for n in range(150, len(words)):
        text = " ".join(words[:n])
        k = len(e.tokenize(text))
        if k > 300 and (k % CFG["n_batch"] == 1) == one and k % CFG["n_batch"] != 0:
            return text
    raise AssertionError("no prefix of the text has that many tokens")


def test_a_block_with_one_token_cells_records_its_threads_and_another_count_refuses_it(tmp_path):
    home = tmp_path / "store"
    two, one = _engine(n_threads=2), _engine(n_threads=1)
    try:
        ragged, even = _text_with_tokens(two, True), _text_with_tokens(two, False)
        with Memory(engine=two, home=home) as m2:
            marked = m2.learn(ragged, name="ends with a one-token chunk")
            plain = m2.learn(even, name="chunks of 2 tokens or more")
        n = len(two.tokenize(ragged))
        assert marked.metadata["one_token_calls"] == {"threads": 2, "from": n - 1}
        assert "one_token_calls" not in plain.metadata
        query = one.tokenize(QUERY, add_special=False)

        def fresh(text: str) -> str:  # this engine's own prefill of the text, then the query
            with one.session():
                one.prefill(one.tokenize(text))
                one.prefill(query)
                return logits_sha256(one.logits())

        with Memory(engine=one, home=home) as m1:
            # a prefill-only block grafts byte-exactly on another thread count
            assert m1.ask(plain.id, QUERY, max_tokens=1).receipt.first_logits_sha256 == fresh(even)
            with pytest.raises(IncompatibleBlock, match="one-token calls on 2 thread") as err:
                m1.ask(marked.id, QUERY, max_tokens=1)
            assert err.value.fields == {"n_threads": (2, 1)}
            # why: its state grafted here anyway is not this engine's computation of the same text
            state = m1.store.read_state(marked.id, one.buffer)[1]  # no fingerprint: unchecked
            with one.session():
                one.restore(state, marked.pos_end)
                one.prefill(query)
                forced = logits_sha256(one.logits())
            assert forced != fresh(ragged)
            # learned here it is another block (the thread count is in its id), which grafts exactly
            own = m1.learn(ragged, name="here")
            assert own.id != marked.id and own.metadata["one_token_calls"] == {"threads": 1, "from": n - 1}
            assert m1.ask(own.id, QUERY, max_tokens=1).receipt.first_logits_sha256 == fresh(ragged)
    finally:
        two.close()
        one.close()


def test_the_prompt_cache_finds_only_the_blocks_of_its_own_thread_count(tmp_path):
    """A learned prompt prefix whose last segment is one token (cells of a one-token call) is stored per
    thread count: another count's block is invisible to the lookup (it would be refused at its graft, and
    the request served cold, every time), and learning the same prefix here stores a block of its own."""
    from graftmem.server.prefix import PrefixCache
    from graftmem.store import Store

    store = Store(tmp_path / "home")
    two, one = _engine(n_threads=2), _engine(n_threads=1)
    try:
        segs = [PREFIX[:300], [1000]]  # the one-token segment lies at position 300 (a 512-cell view)

        def learn(e: Engine) -> tuple[PrefixCache, list]:
            states, calls = [], []
            with e.session():
                for seg in segs:
                    e.prefill(seg)
                    states.append(bytes(e.capture()))
                    calls.append(e.one_token_calls())
            cache = PrefixCache(store, e.fingerprint, min_tokens=1)
            leaf = cache.store_captured(e, segs, ["a", "b"], 0, states, None, calls=calls)
            return cache, [leaf]

        cache2, (leaf2,) = learn(two)
        assert leaf2.metadata["one_token_calls"] == {"threads": 2, "from": 300}
        prompt = segs + [[7]]
        assert cache2.lookup(prompt).block.id == leaf2.id
        here = PrefixCache(store, one.fingerprint, min_tokens=1)
        found = here.lookup(prompt)
        assert found is not None and found.n_segments == 1  # the root (prefill only) is shared; the leaf is not
        _, (leaf1,) = learn(one)
        assert leaf1.id != leaf2.id and leaf1.parent == leaf2.parent
        here.refresh(force=True)
        assert here.lookup(prompt).block.id == leaf1.id
    finally:
        two.close()
        one.close()
        store.close()


def test_a_served_prompt_s_learned_blocks_record_the_one_token_calls_in_their_cells(tmp_path):
    """The prompt cache's blocks learned from a served request's own cells (`run_job`, no second
    prefill) record the one-token calls those cells hold: with ``n_batch`` 2, a segment of odd length
    ends with one. Expected from the segments' lengths alone: every block ending after the first such
    call records it (``from`` = its position), every block ending before records nothing."""
    import openai

    from graftmem.server import api_server
    from graftmem.store import Store

    store = Store(tmp_path / "home")
    seen: list[tuple[list[list[int]], int, int]] = []  # (segments, first learned, states) per store step
    try:
        with _engine(n_threads=2, n_batch=2, n_ubatch=2) as e, \
                api_server(store, [e], min_prefix_tokens=4, sightings=1) as srv:
            real = srv.cache.store_captured

            def observed(engine, segments, texts, first, states, *a, **kw):
                seen.append(([list(s) for s in segments], first, len(states)))
                return real(engine, segments, texts, first, states, *a, **kw)

            srv.cache.store_captured = observed  # pass-through: what was learned, from which segments
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            msgs = [{"role": "system", "content": long_text(30, seed=3)}, {"role": "user", "content": "Hi there, my friend"},
                    {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "Thanks"}]
            c.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0)
            assert srv.pipeline.wait_idle()
        (segments, first, n_states), = seen
        assert first == 0 and n_states >= 2
        ends = [sum(map(len, segments[:i + 1])) for i in range(len(segments))]
        one_token_at = next(ends[i] - 1 for i, s in enumerate(segments) if len(s) % 2 == 1)
        want = [{"threads": 2, "from": one_token_at} if one_token_at < end else None for end in ends[:n_states]]
        assert any(want) and not all(want), (want, list(map(len, segments)))  # both kinds are learned here
        blocks = {b.metadata["segment"]: b for b in store.list(kind="auto")}
        assert [blocks[i].metadata.get("one_token_calls") for i in range(n_states)] == want
    finally:
        store.close()
