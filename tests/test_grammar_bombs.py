"""No request can crash or freeze the server through a grammar or a chat template (issue 37).

A ~200-byte JSON schema (``maxLength: 30000``) once killed `graftmem serve` (SIGSEGV: llama.cpp's GBNF
parser recursed once per nested group the converter wrote), through every door that builds a grammar;
a chat template that loops on a trigger word held the event loop. Here each bomb goes through every
door of a real server process and must come back a 4xx naming the field while the process lives; a
looping template is stopped within its budget, with ``/health`` answering while it runs. Every loop
here is bounded; everything is on 127.0.0.1 and on ports these tests opened."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.hostile import bomb_requests
from graftmem.core.errors import ConfigError
from graftmem.core.grammar_limits import DEFAULT_GRAMMAR_LIMITS, check_gbnf, check_schema
from graftmem.memory import validate as check

from .served import serve_process

ROOT = Path(__file__).resolve().parents[1]

#: (name, schema, the keyword the refusal must name)
BOMBS = [
    ("maxLength", {"type": "string", "maxLength": 30000}, "maxLength"),
    ("minLength", {"type": "string", "minLength": 100000}, "minLength"),
    ("maxItems", {"type": "array", "items": {"type": "string"}, "maxItems": 100000}, "maxItems"),
    ("nested-maxLength", {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "object", "properties": {"b": {"type": "string", "maxLength": 50000}}}}}},
     "properties.a.items.properties.b.maxLength"),
    ("pattern", {"type": "string", "pattern": "^(a|b){0,100000}$"}, "pattern"),
    ("nested-pattern", {"type": "string", "pattern": "^((a{0,400}){0,400}){0,400}$"}, "pattern"),
    ("enum", {"enum": [f"value-{i}" for i in range(100_000)]}, "enum"),
    ("many-lengths", {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 500}
                                                       for i in range(100)}}, "maxLength"),
    ("float-bound", {"type": "string", "maxLength": 1e9}, "maxLength"),
    # found by the held-out red team (bench/redteam.py): each passed the checker before
    # nullable units repeated and nested: 125 items, 28 s per decode step (one uncancellable C call)
    ("nullable-nest", {"type": "string", "pattern": "^(((a?){5}){5}){5}$"}, "pattern"),
    # a quantifier on a quantifier was counted 0: 8,000 ways per character
    ("stacked-quantifiers", {"type": "string", "pattern": "^a?{20}{20}{20}$"}, "pattern"),
    ("stacked-counts", {"type": "string", "pattern": "^(ab){0,500}{0,500}$"}, "pattern"),
    # quantifiers the converter reads (int() takes spaces and _) but the checker's regex did not:
    # 1.26 GB while converting a 30-byte pattern
    ("spaced-quantifier", {"type": "string", "pattern": "^a{ 10000000 }$"}, "pattern"),
    ("underscore-quantifier", {"type": "string", "pattern": "^a{1_000_000}$"}, "pattern"),
    # a $ref into a key that is no schema keyword: the converter follows it, the walk did not
    ("ref-to-unwalked-length", {"type": "object", "properties": {"x": {"$ref": "#/x-hidden"}},
                                "x-hidden": {"type": "string", "minLength": 10_000_000}}, "minLength"),
    ("ref-to-unwalked-enum", {"type": "object", "properties": {"x": {"$ref": "#/x/y"}},
                              "x": {"y": {"enum": [f"v{i}" for i in range(60_000)]}}}, "enum"),
    # optional properties cost the converter quadratic time with the GIL held: 900 took 3.2 s, /health
    # answered past 1 s while it ran (red team); 5,000 a RecursionError
    ("optional-properties", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(900)}},
     "properties"),
]


@pytest.mark.parametrize("name,schema,keyword", BOMBS, ids=[b[0] for b in BOMBS])
def test_a_bomb_schema_is_refused_before_conversion_naming_its_keyword(name, schema, keyword):
    with pytest.raises(ConfigError) as info:
        check.response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    param = getattr(info.value, "param", "")
    assert param.startswith("response_format.json_schema.schema"), param
    assert keyword in str(info.value) or keyword.split(".")[-1] in param, (param, str(info.value))


def test_real_schemas_still_become_grammars():
    """What agents send (pydantic-ai / instructor models: bounded strings, lists, enums, refs, recursion)."""
    person = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 200},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 20},
        "role": {"enum": ["admin", "user", "guest"]},
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["name", "age"],
        "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    grammar = check.response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": person}})
    assert grammar and "root ::=" in grammar
    check_gbnf(grammar)  # and under the grammar limits too
    # an enum at the limit, and 250 long values, still pass
    check_schema({"enum": [f"v{i}" for i in range(DEFAULT_GRAMMAR_LIMITS.max_enum_values)]})
    check_schema({"enum": ["x" * 50 for _ in range(250)]})
    # patterns with nested and optional repetitions that are not ambiguous stay accepted
    for pattern in ("^((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)$",
                    "^([a-z0-9]+\\.)*[a-z0-9]+@[a-z]+\\.[a-z]{2,6}$", "^(\\+[0-9]{1,3})?[0-9]{4,10}$",
                    "^((a|aa){5}){5}$", "^((a+){5}){5}$", "^a{0,5}?b$", "^[a-z]{ 2 , 8 }$"):
        check_schema({"type": "string", "pattern": pattern})
    # a $ref named twice (and a recursive one) is walked once: its enum counts once
    check_schema({"$defs": {"e": {"enum": list(range(600))}, "n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                  "type": "object", "properties": {"a": {"$ref": "#/$defs/e"}, "b": {"$ref": "#/$defs/e"},
                                                    "c": {"$ref": "#/$defs/n"}}})
    # many properties pass when they are required (linear for the converter), and optional ones up to the limit
    wide = {f"p{i}": {"type": "integer"} for i in range(900)}
    check_schema({"type": "object", "properties": wide, "required": list(wide)})
    check_schema({"type": "object", "properties": dict(list(wide.items())[:DEFAULT_GRAMMAR_LIMITS.max_optional_properties])})


def test_a_deeply_nested_grammar_is_refused_before_llama_cpp_parses_it():
    """The last guard, for any grammar from any door or the SDK: in a child process, since without it
    llama.cpp's parser overflows the stack (a crash, not an exception) at 30,000 levels."""
    code = ("from graftmem.core.engine import Engine, Grammar\n"
            "from graftmem.core.errors import ConfigError\n"
            "e = Engine('smollm2')\n"
            "try:\n"
            "    Grammar(e, 'root ::= ' + '(\"a\" ' * 30000 + ')?' * 30000)\n"
            "except ConfigError as exc:\n"
            "    print('REFUSED', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, (out.returncode, out.stderr[-500:])
    assert "REFUSED" in out.stdout and "nests groups 30000 deep" in out.stdout, out.stdout


# ---------------------------------------------------------------------------------------- a real server

@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """``graftmem serve`` (SmolLM2) in its own process: a crash there is seen as a dead process."""
    with serve_process("--no-warm", "--no-learn", home=tmp_path_factory.mktemp("bombs")) as (proc, url):
        yield proc, url


@pytest.mark.parametrize("name,schema,keyword", [b for b in BOMBS if b[0] in
                                                 ("maxLength", "maxItems", "pattern", "enum", "nested-pattern",
                                                  "stacked-quantifiers")],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_door_answers_a_grammar_bomb_with_a_4xx_and_the_server_lives(server_process, name, schema, keyword):
    proc, url = server_process
    with httpx.Client(base_url=url, timeout=120) as client:
        for path, body in bomb_requests(schema):  # the five doors that build a grammar
            r = client.post(path, json=body)
            assert proc.poll() is None, f"the server died on {name} through {path}"
            assert r.status_code == 400, (path, r.status_code, r.text[:300])
            assert keyword.split(".")[-1] in r.text and "limit" in r.text, (path, r.text[:300])
        assert client.get("/health").status_code == 200
        # and it still answers an honest request with a schema
        ok = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 8, "temperature": 0,
                         "messages": [{"role": "user", "content": "Hi"}], "response_format": {
                             "type": "json_schema", "json_schema": {"name": "x", "schema": {
                                 "type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}}}}})
        assert ok.status_code == 200, ok.text[:300]


# ---------------------------------------------------------------------------------------- templates

#: A template that renders like a plain chat, except that a user's trigger word makes it loop ~10^10 times.
LOOPING = ("{% for m in messages %}{% if 'TRIGGER' in m['content'] %}"
           "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{% endif %}"
           "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_template_that_loops_is_stopped_and_health_answers_meanwhile(smol, tmp_path):
    """The render runs in a worker process (`graftmem.core.renderpool`), killed at the budget; the event
    loop answers meanwhile. Fails with the render on the event loop (the request never answers) and
    with it in a thread of the server (`renders` None: no process to see, and none killed)."""
    from graftmem.server import api_server
    from graftmem.server.config import ServeConfig
    from graftmem.server.http import Limits
    from graftmem.store.local import Store

    tpl = tmp_path / "loop.jinja"
    tpl.write_text(LOOPING)
    config = ServeConfig(api=True, learn=False, warm=False, chat_template=str(tpl),
                         limits=Limits(render_timeout=3.0))
    with api_server(Store(tmp_path / "home"), [smol], config) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            got: dict = {}

            def ask() -> None:
                got["r"] = client.post("/v1/chat/completions", json={
                    "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "say TRIGGER"}]})

            t = threading.Thread(target=ask)
            t.start()
            renders = srv.pipeline.renders
            deadline = time.monotonic() + 30
            while not renders.busy() and time.monotonic() < deadline and t.is_alive():
                time.sleep(0.01)
            busy = renders.busy()
            assert busy, "the looping render never started"
            # the render is running right now: the event loop still answers
            assert httpx.get(srv.url + "/health", timeout=2).status_code == 200
            t.join(60)
            assert not t.is_alive()
            r = got["r"]
            assert r.status_code == 400, r.text[:300]
            assert r.json()["error"]["code"] == "render_timeout", r.text[:300]
            assert renders.killed == 1 and not renders.busy()
            with pytest.raises(ProcessLookupError):  # killed and reaped: nothing left spinning
                os.kill(busy[0], 0)
            ok = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": [
                {"role": "user", "content": "Hello"}]})
            assert ok.status_code == 200, ok.text[:300]


@pytest.mark.parametrize("expr", ['"x" * 1000000000', "2 ** 100000000", '"%0999999999d" % 1',
                                  '"a"|center(1000000000)', '"a".ljust(1000000000)'])
def test_a_template_cannot_allocate_gigabytes_in_one_call(expr):
    """One C call is not interrupted by the time budget: the sandbox refuses the size before it starts."""
    from graftmem.core.template import ChatTemplate, TemplateError

    with pytest.raises(TemplateError):
        ChatTemplate("{{ " + expr + " }}").render([{"role": "user", "content": "hi"}])
    assert ChatTemplate('{{ "ab" * 3 }}{{ 2 ** 10 }}{{ "%05d" % 3 }}{{ "a"|center(5) }}').render([]) == \
        "ababab102400003  a  "


def test_the_budget_interrupts_python_work_but_not_a_shielded_block():
    """`within` stops a loop that calls nothing (what a looping template is); a `shielded` block (the
    render pool killing its process) runs to its end and the interrupt due meanwhile is raised there."""
    from graftmem.core.budget import Overrun, deadline, shielded, within

    def spin() -> None:
        while True:
            pass

    with pytest.raises(Overrun):
        within(0.2, spin)
    done = []

    def guarded() -> None:
        with shielded():
            end = time.monotonic() + 0.6  # past the 0.2 s budget
            while time.monotonic() < end:
                pass
            done.append(deadline() is not None)
        done.append("after")  # never reached: the interrupt is raised where the block ends

    with pytest.raises(Overrun):
        within(0.2, guarded)
    assert done == [True]
    assert within(5, lambda: 42) == 42 and deadline() is None
