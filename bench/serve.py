"""Time to first token through an OpenAI-compatible API for a realistic agent, graftmem next to its peers,
all in one run, with the same client (the official ``openai`` package, streaming).

The agent: a ~3,000-token system prompt (a support manual plus four tool descriptions, written in the
system text so every server gets the same messages) and a scripted 5-turn conversation (tool calls and
tool results as text), so that every server sees the same token ids turn after turn. Each turn asks
for 8 greedy tokens; TTFT is the time from sending the request to the first non-empty content delta.

The servers, each a separate process started by the bench, with the same GGUF, n_ctx, n_batch,
n_ubatch, threads and flash attention:

- ``graftmem``: ``python -m graftmem serve`` (default prefix-cache policy: prefixes of >= 256 tokens seen
  twice are learned as verified blocks). ``cold``: a new, empty home; ``restart``: a new server process on
  the same home (the blocks persist; the model is reloaded).
- ``llama-server``: llama.cpp's server built from the same vendored llama.cpp (bench/peer.py), one slot,
  ``cache_prompt`` on, its in-RAM prompt cache at its default. ``cold``: a new process (after a restart
  it is cold again, it keeps nothing on disk); ``warm``: the same process, a second session (the slot
  and the RAM cache hold the prefix).
- ``llama-cpp-python``: ``python -m llama_cpp.server`` with ``--cache true --cache_type disk`` (its only
  cache that survives a restart; unverified). ``cold``: a new process and an empty cache directory;
  ``restart``: a new process on the same cache directory.

- ``graftmem-responses``: the same user turns as an agent of the Responses API: each turn sends only its
  user message with ``previous_response_id`` (the server grafts the stored chain, or finds it in RAM):
  5 turns, a restart, 5 more turns continuing the stored conversation; next to the same conversation
  over Chat Completions (the model's own answers re-sent as history each turn), on a fresh home, and,
  with ``llama-server`` in ``--only``, over Chat Completions on llama-server (a restart is a new process:
  it keeps nothing). Each agent has its own server; their turns are interleaved (turn i of each before
  turn i + 1 of any), so the agents compared meet the same load of a shared machine turn by turn.

- the model: ``--model`` (default ``smollm2``) is a short name, a GGUF path, or ``tiny:<family>``, a
  tiny random-weight model of a real family (scripts/tiny_models.py: a real tokenizer and chat
  template, e.g. ``tiny:qwen3``, ChatML with ``<think>``, whose template drops earlier reasoning when a
  new user turn arrives); graftmem serve and llama-server load the same file. ``--chat-template-kwargs``
  (JSON, e.g. ``'{"enable_thinking": false}'``) goes with every Chat Completions request of both servers:
  Qwen 3's template then opens each answer with an empty ``<think></think>`` block that a re-rendered
  history drops, the re-render a Responses agent never does.

The order of the servers rotates per rep (the machine is shared and noisy); the JSON keeps every
number, the table shows medians and [min, max]. Afterwards, ``graftmem search --url`` through a running
server: p50 of the HTTP request alone and of the whole CLI process.

    python -m bench.serve [--reps 3] [--restarts 1] [--words 2000] [--cli-reps 10] [--model tiny:qwen3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import httpx
import openai

from bench import peer as cpp_peer  # builds / finds llama-server
from bench import harness
from bench.harness import RESULTS, ROOT, write_results
from graftmem.core import EngineConfig, resolve_model, usable_cores
from graftmem.core import environ_without_ours

HERE = Path(__file__).resolve().parent

MAX_TOKENS = 8
TOOLS = [
    ("lookup_order", "Fetch an order by its id: items, dates, payment, shipping state.",
     {"order_id": "string"}),
    ("search_manual", "Search this manual for the section about a topic.", {"topic": "string"}),
    ("issue_refund", "Refund an order, fully or partly, to the original payment method.",
     {"order_id": "string", "amount": "number", "reason": "string"}),
    ("escalate", "Hand the conversation to a human manager with a short note.", {"note": "string"}),
]
USER_TURNS = [
    "Hi, I want a refund for order 48213, the kettle arrived broken.",
    "[tool result] order 48213: 1 kettle, 39.90 EUR, paid by card, delivered 3 days ago.",
    "Yes, I have a photo of the damage and the receipt.",
    "[tool result] refund 39.90 EUR to card ending 4411: accepted.",
    "Thanks! Can I also get a replacement sent?",
]
ASSISTANT_TURNS = [
    '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "48213"}}\n</tool_call>',
    "I found your order. Do you have a photo of the damage and your receipt?",
    '<tool_call>\n{"name": "issue_refund", "arguments": {"order_id": "48213", "amount": 39.9, '
    '"reason": "damaged on arrival"}}\n</tool_call>',
    "Your refund of 39.90 EUR is on its way to your card.",
]


def system_prompt(n_words: int) -> str:
    import random

    rng = random.Random(7)
    vocab = ("refund order ticket customer shipping label parcel warehouse policy receipt invoice step check "
             "before after always never escalate manager note account code date window photo damage").split()
    sections = []
    for i in range(0, n_words, 100):
        sections.append(f"## Section {i // 100 + 1}\n" + " ".join(rng.choice(vocab) for _ in range(100)))
    tools = "\n".join(json.dumps({"type": "function", "function": {
        "name": n, "description": d, "parameters": {"type": "object", "properties": {
            k: {"type": v} for k, v in p.items()}, "required": list(p)}}}, sort_keys=True) for n, d, p in TOOLS)
    return ("You are the support agent of an online shop. Follow the manual below.\n\n" + "\n\n".join(sections)
            + "\n\n# Tools\n\nYou may call one or more functions. Function signatures within <tools></tools>:\n"
            f"<tools>\n{tools}\n</tools>\nFor each call, return a json object with the function name and "
            "arguments within <tool_call></tool_call> XML tags.")


def turns(system: str) -> list[list[dict[str, str]]]:
    """The messages of each of the 5 requests of a session."""
    out, msgs = [], [{"role": "system", "content": system}]
    for i, u in enumerate(USER_TURNS):
        msgs = msgs + [{"role": "user", "content": u}]
        out.append(msgs)
        if i < len(ASSISTANT_TURNS):
            msgs = msgs + [{"role": "assistant", "content": ASSISTANT_TURNS[i]}]
    return out


# --------------------------------------------------------------------------- the model
def bench_model(arg: str) -> tuple[str, Path, str]:
    """``(name, gguf_path, note)`` of ``--model``: a short name or a GGUF path (`resolve_model`), or
    ``tiny:<family>``, the tiny random-weight model of a real family built by scripts/tiny_models.py
    (cached outside the repository; a rerun finds it), so a result names a model anyone can rebuild
    rather than a path in someone's cache."""
    if arg.startswith("tiny:"):
        import importlib.util

        family = arg.split(":", 1)[1]
        spec = importlib.util.spec_from_file_location("graftmem_tiny_models", ROOT / "scripts" / "tiny_models.py")
        assert spec is not None and spec.loader is not None
        tiny = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = tiny  # its dataclasses look their module up there (tests/tiny.py does the same)
        spec.loader.exec_module(tiny)
        if family not in tiny.FAMILIES:
            raise SystemExit(f"--model {arg}: unknown tiny family {family!r} (one of {', '.join(tiny.FAMILIES)})")
        return arg, Path(tiny.build(family)), f"tiny random-weight {tiny.FAMILIES[family].note}"
    name, path = resolve_model(arg)
    note = "SmolLM2-135M-Instruct Q4_1" if name == "smollm2" else ""
    return name, path, note


# --------------------------------------------------------------------------- servers
class Proc:
    """A server subprocess (log to a file), ready when ``ready_path`` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str, log: Path, *,
                 cwd: Optional[Path] = None, env: Optional[dict] = None, startup_s: float = 300.0) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self._log = open(log, "wb")
        self.log = log
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        cpp_peer.wait_ready(self.proc, lambda: httpx.get(self.url + ready_path, timeout=2).status_code == 200,
                            name, log, startup_s, self.close)
        self.startup_s = time.perf_counter() - t0

    def close(self) -> None:
        cpp_peer.stop(self.proc, 20)
        self._log.close()


@contextlib.contextmanager
def started(factory: Callable[[], Proc]) -> Iterator[Proc]:
    p = factory()
    try:
        yield p
    finally:
        p.close()


#: extra ``graftmem serve`` flags for the whole run (``--serve-args "--sightings 1"``)
SERVE_ARGS: list[str] = []


def python_env(work: Path, **extra: str) -> dict[str, str]:
    """The environment of a Python process the bench starts, run as an installed package runs:
    byte-compiled once into a cache outside the repo, not compiled again on every start as
    PYTHONDONTWRITEBYTECODE (set on some machines) would make it: a server's first request would
    otherwise compile the modules it imports lazily, inside the measured time to first token."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PYTHONPYCACHEPREFIX": str(work / "pycache"),
                **extra})
    return env


#: the GGUF every server of the run loads (``--model``)
MODEL: list[Path] = []


def graftmem_server(home: Path, work: Path, root: Path = ROOT) -> Proc:
    """``graftmem serve`` from the sources under ``root`` (``--baseline``: another checkout, e.g. the
    commit before a change, measured in the same run), on the run's model."""
    port = cpp_peer.free_port()
    env = python_env(work)
    env["PYTHONPATH"] = str(root)
    env["PYTHONPYCACHEPREFIX"] = str(work / ("pycache" if root == ROOT else "pycache-baseline"))
    model = ["--model", str(MODEL[0])] if MODEL else []
    return Proc("graftmem", [sys.executable, "-m", "graftmem", "serve", "--home", str(home), "--port", str(port),
                             *model, *SERVE_ARGS],
                port, "/v1/models", work / f"graftmem-{time.time_ns()}.log", cwd=root, env=env)


def llama_server(exe: Path, model: Path, cfg: EngineConfig, threads: int, work: Path, parallel: int = 1) -> Proc:
    """llama-server with ``parallel`` slots (``-np``) and continuous batching; each slot gets the
    engine's n_ctx (the context is ``n_ctx x parallel``, split between the slots)."""
    port = cpp_peer.free_port()
    cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(cfg.n_ctx * parallel),
           "-b", str(cfg.n_batch), "-ub", str(cfg.n_ubatch), "-fa", "on" if cfg.flash_attn else "off",
           "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-cb", "-ctk", cfg.type_k,
           "-ctv", cfg.type_v, "--no-warmup", *cpp_peer.weight_buffer_args(cfg.extra_bufts == "on")]
    # with libgomp's default wait, as its users run it, not the one graftmem set in this process
    return Proc("llama-server", cmd, port, "/health", work / f"llama-server-{time.time_ns()}.log",
                env=environ_without_ours())


def lcp_server(model: Path, cfg: EngineConfig, threads: int, cache_cwd: Path, work: Path) -> Proc:
    port = cpp_peer.free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--n_ctx", str(cfg.n_ctx), "--n_batch", str(cfg.n_batch), "--n_ubatch", str(cfg.n_ubatch),
           "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--flash_attn", str(cfg.flash_attn).lower(), "--cache", "true", "--cache_type", "disk",
           "--cache_size", str(2 << 30), "--verbose", "false"]
    return Proc("llama-cpp-python", cmd, port, "/v1/models", work / f"lcp-{time.time_ns()}.log", cwd=cache_cwd,
                env=python_env(work))


# --------------------------------------------------------------------------- client
def ttft(client: openai.OpenAI, messages: list, extra: dict) -> dict[str, Any]:
    """One streamed Chat Completions request: TTFT to the first non-empty content (or reasoning) delta.

    The cache counts come from graftmem's receipt, or from llama-server's ``timings`` in its last chunk
    (``cache_n``: tokens reused from the slot; ``prompt_n``: tokens evaluated), so both servers' turns
    say how much of the prompt they prefilled again."""
    t0 = time.perf_counter()
    first, parts, receipt, timings = None, [], None, None
    for ch in client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body=extra):
        delta = ch.choices[0].delta if ch.choices else None
        # a reasoning template's answer may stream as reasoning_content first: it is the first token too
        thought = (delta.model_extra or {}).get("reasoning_content") if delta is not None else None
        if delta is not None and (delta.content or thought) and first is None:
            first = time.perf_counter() - t0
        if delta is not None and delta.content:
            parts.append(delta.content)
        receipt = (ch.model_extra or {}).get("graftmem") or receipt
        timings = (ch.model_extra or {}).get("timings") or timings
    end = time.perf_counter() - t0
    out = {"ttft_ms": round((first if first is not None else end) * 1e3, 2), "total_ms": round(end * 1e3, 2),
           "text": "".join(parts), "cached_tokens": None, "restore_ms": None, "prefill_ms": None,
           "tokens_prefilled": None}
    if receipt:
        out.update(cached_tokens=receipt.get("tokens_restored"), restore_ms=receipt.get("restore_ms"),
                   prefill_ms=receipt.get("prefill_ms"), tokens_prefilled=receipt.get("tokens_prefilled"))
    elif timings:
        out.update(cached_tokens=timings.get("cache_n"), tokens_prefilled=timings.get("prompt_n"),
                   prefill_ms=timings.get("prompt_ms"))
    return out


def session(url: str, requests: list[list[dict]], extra: dict) -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    return [ttft(client, msgs, extra) for msgs in requests]


# --------------------------------------------------------------------------- a Responses agent
def responses_turn(client: openai.OpenAI, system: str, user: str, prev: Optional[str]) -> dict[str, Any]:
    """One turn of the Responses agent: only the new user message, ``previous_response_id`` naming the
    last answer (the server grafts its stored chain); TTFT to the first ``output_text`` delta."""
    t0 = time.perf_counter()
    first, parts, final = None, [], None
    kw: dict[str, Any] = {"previous_response_id": prev} if prev else {}
    for ev in client.responses.create(model="m", instructions=system, input=user, max_output_tokens=MAX_TOKENS,
                                      temperature=0, stream=True, **kw):
        if ev.type == "response.output_text.delta" and ev.delta and first is None:
            first = time.perf_counter() - t0
        if ev.type == "response.output_text.delta":
            parts.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    end = time.perf_counter() - t0
    rc = (final.model_extra or {}).get("graftmem") or {} if final is not None else {}
    return {"ttft_ms": round((first if first is not None else end) * 1e3, 2), "total_ms": round(end * 1e3, 2),
            "text": "".join(parts), "cached_tokens": rc.get("tokens_restored"), "restore_ms": rc.get("restore_ms"),
            "prefill_ms": rc.get("prefill_ms"), "tokens_prefilled": rc.get("tokens_prefilled"),
            "source": rc.get("source"), "id": final.id if final is not None else None}


class ResponsesAgent:
    """The user turns as a Responses conversation: each turn sends its user message and
    ``previous_response_id`` (``prev``: the last answer's id; None: a new conversation)."""

    def __init__(self, system: str, prev: Optional[str] = None) -> None:
        self.system, self.prev = system, prev

    def turn(self, url: str, user: str) -> dict[str, Any]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        out = responses_turn(client, self.system, user, self.prev)
        self.prev = out["id"]
        return out


class ChatAgent:
    """The same user turns over Chat Completions, re-sending the history with the model's own answers
    each turn (their content, as clients send it back), as a client without stored responses must
    (``extra``: the request's extra body, e.g. ``chat_template_kwargs``)."""

    def __init__(self, system: str, extra: Optional[dict] = None) -> None:
        self.history: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.extra = dict(extra or {})

    def turn(self, url: str, user: str) -> dict[str, Any]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        self.history.append({"role": "user", "content": user})
        out = ttft(client, list(self.history), dict(self.extra))
        self.history.append({"role": "assistant", "content": out["text"]})
        return out


def interleaved(agents: dict[str, tuple[Any, str]]) -> dict[str, list[dict[str, Any]]]:
    """The 5 user turns of every agent (``name: (agent, server url)``), turn by turn: turn i of each agent
    before turn i + 1 of any, the agent that goes first rotating per turn, so that each turn of the
    agents compared is measured under the same load of this shared machine (a whole session of one agent
    after another's measured the load drift as much as the agents)."""
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in agents}
    names = list(agents)
    for i, u in enumerate(USER_TURNS):
        for name in names[i % len(names):] + names[:i % len(names)]:
            agent, url = agents[name]
            out[name].append(agent.turn(url, u))
    return out


# --------------------------------------------------------------------------- the CLI through the server
def cli_search(url: str, reps: int, work: Path) -> dict[str, Any]:
    """p50 of ``POST /v1/memory/search`` and of a whole ``graftmem search --url`` process."""
    r = httpx.post(url + "/v1/memory/learn", timeout=600, json={
        "text": "Refunds: a damaged item is refunded in full to the original payment method once a photo "
                "of the damage and the receipt are in the ticket.", "chat": True, "name": "refunds",
        "when_to_use": "a customer asks for a refund or reports a damaged item"})
    r.raise_for_status()
    q = {"query": "the kettle arrived broken, I want my money back", "top_k": 3}
    t0 = time.perf_counter()
    httpx.post(url + "/v1/memory/search", json=q, timeout=600).raise_for_status()  # loads the router
    first_ms = (time.perf_counter() - t0) * 1e3
    http_ms = []
    # TCP_NODELAY: httpx writes a request's headers and body in two sends, and with Nagle on the second
    # waits for the server's delayed ACK (~40 ms on Linux): measured, every request after the first took
    # 44 ms that way against 1-8 ms of server work. The CLI sends one buffer and is not affected.
    nodelay = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    with httpx.Client(timeout=60, transport=nodelay) as c:
        for _ in range(reps * 2):
            t0 = time.perf_counter()
            c.post(url + "/v1/memory/search", json=q).raise_for_status()
            http_ms.append((time.perf_counter() - t0) * 1e3)
    # as an installed package runs: byte-compiled once (a cache outside the repo), not compiled on every
    # start as PYTHONDONTWRITEBYTECODE would make it; the first run fills that cache and is not timed
    env = python_env(work, GRAFTMEM_URL=url)
    cli_ms, out = [], ""
    subprocess.run([sys.executable, "-m", "graftmem", "search", q["query"]], cwd=work, env=env,
                   capture_output=True, timeout=120)
    for _ in range(reps):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "graftmem", "search", q["query"], "--top-k", "3"], cwd=work,
                           env=env, capture_output=True, text=True, timeout=120)
        cli_ms.append((time.perf_counter() - t0) * 1e3)
        if p.returncode != 0:
            raise RuntimeError(f"graftmem search failed: {p.stderr[-2000:]}")
        out = p.stdout
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
    bare_ms = (time.perf_counter() - t0) * 1e3
    return {"first_request_ms": round(first_ms, 1), "http_ms": [round(x, 2) for x in http_ms],
            "http_p50_ms": round(harness.summary(http_ms)["median"], 2), "cli_ms": [round(x, 1) for x in cli_ms],
            "cli_p50_ms": round(harness.summary(cli_ms)["median"], 1), "bare_python_ms": round(bare_ms, 1),
            "cli_output": out.strip().splitlines()[:4]}


# --------------------------------------------------------------------------- main
def summary(sessions: list[list[dict]]) -> dict[str, Any]:
    firsts = [s[0]["ttft_ms"] for s in sessions]
    meds = [harness.summary(t["ttft_ms"] for t in s)["median"] for s in sessions]
    sums = [sum(t["ttft_ms"] for t in s) for s in sessions]
    return {"first_turn_ttft_ms": harness.summary(firsts, digits=1),
            "session_median_ttft_ms": harness.summary(meds, digits=1),
            "session_sum_ttft_ms": harness.summary(sums, digits=1),
            "per_turn_median_ms": [round(harness.summary(s[i]["ttft_ms"] for s in sessions)["median"], 1)
                                   for i in range(len(sessions[0]))],
            # what each turn took from a cache and prefilled again (the first session's; None where the
            # server did not say)
            "per_turn_cached_tokens": [t.get("cached_tokens") for t in sessions[0]],
            "per_turn_tokens_prefilled": [t.get("tokens_prefilled") for t in sessions[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--words", type=int, default=2000, help="manual words in the system prompt (~3,000 tokens)")
    ap.add_argument("--cli-reps", type=int, default=10)
    ap.add_argument("--restarts", type=int, default=1,
                    help="sessions after a restart per rep (graftmem: each a new process on a copy of the home as the "
                         "cold session left it; llama-server: each another warm session of the same process): "
                         "more samples of the short restart / warm turns for the price of one cold session")
    ap.add_argument("--only", default="graftmem,graftmem-responses,llama-server,llama-cpp-python",
                    help="graftmem-responses: the same user turns as a Responses agent (previous_response_id), "
                         "5 turns, a restart, 5 more continuing the stored conversation, next to the same "
                         "conversation over Chat Completions re-sending its history")
    ap.add_argument("--model", default="smollm2", help="the GGUF every server loads: a short name (smollm2), a GGUF "
                    "path, or tiny:<family> (scripts/tiny_models.py, e.g. tiny:qwen3)")
    ap.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                    help='chat_template_kwargs of every Chat Completions request, e.g. \'{"enable_thinking": false}\'')
    ap.add_argument("--out", default=str(RESULTS / "serve.json"))
    ap.add_argument("--serve-args", default="", help='extra `graftmem serve` flags, e.g. "--sightings 1"')
    ap.add_argument("--baseline", default=None, help="another graftmem source tree (e.g. `git archive` of the "
                    "commit before a change) run as `graftmem-baseline` in the same run, interleaved")
    args = ap.parse_args()
    only = set(args.only.split(","))
    SERVE_ARGS[:] = args.serve_args.split()
    tpl_kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else None
    if tpl_kwargs is not None and not isinstance(tpl_kwargs, dict):
        raise SystemExit(f"--chat-template-kwargs must be a JSON object, got {args.chat_template_kwargs!r}")
    chat_extra: dict[str, Any] = {"chat_template_kwargs": tpl_kwargs} if tpl_kwargs else {}
    load_before = os.getloadavg()
    cfg = EngineConfig()
    threads = cfg.n_threads or usable_cores()
    model_name, model, model_note = bench_model(args.model)
    MODEL[:] = [model]
    work = Path(tempfile.mkdtemp(prefix="graftmem-bench-serve-"))
    reqs = turns(system_prompt(args.words))
    peers_note: dict[str, str] = {}
    exe = None
    if "llama-server" in only:
        try:
            exe = cpp_peer.build()
        except cpp_peer.PeerUnavailable as exc:
            peers_note["llama-server"] = f"unavailable: {exc}"
    try:
        import fastapi, sse_starlette, starlette_context, pydantic_settings  # noqa: F401,E401
    except ImportError as exc:
        peers_note["llama-cpp-python"] = f"unavailable: {exc} (pip install 'llama-cpp-python[server]')"
        only.discard("llama-cpp-python")
    res: dict[str, list] = {k: [] for k in ("graftmem_cold", "graftmem_restart", "baseline_cold", "baseline_restart",
                                            "llama_server_cold", "llama_server_warm", "lcp_cold", "lcp_restart",
                                            "responses_first", "responses_after_restart", "chat_first",
                                            "chat_after_restart", "llama_chat_first", "llama_chat_after_restart")}
    startup: dict[str, list] = {"graftmem": [], "graftmem-baseline": [], "llama-server": [], "llama-cpp-python": []}
    if args.baseline:
        only.add("graftmem-baseline")
    cached: list[list] = []
    cli: dict[str, Any] = {}

    def run_graftmem(rep: int) -> None:
        home = work / f"home-{rep}"
        with started(lambda: graftmem_server(home, work)) as s:
            startup["graftmem"].append(s.startup_s)
            res["graftmem_cold"].append(session(s.url, reqs, chat_extra))
        pristine = work / f"home-{rep}-after-cold"
        if args.restarts > 1:  # what a restart session learns must not reach the next restart's home
            shutil.copytree(home, pristine)
        for k in range(args.restarts):
            where = home if k == 0 else work / f"home-{rep}-restart-{k}"
            if k:
                shutil.copytree(pristine, where)
            with started(lambda: graftmem_server(where, work)) as s:
                startup["graftmem"].append(s.startup_s)
                res["graftmem_restart"].append(session(s.url, reqs, chat_extra))
                cached.append([t["cached_tokens"] for t in res["graftmem_restart"][-1]])
                if rep == args.reps - 1 and k == args.restarts - 1 and args.cli_reps:
                    cli.update(cli_search(s.url, args.cli_reps, work))
            if k:
                shutil.rmtree(where, ignore_errors=True)

    def run_baseline(rep: int) -> None:
        home, root = work / f"home-baseline-{rep}", Path(args.baseline).resolve()
        for key in ("baseline_cold", "baseline_restart"):
            with started(lambda: graftmem_server(home, work, root)) as s:
                startup["graftmem-baseline"].append(s.startup_s)
                res[key].append(session(s.url, reqs, chat_extra))

    def run_llama_server(rep: int) -> None:
        if exe is None:
            return
        with started(lambda: llama_server(exe, model, cfg, threads, work)) as s:
            startup["llama-server"].append(s.startup_s)
            res["llama_server_cold"].append(session(s.url, reqs, {"cache_prompt": True, **chat_extra}))
            for _ in range(args.restarts):  # each starts from the slot the session before left (turn 5's)
                res["llama_server_warm"].append(session(s.url, reqs, {"cache_prompt": True, **chat_extra}))

    def run_lcp(rep: int) -> None:
        d = work / f"lcp-cache-{rep}"
        d.mkdir()
        for key in ("lcp_cold", "lcp_restart"):
            with started(lambda: lcp_server(model, cfg, threads, d, work)) as s:
                startup["llama-cpp-python"].append(s.startup_s)
                res[key].append(session(s.url, reqs, chat_extra))

    def run_responses(rep: int) -> None:
        """The Responses agent, the Chat Completions agent on graftmem and (with llama-server in --only) on
        llama-server, each on its own fresh server, their turns interleaved; then every server restarts
        (llama-server: a new process, it keeps nothing) and each conversation goes on for 5 more turns."""
        system = reqs[0][0]["content"]
        agents: dict[str, Any] = {"responses": ResponsesAgent(system), "chat": ChatAgent(system, chat_extra)}
        if exe is not None:
            agents["llama_chat"] = ChatAgent(system, {"cache_prompt": True, **chat_extra})
        for phase in ("first", "after_restart"):
            with contextlib.ExitStack() as stack:
                urls = {}
                for name in agents:
                    if name == "llama_chat":
                        s = stack.enter_context(started(lambda: llama_server(exe, model, cfg, threads, work)))
                        startup["llama-server"].append(s.startup_s)
                    else:
                        s = stack.enter_context(started(lambda: graftmem_server(work / f"home-{name}-{rep}", work)))
                    urls[name] = s.url
                for name, turns_ in interleaved({k: (a, urls[k]) for k, a in agents.items()}).items():
                    res[f"{name}_{phase}"].append(turns_)

    runners = [("graftmem", run_graftmem), ("graftmem-responses", run_responses), ("llama-server", run_llama_server),
               ("graftmem-baseline", run_baseline),
               ("llama-cpp-python", run_lcp)]
    runners = [r for r in runners if r[0] in only]
    t_start = time.time()
    loads: list[dict[str, Any]] = []  # the load average after each runner: the machine is shared
    for rep in range(args.reps):
        for name, fn in runners[rep % len(runners):] + runners[:rep % len(runners)]:
            t0 = time.time()
            try:
                fn(rep)
            except cpp_peer.PeerUnavailable as exc:
                peers_note[name] = f"failed in rep {rep}: {exc}"
                print(f"{name}: {exc}", file=sys.stderr)
            loads.append({"rep": rep, "runner": name, "s": round(time.time() - t0, 1), "loadavg": os.getloadavg()})
            print(f"rep {rep + 1}/{args.reps} {name}: {time.time() - t0:.0f} s, load {loads[-1]['loadavg']}",
                  file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    summ = {k: summary(v) for k, v in res.items() if v}
    texts = {k: [t["text"] for t in v[0]] for k, v in res.items() if v}
    gm_texts = [[t["text"] for t in x] for x in res["graftmem_cold"] + res["graftmem_restart"] + res["baseline_cold"]
                + res["baseline_restart"]]
    gm_equal = all(t == gm_texts[0] for t in gm_texts) if gm_texts else None
    ratios: dict[str, Any] = {}

    def ratio(a: str, b: str, field: str) -> Optional[float]:
        if a in summ and b in summ:
            return round(summ[a][field]["median"] / summ[b][field]["median"], 2)
        return None

    ratios = {
        "llama_server_cold / graftmem_restart (first turn; target >= 20)":
            ratio("llama_server_cold", "graftmem_restart", "first_turn_ttft_ms"),
        "graftmem_restart / llama_server_warm (first turn; target <= 1.5)":
            ratio("graftmem_restart", "llama_server_warm", "first_turn_ttft_ms"),
        "llama_server_cold / graftmem_restart (session sum)":
            ratio("llama_server_cold", "graftmem_restart", "session_sum_ttft_ms"),
        "graftmem_restart / llama_server_warm (session sum)":
            ratio("graftmem_restart", "llama_server_warm", "session_sum_ttft_ms"),
        "graftmem_restart / lcp_restart (first turn)": ratio("graftmem_restart", "lcp_restart", "first_turn_ttft_ms"),
        "graftmem_cold / llama_server_cold (session sum)": ratio("graftmem_cold", "llama_server_cold",
                                                                 "session_sum_ttft_ms"),
        "chat_after_restart / responses_after_restart (session sum)": ratio("chat_after_restart",
                                                                            "responses_after_restart",
                                                                            "session_sum_ttft_ms"),
        "baseline_cold / llama_server_cold (session sum)": ratio("baseline_cold", "llama_server_cold",
                                                                 "session_sum_ttft_ms"),
        "baseline_restart / llama_server_warm (session sum)": ratio("baseline_restart", "llama_server_warm",
                                                                    "session_sum_ttft_ms"),
    }

    def per_turn(a: str, b: str) -> Optional[list[float]]:
        if a in summ and b in summ:
            return [round(x / y, 2) for x, y in zip(summ[a]["per_turn_median_ms"], summ[b]["per_turn_median_ms"])]
        return None

    ratios["per turn: graftmem_cold / llama_server_cold (target <= 1.2)"] = per_turn("graftmem_cold", "llama_server_cold")
    ratios["per turn: graftmem_restart / llama_server_warm"] = per_turn("graftmem_restart", "llama_server_warm")
    ratios["per turn: baseline_cold / llama_server_cold"] = per_turn("baseline_cold", "llama_server_cold")
    ratios["per turn: baseline_restart / llama_server_warm"] = per_turn("baseline_restart", "llama_server_warm")
    for a, b in (("chat_first", "responses_first"), ("chat_after_restart", "responses_after_restart"),
                 ("llama_chat_first", "responses_first"), ("llama_chat_after_restart", "responses_after_restart"),
                 ("llama_chat_first", "chat_first"), ("llama_chat_after_restart", "chat_after_restart")):
        ratios[f"per turn: {a} / {b}"] = per_turn(a, b)
        ratios[f"{a} / {b} (session sum)"] = ratio(a, b, "session_sum_ttft_ms")
    out = {
        "baseline": args.baseline,
        "model": f"{model_name} ({model_note})" if model_note else model_name, "model_path": str(model),
        "chat_template_kwargs": tpl_kwargs, "engine": {**cfg.model_dump(), "threads": threads},
        "max_tokens": MAX_TOKENS, "reps": args.reps, "restarts": args.restarts, "turns": len(reqs), "system_words": args.words,
        "machine": {"cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
                    "loadavg_before": load_before, "loadavg_after": load_after, "loadavg_per_runner": loads},
        "wall_s": round(time.time() - t_start, 1),
        "summary": summ, "ratios": ratios, "graftmem_restart_cached_tokens": cached,
        "graftmem_answers_equal_across_sessions": gm_equal, "first_session_answers": texts,
        "startup_s": {k: [round(x, 2) for x in v] for k, v in startup.items()},
        "cli_search": cli, "peers": peers_note, "llama_server_build": cpp_peer.build_record(),
        "weight_buffers": {"graftmem_extra_bufts": cfg.extra_bufts,
                           "llama_server": " ".join(cpp_peer.weight_buffer_args(cfg.extra_bufts == "on")) or "repack on"},
        "raw": {k: [[{kk: t[kk] for kk in ("ttft_ms", "total_ms", "cached_tokens", "tokens_prefilled", "restore_ms",
                                           "prefill_ms", "source") if t.get(kk) is not None} for t in s] for s in v]
                for k, v in res.items()},
    }
    write_results(args.out, out, args=args, threads=threads)
    print(f"{'way':<20}{'turn-1 TTFT ms':>16}{'[min, max]':>20}{'5-turn sum ms':>16}   per turn (median ms)")
    for k, s in summ.items():
        f, t = s["first_turn_ttft_ms"], s["session_sum_ttft_ms"]
        span = f"[{f['min']:.0f}, {f['max']:.0f}]"
        print(f"{k:<20}{f['median']:>16.1f}{span:>20}{t['median']:>16.1f}   {s['per_turn_median_ms']}")
    for k, v in ratios.items():
        print(f"{k}: {v}")
    if cli:
        print(f"graftmem search --url: HTTP p50 {cli['http_p50_ms']} ms, whole CLI process p50 {cli['cli_p50_ms']} ms "
              f"(bare python start {cli['bare_python_ms']} ms)")
    print(f"load average before {load_before}, after {load_after}; notes: {peers_note}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
