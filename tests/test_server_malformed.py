"""Every malformed field of the red-team list (issue 24) is a 4xx in the route's error shape, never a 500:
the HTTP routes run the SDK's own argument checks (`graftmem.memory.validate`) before any work.

All of it is plumbing (argument checks, the store's writes), which holds on any model: the engine is the tiny
random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`: real tokenizer and chat template), ~1/100th of
SmolLM2's prefill; its blocks are ~45x smaller, so the full-disk sweep below takes fewer steps."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

from graftmem import Memory
from graftmem.core.identity import block_id_for
from graftmem.server import api_server

SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def srv(tiny_llama, minilm, tmp_path_factory):
    home = tmp_path_factory.mktemp("malformed")
    with Memory(engine=tiny_llama, home=home / "store", embedder=minilm) as m:
        block = m.learn("Refunds: the refund code is 4417.", chat=True, name="refunds",
                        when_to_use="refund codes")
        with api_server(m.store, [tiny_llama], learn=False, router=lambda: m.router) as s:
            s.block = block  # type: ignore[attr-defined]
            yield s


def _post(srv, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: lone surrogates pass
    return httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=120)


CHAT = {"model": "m", "max_tokens": 1}
CASES = [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": f"hi {SURROGATE}"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "system", "content": SURROGATE},
                                                    {"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": [1]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}], "stream_options": "yes"}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}],
                              "graftmem": {"allow_unverified": "yes"}}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}),
    ("/v1/completions", {**CHAT, "prompt": f"hi {SURROGATE}"}),
    ("/v1/memory/learn", {"text": f"a {SURROGATE}"}),
    ("/v1/memory/learn", {"text": "a manual", "name": 5}),
    ("/v1/memory/learn", {"text": "a manual", "kind": ""}),
    ("/v1/memory/learn", {"text": "a manual", "chat": "yes"}),
    ("/v1/memory/learn", {"text": "a manual", "metadata": [1]}),
    ("/v1/memory/learn", {"name": "no text"}),
    ("/v1/memory/search", {"query": SURROGATE}),
    ("/v1/memory/search", {"query": "refund", "top_k": True}),
    ("/v1/memory/recall", {"task": f"refund {SURROGATE}"}),
    ("/v1/memory/recall", {"task": "refund", "min_score": float("nan")}),
    ("/v1/memory/recall", {"task": "refund", "min_score": "high"}),
    ("/v1/memory/recall", {"task": "refund", "max_tokens": 10 ** 9}),
    ("/v1/memory/ask", {"id": "ffff", "question": SURROGATE}),
    ("/v1/memory/ask", {"question": "what?"}),
    ("/v1/memory/ask", {"id": "ffff", "question": "what?", "raw": "no"}),
]


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, _) in enumerate(CASES)])
def test_malformed_field_is_a_400_in_the_routes_shape(srv, path, body):
    r = _post(srv, path, body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err, dict) and err["message"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/memory/learn",
                                  "/v1/memory/recall"])
def test_deeply_nested_json_is_a_400(srv, path):
    raw = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_a_leftover_temp_file_does_not_fail_the_next_learn(tiny_llama, tmp_path):
    """A write that failed once left its temp file; its name (pid, thread) comes back with the next
    writer on a reused thread, which failed with "File exists" (a 500 through the server)."""
    text = "A manual that is learned again after a failed write."
    with Memory(engine=tiny_llama, home=tmp_path / "store") as m:
        tokens = tiny_llama.tokenize(text)
        bid = block_id_for(m.fingerprint, tokens)
        path = m.store.path_of(bid)
        path.parent.mkdir(parents=True, exist_ok=True)
        left = path.parent / f".{bid}.{os.getpid()}.{threading.get_ident()}.tmp"
        left.write_bytes(b"half a block")
        block = m.learn(text)
        assert block.id == bid and m.get(bid).provenance == "local" and not left.exists()


def test_a_full_disk_at_the_scope_write_leaves_no_block(tiny_llama, tmp_path):
    """learn with a scope is all or nothing: the free space is swept across the block write and the scope
    index's writes; every attempt either stores the block with its scope or raises StoreError and leaves
    no block (it used to raise StoreError "cannot rollback" with the block stored, 2 of 25 levels)."""
    from graftmem import StoreError
    from graftmem.store.local import Store

    from .conftest import long_text
    from .test_trust_store import _fill, tmpfs

    text = long_text(12, seed=27)
    with Memory(engine=tiny_llama, home=tmp_path / "src") as src:
        size = src.learn(text).state_size + 8192
    mnt = tmp_path / "full"
    outcomes = {"stored": 0, "refused": 0}
    with tmpfs(mnt, "16m"):
        home = mnt / "home"
        Store(home).close()
        # what one learn with a scope takes at its peak here (the block, SQLite's journals of the index
        # and the scope index): the sweep goes from well below it to above it, so both outcomes occur
        free = lambda: os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize  # noqa: E731
        with Memory(engine=tiny_llama, home=home) as m:
            before = free()
            m.learn(text, user_id="u1")
            need = before - free()
            m.reset()
        for leave in range(max(0, min(size, need) - 4096), max(size, need) + 64 * 1024, 4096):
            filler = _fill(mnt, leave)
            try:
                with Memory(engine=tiny_llama, home=home) as m:
                    try:
                        b = m.learn(text, user_id="u1")
                    except StoreError:
                        outcomes["refused"] += 1
                    else:
                        outcomes["stored"] += 1
                        assert [x.id for x in m.get_all(user_id="u1")] == [b.id]
            finally:
                filler.unlink()
            with Memory(engine=tiny_llama, home=home) as m:
                owned = {x.id for x in m.get_all(user_id="u1")}
                assert {x.id for x in m.get_all()} == owned, f"a block stored without its scope at {leave}"
                m.reset()
    assert outcomes["stored"] and outcomes["refused"], outcomes


# --------------------------------------------------------------------------- ids, kwargs, bounds (issue 37)
BAD = {"surrogate": f"resp_{SURROGATE}", "long": "x" * 100_000, "number": 5, "list": ["x"]}
USER = {"type": "message", "role": "user", "content": "hi"}
#: (field, the request holding the bad value v, the status per kind of bad value); every other kind: 400
ID_FIELDS = [
    ("previous_response_id", lambda v: ("/v1/responses", {"input": "hi", "max_output_tokens": 1,
                                                         "previous_response_id": v}), {}),
    ("input[0].id", lambda v: ("/v1/responses", {"input": [{**USER, "id": v}], "max_output_tokens": 1}), {}),
    ("input[1].call_id", lambda v: ("/v1/responses", {"max_output_tokens": 1, "input": [
        USER, {"type": "function_call", "call_id": v, "name": "f", "arguments": "{}"}]}), {}),
    ("input[1].call_id", lambda v: ("/v1/responses", {"max_output_tokens": 1, "input": [
        USER, {"type": "function_call_output", "call_id": v, "output": "ok"}]}), {}),
    ("id", lambda v: ("/v1/memory/ask", {"id": v, "question": "q"}), {"long": 404}),
    ("parent", lambda v: ("/v1/memory/learn", {"text": "a manual", "parent": v}), {"long": 404}),
    # a scope id is any text (up to the 4 Mi characters of every text, `graftmem.memory.validate`)
    ("user_id", lambda v: ("/v1/memory/search", {"query": "q", "user_id": v}), {"long": 200}),
]


@pytest.mark.parametrize("field,build,status", ID_FIELDS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(ID_FIELDS)])
@pytest.mark.parametrize("kind", sorted(BAD))
def test_an_id_field_refuses_what_is_no_id(srv, field, build, status, kind):
    """Every id a Responses or memory request names, given a lone surrogate (``"resp_\\ud800"`` as
    ``previous_response_id`` was a 500: the 404 quoting it could not be encoded; as an input item's id or
    call id too, when the stored response was written), 100,000 characters, a number or a list: a 400
    naming the field, or the 404 of an unknown id; never a 500."""
    path, body = build(BAD[kind])
    r = _post(srv, path, body)
    want = status.get(kind, 400)
    assert r.status_code == want, (r.status_code, r.text[:300])
    if want == 400 and path == "/v1/responses" or kind == "surrogate":
        assert r.json()["error"]["param"] == field, r.text[:300]


def test_an_id_in_the_path_or_query_refuses_what_is_no_id(srv):
    """Ids in the paths and queries of the Responses and block routes (a URL cannot carry a lone
    surrogate: its escapes decode to U+FFFD): too long is a 400 naming it, else the 404 of an unknown id."""
    rid = _post(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 1}).json()["id"]
    long = "r" * 1000
    for method, path, status, param in [
            ("GET", f"/v1/responses/{long}", 400, "response_id"),
            ("DELETE", f"/v1/responses/{long}", 400, "response_id"),
            ("GET", f"/v1/responses/{long}/input_items", 400, "response_id"),
            ("GET", f"/v1/responses/{rid}/input_items?after={long}", 400, "after"),
            ("GET", "/v1/responses/resp_%ED%A0%80", 404, None),
            ("GET", f"/v1/responses/{rid}/input_items?after=%ED%A0%80", 200, None),
            ("GET", f"/v1/memory/blocks/{long}", 404, None), ("DELETE", f"/v1/memory/blocks/{long}", 404, None),
            ("GET", f"/v1/blocks/{long}", 404, None), ("GET", f"/v1/blocks/{long}/manifest", 404, None)]:
        r = httpx.request(method, srv.url + path, timeout=60)
        assert r.status_code == status, (method, path[:60], r.status_code, r.text[:300])
        if param is not None:
            assert r.json()["error"]["param"] == param


CHAT_HI = {**CHAT, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("kwargs,param", [
    ({"messages": [{"role": "user", "content": "other"}]}, "chat_template_kwargs.messages"),
    ({"tools": []}, "chat_template_kwargs.tools"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"bos_token": "<|eot_id|>"}, "chat_template_kwargs.bos_token"),
    ({"raise_exception": 1}, "chat_template_kwargs.raise_exception"),
    ({"a-b": 1}, "chat_template_kwargs.a-b"),
    ({"x": float("nan")}, "chat_template_kwargs.x"),
    ({f"k{i}": 1 for i in range(33)}, "chat_template_kwargs"),
    ({"x": "y" * (65 << 10)}, "chat_template_kwargs"),
    ([1], "chat_template_kwargs")])
def test_chat_template_kwargs_are_checked(srv, kwargs, param):
    """A ``chat_template_kwargs`` key that the render sets itself replaced the conversation (``messages``)
    or collided with the render's arguments (``tools``, ``add_generation_prompt``: a 500); keys, count,
    size and values are bounded: a 400 naming ``chat_template_kwargs.<key>``."""
    r = _post(srv, "/v1/chat/completions", {**CHAT_HI, "chat_template_kwargs": kwargs})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, (r.status_code, r.text[:300])


def test_chat_template_kwargs_a_template_reads_still_work(srv):
    r = _post(srv, "/v1/chat/completions", {**CHAT_HI, "chat_template_kwargs": {"enable_thinking": False,
                                                                                   "tools_in_user_message": False}})
    assert r.status_code == 200, r.text[:300]


def _rendered(monkeypatch) -> list[str]:
    """What reached the renderers of the chat door (recorded, then rendered as usual)."""
    from graftmem.server import pipeline as oa_mod

    seen: list[str] = []
    for name in ("template_segments", "render_segments"):
        real = getattr(oa_mod, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(oa_mod, name, spy)
    return seen


def test_too_many_messages_are_refused_before_any_render(srv, monkeypatch):
    """100,000 messages saying "hi" at every chat door: a 400 naming ``messages`` (``input``) and the limit,
    before anything renders them (each prefix of a conversation is rendered to find its cuts: 4,000 such
    messages took 34 s to reach the context's 400 on the 2-core test machine, 100,000 no answer in 600 s)."""
    seen = _rendered(monkeypatch)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(100_000)]
    for path, body, param in [
            ("/v1/chat/completions", {**CHAT, "messages": many}, "messages"),
            ("/v1/responses", {"input": many, "max_output_tokens": 1}, "input"),
            ("/v1/messages", {"max_tokens": 1, "messages": many}, "messages"),
            ("/v1/messages/count_tokens", {"messages": many}, "messages")]:
        r = _post(srv, path, body)
        assert r.status_code == 400 and "100000 messages" in r.text and "4096" in r.text, (path, r.text[:300])
        if path.startswith("/v1/messages"):
            assert r.json()["error"]["type"] == "invalid_request_error"
        else:
            assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "too_many_messages"
    assert seen == []
    assert _post(srv, "/v1/chat/completions", CHAT_HI).status_code == 200 and seen == ["template_segments"]


def test_message_limits_are_settings_and_bound_parts_and_tools(tiny_llama, tmp_path, monkeypatch):
    """`Limits.max_messages` and `Limits.max_message_parts` are the server's settings (a request at the
    limit is served, one past it refused first); the engine's ``n_ctx`` lowers ``max_messages``; a message's
    content parts, Anthropic blocks and tool calls, and a request's tools, are bounded at every door."""
    from graftmem.server.http import Limits

    seen = _rendered(monkeypatch)
    msgs = lambda n: [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(n)]  # noqa: E731
    parts = [{"type": "text", "text": "hi"}] * 4
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    with Memory(engine=tiny_llama, home=tmp_path / "store") as m, \
            api_server(m.store, [tiny_llama], learn=False, limits=Limits(max_messages=5, max_message_parts=3)) as s:
        assert _post(s, "/v1/chat/completions", {**CHAT, "messages": msgs(5)}).status_code == 200
        for path, body, param in [
                ("/v1/chat/completions", {**CHAT, "messages": msgs(6)}, "messages"),
                ("/v1/responses", {"input": msgs(6), "max_output_tokens": 1}, "input"),
                ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": parts}]},
                 "messages[0].content"),
                ("/v1/responses", {"max_output_tokens": 1, "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "hi"}] * 4}]}, "input[0].content"),
                ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}, {
                    "role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{}"}}] * 4}]},
                 "messages[1].tool_calls"),
                ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": parts}]}, None),
                ("/v1/chat/completions", {**CHAT_HI, "tools": tools}, "tools"),
                ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]},
                 "tools"),
                ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"name": f"f{i}", "input_schema": {}} for i in range(129)]}, None)]:
            r = _post(s, path, body)
            assert r.status_code == 400, (path, r.status_code, r.text[:300])
            if param is not None:
                assert r.json()["error"]["param"] == param, (path, r.text[:300])
        assert seen == ["template_segments"]  # only the request that was served
    with Memory(engine=tiny_llama, home=tmp_path / "store2") as m, \
            api_server(m.store, [tiny_llama], learn=False, limits=Limits(max_messages=10 ** 6)) as s:
        r = _post(s, "/v1/chat/completions", {**CHAT, "messages": msgs(tiny_llama.n_ctx + 1)})
        assert r.status_code == 400 and f"context is {tiny_llama.n_ctx} tokens" in r.text, r.text[:300]


def test_deeply_nested_tool_call_arguments_of_an_earlier_turn_are_text(srv):
    """A client's earlier assistant message whose call ``arguments`` is a JSON string nesting 3,000 lists
    (a RecursionError, a 500, when the prompt was rendered): rendered as the string it is, at the chat and
    Responses doors."""
    deep = "[" * 3000 + "]" * 3000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    r = _post(srv, "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})
    assert r.status_code == 200, r.text[:300]
    r = _post(srv, "/v1/responses", {"max_output_tokens": 1, "store": False, "input": [
        USER, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
    assert r.status_code == 200, r.text[:300]
