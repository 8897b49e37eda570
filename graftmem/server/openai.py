"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

An agent written against the ``openai`` package (or LangChain's ``ChatOpenAI``, or any tool that takes
a ``base_url``) talks to graftmem with no change but the URL. What it gets on top: its long, stable
prompt prefix (system prompt, tools, the conversation so far) is grafted from verified blocks instead
of prefilled (`graftmem.server.prefix`), after a restart too, and every response says so in
``usage.prompt_tokens_details.cached_tokens`` and in a receipt (the ``graftmem`` field and the
``X-Graftmem-Receipt`` header of a non-streamed response).

Per request, ``extra_body={"graftmem": {"cache": false}}`` serves cold (for comparisons and tests), and
``{"graftmem": {"allow_unverified": true}}`` consents to grafting blocks nothing here vouches for (without
it they are passed over; every graft goes through `graftmem.memory.verbs.MemoryVerbs`). ``max_tokens`` is
at most the engine's ``n_ctx``; without it an answer may run to the end of the context (`DEFAULT_MAX_TOKENS`); a client that goes away cancels its request, streamed or not; a large
body is parsed, rendered and tokenized off the event loop. With tenants (``serve --api-key-file``) the
tenant of the request's key salts its prefix keys and owns what it learns (`graftmem.server.tenants`).
Supported: ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` (up
to 4 strings; the text ends before the first one), ``logprobs`` / ``top_logprobs`` (chat) and
``logprobs: int`` (completions, non-streamed), ``response_format`` (``json_object`` / ``json_schema``:
grammar-constrained decoding with llama.cpp's grammar sampler; the logits stay the model's), ``stream`` (SSE ``data:`` chunks, then ``data: [DONE]``;
``stream_options.include_usage``), ``n = 1`` only, ``tools`` / ``tool_choice`` and tool messages
(the model's own template and its family's call grammar, else the Hermes ``<tool_call>`` format; see
`graftmem.server.tools`, `graftmem.core.toolcalls`, docs/models.md; ``required`` and a named function
are enforced by a grammar of the family's call syntax, ``parallel_tool_calls`` allows several). ``/v1/completions`` cuts its prompt into
segments of about 256 tokens (`graftmem.server.chat.chunk_prompt`) and uses the same prefix cache.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import logging
import json
import threading
import time
import uuid
from concurrent import futures
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Sequence, TypeVar

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ..core.budget import Overrun, within
from ..core.renderpool import RenderPool
from ..core.decoding import Sampling
from ..core.errors import ConfigError, GraftmemError
from ..core.grammar_limits import check_schema
from ..core.prompt import detect_format, request_template
from ..core.toolcalls import call_grammar, tool_format
from ..memory import validate as check
from ..memory.router import DEFAULT_MIN_SCORE, LEX_WEIGHT
from ..memory.verbs import MemoryVerbs
from ..store.chain import chain_of
from .chat import (TokenCache, bound_messages, chunk_prompt, literal_spans, render_segments,
                   template_kwargs, template_segments, tokenize_segments)
from .generate import Job, Result, check_fits, run_job
from .http import HTTPError, Limits, client_gone, guarded, json_object, off_loop, public_message, read_body, sse
from .pool import EnginePool
from .routing import RouterRef
from ..memory.access import Access
from .tenants import tenant_of
from .tools import Answer, AnswerParser, AnswerSpec, ToolSpec, answer_spec, parse_tools, split_answer

if TYPE_CHECKING:
    from ..store.protocol import BlockStore
    from .prefix import PrefixCache

__all__ = ["OpenAIRoutes", "RECEIPT_HEADER"]

log = logging.getLogger("graftmem")

RECEIPT_HEADER = "X-Graftmem-Receipt"
T = TypeVar("T")
#: Without ``max_tokens`` an answer may run to the end of the context, as llama-server's (``n_predict``
#: -1): a fixed default of 256 cut a reasoning model's answer short, and the OpenAI Agents SDK, which
#: sends no ``max_output_tokens``, raised on the ``incomplete`` answer. docs/api.md states it.
DEFAULT_MAX_TOKENS = None


def _num(body: dict[str, Any], name: str, default: Any, kind: type, lo: float, hi: float) -> Any:
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else \
        isinstance(v, int) and not isinstance(v, bool)
    if not ok or not lo <= v <= hi:
        raise HTTPError(400, f"{name} must be {'a number' if kind is float else 'an integer'} in "
                        f"[{lo:g}, {hi:g}], got {v!r}", param=name, code="invalid_value")
    return kind(v)


async def job_events(events: "asyncio.Queue[tuple[str, Any]]",
                     done: "asyncio.Future[Result]") -> AsyncIterator[tuple[str, Any]]:
    """A streamed job's events in order: each ``("delta", payload)`` as it arrives, then ``("done",
    Result)`` once, also when the job finished (or failed: raised here) before its last deltas were read.
    Every streaming door (chat completions, Anthropic Messages) reads its job through this one loop."""
    while True:
        get = asyncio.ensure_future(events.get())
        finished, _ = await asyncio.wait((get, done), return_when=asyncio.FIRST_COMPLETED)
        if get in finished:
            kind, payload = get.result()
            yield kind, payload
            if kind != "delta":
                return
            continue
        get.cancel()
        if done.exception() is not None:
            raise done.exception()  # type: ignore[misc]
        while not events.empty():  # deltas queued before the result
            kind, payload = events.get_nowait()
            if kind == "delta":
                yield kind, payload
        yield "done", done.result()
        return


def _check_contents(messages: Any) -> None:
    """Every text of the messages is text UTF-8 can encode, before rendering looks into it (the special-
    token check of untrusted text tokenizes each user message: a lone surrogate there was a 500)."""
    if not isinstance(messages, list):
        return  # the renderer says what is wrong with it
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        parts = [content] if isinstance(content, str) else \
            [p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) else []
        for part in parts:
            if isinstance(part, str):
                check.text(f"messages[{i}]", part, empty=True)


def _log_late_failure(fut: "asyncio.Future[Result]") -> None:
    """A request that failed after its answer was sent (while storing its prefix): logged, not lost."""
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("serve: a request failed after answering: %r", fut.exception())


class OpenAIRoutes:
    """The OpenAI-compatible API over an engine pool, one store and its prefix cache."""

    def __init__(self, pool: EnginePool, store: "BlockStore", cache: Optional["PrefixCache"], *,
                 model_id: Optional[str] = None, limits: Optional[Limits] = None,
                 router: Optional[RouterRef] = None, allow_unverified: bool = False,
                 chat_template: Optional[str] = None, render_workers: int = 4) -> None:
        self.pool, self.store, self.cache = pool, store, cache
        #: every graft of a request goes through its engine's verbs (consent, provenance stamp)
        self.desks = {id(e): MemoryVerbs(e, store) for e in pool.engines}
        #: the operator's consent (``serve --allow-unverified``): blocks nothing here vouches for are
        #: grafted for every request; otherwise only for a request that asks (``graftmem.allow_unverified``)
        self.allow_unverified = allow_unverified
        self.router = router or RouterRef(None)  #: loaded on the first routed request
        self.limits = limits or Limits()
        engine = pool.engines[0]
        self.engine0 = engine
        self.tokens = TokenCache()  #: ids of the segments agents keep re-sending
        self._workers: set[futures.Future[None]] = set()  #: requests' work on the engines' threads
        self._workers_lock = threading.Lock()
        self.model_id = model_id or engine.fingerprint.model_name
        self.fmt = detect_format(engine)
        #: the model's own template renders every chat request (None: the hand-written ``fmt``)
        self.template = request_template(engine, chat_template)
        #: the processes the template renders requests in (`graftmem.core.renderpool`: a template that
        #: loops is killed at the render budget without holding this process's GIL); None: no template
        self.renders = RenderPool(max_workers=render_workers) if self.template is not None and render_workers else None
        self.created = int(time.time())
        #: called on the event loop with each request's result and tenant (the server's metrics count its
        #: tokens, for that tenant)
        self.on_result: list[Callable[[Result, Optional[str]], None]] = []

    def routes(self) -> list[BaseRoute]:
        home = str(self.store.home)
        return [Route("/v1/models", guarded(self.models, home), methods=["GET"]),
                Route("/v1/chat/completions", guarded(self.chat, home), methods=["POST"]),
                Route("/v1/completions", guarded(self.completions, home), methods=["POST"])]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "graftmem"}]})

    # ------------------------------------------------------------------ parsing
    async def _job(self, body: dict[str, Any], segments: list[list[int]], texts: list[str], *, chat: bool,
                   tools: Optional[ToolSpec] = None) -> Job:
        if body.get("n", 1) != 1:
            raise HTTPError(400, "n must be 1: this server generates one choice per request", param="n",
                            code="unsupported_value")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _num({"max_tokens": max_tokens}, "max_tokens", DEFAULT_MAX_TOKENS, int, 1,
                          self.engine0.n_ctx)
        if max_tokens is None:  # up to the context (DEFAULT_MAX_TOKENS)
            max_tokens = max(1, self.engine0.n_ctx - sum(len(s) for s in segments))
        temperature = _num(body, "temperature", 1.0, float, 0.0, 2.0)
        top_p = _num(body, "top_p", 1.0, float, 0.0, 1.0)
        seed = _num(body, "seed", None, int, -(2 ** 63), 2 ** 64 - 1)
        if top_p == 0.0:
            top_p = 1e-9  # OpenAI allows 0: the most likely token only
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
            raise HTTPError(400, "stop must be a non-empty string or a list of up to 4 of them", param="stop")
        if chat:
            logprobs = body.get("logprobs") or False
            if not isinstance(logprobs, bool):
                raise HTTPError(400, "logprobs must be a boolean", param="logprobs")
            top = _num(body, "top_logprobs", 0, int, 0, 20)
        else:
            lp = body.get("logprobs")
            logprobs, top = lp is not None, _num(body, "logprobs", 0, int, 0, 5)
            if logprobs and body.get("stream"):
                raise HTTPError(400, "logprobs are not streamed by /v1/completions on this server",
                                param="logprobs")
        gm = body.get("graftmem") or {}
        if not isinstance(gm, dict):
            raise HTTPError(400, "graftmem must be an object such as {\"cache\": false}", param="graftmem")
        cache = gm.get("cache", True)
        if not isinstance(cache, bool):
            raise HTTPError(400, "graftmem.cache must be a boolean", param="graftmem.cache")
        consent = gm.get("allow_unverified", False)
        if not isinstance(consent, bool):
            raise HTTPError(400, "graftmem.allow_unverified must be a boolean", param="graftmem.allow_unverified")
        if (why := check_fits(self.engine0, segments, max_tokens)) is not None:
            raise HTTPError(400, why, param="messages" if chat else "prompt", code="context_length_exceeded")
        try:
            sampling = Sampling(temperature=temperature, top_p=top_p,
                                seed=None if seed is None else seed % (2 ** 63))
        except ConfigError as exc:
            raise HTTPError(400, str(exc), code="invalid_value") from exc
        grammar = None
        fmt = body.get("response_format")
        if (tools is not None and tools.forced) or not (fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text"):
            # converted and compiled in a worker thread: bounded by `Limits.grammar` (checked first), but a
            # schema of 100,000 enum values once held the event loop 13 s
            grammar = await self.budgeted(lambda: self._grammar(fmt, tools, texts), "making the answer's grammar",
                                          "response_format")
        return Job(segments=segments, texts=texts, max_tokens=max_tokens, sampling=sampling, stops=stops,
                   logprobs=logprobs, top_logprobs=top, use_cache=cache, learn_tail=2 if chat else 1,
                   allow_unverified=consent or self.allow_unverified, grammar=grammar,
                   grammar_limits=self.limits.grammar)

    def _check_schemas(self, body: dict[str, Any], tools: Optional[ToolSpec]) -> None:
        """The schemas a grammar will be made of, checked against `Limits.grammar` (a walk, no conversion)
        before the request's prompt is rendered and tokenized: a 100,000-value enum in a forced tool's
        schema was otherwise rendered into a 900,000-token prompt first."""
        limits = self.limits.grammar
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            check_schema(fmt["json_schema"].get("schema"), "response_format.json_schema.schema", limits)
        if tools is not None and tools.forced:
            for f in tools.functions:
                if f["name"] in tools.forced:
                    check_schema(f.get("parameters"), f"tools.{f['name']}.parameters", limits)

    def _grammar(self, fmt: Any, tools: Optional[ToolSpec], texts: list[str]) -> Optional[str]:
        """The answer's grammar: a forced call's (`call_grammar`), else ``response_format``'s; checked
        against `Limits.grammar` before conversion (`graftmem.core.grammar_limits`) and compiled once
        here, so a grammar llama.cpp refuses is a 400 now, not a 500 in the middle of a stream."""
        grammar = check.response_format(fmt, limits=self.limits.grammar)
        if tools is not None and tools.forced:  # the answer is a call: its grammar, not the text's format
            grammar = self.call_grammar(tools, texts)
        if grammar is not None:
            self.engine0.grammar(grammar, limits=self.limits.grammar).close()
        return grammar

    def call_grammar(self, tools: ToolSpec, texts: list[str]) -> str:
        """The grammar of a forced call (``tool_choice: "required"`` or a named function) in the call
        syntax of the model's family (`graftmem.core.toolcalls.call_grammar`): the answer then parses
        into ``tool_calls`` every time, with arguments the tool's schema accepts. A prompt that ends
        inside a ``<think>`` block its template opened gets the block closed first."""
        assert tools.forced
        fns = [f for f in tools.functions if f["name"] in tools.forced]
        think_open = self.template is not None and "</think>" in self.template.source and \
            bool(texts) and texts[-1].rstrip().endswith("<think>")
        try:
            return call_grammar(tools.fmt, fns, parallel=tools.parallel, think_open=think_open,
                                limits=self.limits.grammar)
        except ConfigError as exc:
            raise HTTPError(400, f"tool_choice: {exc}", param=getattr(exc, "param", None) or "tool_choice") from exc

    async def _parse(self, request: Request) -> dict[str, Any]:
        raw = await read_body(request, self.limits.max_body_bytes, self.limits.body_timeout, self.limits)
        return await off_loop(len(raw), json_object, raw, self.limits.max_json_depth)

    # ------------------------------------------------------------------ endpoints
    async def chat(self, request: Request) -> Response:
        body = await self._parse(request)
        job, tools = await self.chat_job(request, body)
        return await self._serve(request, body, job, chat=True, tools=tools)

    async def chat_job(self, request: Request, body: dict[str, Any],
                       marks: Sequence[int] = ()) -> tuple[Job, Optional[ToolSpec]]:
        """The `Job` of a chat request (``body`` in OpenAI's chat shape: other protocols' doors translate
        into it, so every door renders, caches, consents and bounds the same way) and its tools.

        ``marks``: prefixes of the messages (counts of messages) the client asked to be stored (Anthropic's
        ``cache_control``); each becomes the last segment boundary at or before the end of its messages
        (`Job.marks`), which the prefix cache stores at first sight (`PrefixCache.learn_target`)."""
        if self.fmt is None and self.template is None:
            raise HTTPError(400, f"model {self.model_id!r} has no chat template graftmem knows; use "
                            "/v1/completions", code="unsupported_model")
        self.bound(body.get("messages"))  # first: rendering is quadratic in the messages
        tools = self.tool_spec(body)
        self._check_schemas(body, tools)  # a grammar bomb is refused before its request is rendered
        notes: Optional[list[str]] = None
        literal = None
        kwargs = template_kwargs(body.get("chat_template_kwargs"))
        fmt, template = self.fmt, self.template

        ends: list[int] = []  # per message: the prompt's characters up to its end (for ``marks``)
        joined: list[bool] = []  # whether the generation header joined the last turn (its last token a segment)

        def prompt() -> tuple[list[str], list[list[int]], Optional[list[str]], Any]:
            notes, literal = None, None
            _check_contents(body.get("messages"))  # before anything tokenizes them (a lone surrogate was a 500)
            if template is not None:  # the model's own template (graftmem.core.template)
                texts, notes, literal = template_segments(self.engine0, template, body.get("messages"), tools,
                                                          kwargs, ends, marks, joined, pool=self.renders)
            else:
                assert fmt is not None
                untrusted: list[Any] = []
                texts = render_segments(fmt, body.get("messages"), tools, untrusted, ends, marks, self.engine0, joined)
                literal, found = literal_spans(self.engine0, texts, untrusted)
                notes = found or None
            for i, t in enumerate(texts):  # a lone surrogate never reaches the tokenizer (it was a 500)
                check.text(f"messages[{i}]", t, empty=True)
            segments = tokenize_segments(self.engine0, texts, self.tokens, literal)
            if notes is not None and len(segments) > 1 and not any(literal or []) and \
                    [t for s in segments for t in s] != self.tokens.tokenize(self.engine0, "".join(texts), True):
                # the cuts tokenize apart one by one; if together they do not, the prompt is one segment
                segments, texts = [self.tokens.tokenize(self.engine0, "".join(texts), True)], ["".join(texts)]
                notes.append("the segments do not tokenize apart as the whole prompt: served as one segment")
            return texts, segments, notes, literal

        # rendered and tokenized in a worker thread, within the render budget: the event loop keeps serving
        texts, segments, notes, literal = await self.budgeted(prompt)
        stops = list(itertools.accumulate(map(len, texts)))  # each segment's end, in characters
        cuts = {bisect.bisect_right(stops, ends[k - 1]) for k in marks if 0 < k <= len(ends)}
        n_before = len(segments)
        routed = await self._recall(body, segments, texts, tenant_of(request.scope))
        job = await self._job(body, segments, texts, chat=True, tools=tools)
        if joined and joined[-1] and n_before > 1:  # (not when the prompt fell back to one segment)
            job.learn_tail = 1  # the last segment is the header's last token: only it is never learned
        job.extra = routed
        job.tenant = tenant_of(request.scope)
        shift = len(segments) - n_before  # the routed block's chain put before the messages
        job.marks = sorted(c + shift for c in cuts if 0 < c < n_before)  # the header always stays to prefill
        if literal and any(literal):
            # a segment whose ids are not tokenize(its text) must not become a block (its text would
            # not re-derive its tokens): it and what follows are never learned; reuse before it stays
            first = next(i for i, spans in enumerate(literal) if spans)
            job.learn_tail = max(job.learn_tail, len(segments) - first)
            job.marks = [k for k in job.marks if k <= first + shift]
        if notes:
            job.extra = {**(routed or {}), "template": {"notes": notes}}
        job.specials = self.answer_spec(job, tools).specials  # the family's markers: text in the answer
        return job, tools

    async def budgeted(self, fn: Callable[[], T], what: str = "rendering this request's prompt",
                       param: str = "messages") -> T:
        """``fn()`` (a request's render, tokenization and segment cuts: work its data controls) in a worker
        thread, stopped past ``Limits.render_timeout`` (`graftmem.core.budget.within`): a chat template
        that loops on a trigger word once held the event loop, so that ``/health`` stopped answering
        and SIGINT could not stop the process. Past the budget the request is a 400 naming ``param``;
        the thread is free. A schema's conversion to a grammar runs under the same budget."""
        timeout = self.limits.render_timeout
        try:
            return await anyio.to_thread.run_sync(within, timeout, fn)
        except Overrun:
            log.warning("serve: %s took longer than %g s and was stopped", what, timeout)
            raise HTTPError(400, f"{what} took longer than this server's {timeout:g} s budget (the request is "
                            "too costly: its template, messages or schema); it was stopped",
                            param=param, code="render_timeout") from None

    def bound(self, messages: Any, param: str = "messages") -> None:
        """The request's count of messages (or input items) and of parts per message within this server's
        limits (`Limits.max_messages`, lowered to the engine's ``n_ctx``: every message takes at least a
        token; `Limits.max_message_parts`): every chat door calls it before translating or rendering."""
        limit, why = self.limits.max_messages, " (Limits.max_messages)"
        if self.engine0.n_ctx < limit:
            limit, why = self.engine0.n_ctx, (f" (the model's context is {self.engine0.n_ctx} tokens and every "
                                              "message takes at least one)")
        bound_messages(messages, limit, self.limits.max_message_parts, param=param, why=why)

    def tool_spec(self, body: dict[str, Any]) -> Optional[ToolSpec]:
        """The request's tools (``tools`` / ``tool_choice`` in the chat shape), in the call grammar the
        model answers in: its family's when its template renders the tools, else Hermes."""
        tools = parse_tools(body)
        if tools is not None and self.template is not None and self.template.uses_tools:
            tools = dataclasses.replace(tools, fmt=tool_format(self.template.source))
        return tools

    async def _recall(self, body: dict[str, Any], segments: list[list[int]], texts: list[str],
                      tenant: Optional[str] = None) -> Optional[dict]:
        """Opt-in routing (``"graftmem": {"recall": true, "min_score": 0.4}``): the router picks ONE block
        for the last user message and its chain is put before the messages, as ``Memory.recall`` puts
        it before the task. The prefix cache then grafts it like any stored prefix (exact: the cold
        path prefills the same segments). Mutates ``segments`` / ``texts``; returns the receipt part.
        Only blocks ``tenant`` sees are routed to (`graftmem.memory.access`: its own and the shared ones)."""
        gm = body.get("graftmem") or {}
        if not isinstance(gm, dict) or not gm.get("recall"):
            return None
        if not self.router.available:
            raise HTTPError(400, "this server was started without a router: routed recall is off",
                            param="graftmem.recall", code="recall_unavailable")
        min_score = _num(gm, "min_score", DEFAULT_MIN_SCORE, float, -1.0, 1.0 + LEX_WEIGHT)  # dense + weighted coverage
        users = [m for m in body["messages"] if isinstance(m, dict) and m.get("role") == "user"]
        task = users[-1].get("content") if users else None
        if not isinstance(task, str) or not task.strip():
            raise HTTPError(400, "routed recall needs a last user message with text content", param="messages")
        consent = gm.get("allow_unverified", False)
        if not isinstance(consent, bool):
            raise HTTPError(400, "graftmem.allow_unverified must be a boolean", param="graftmem.allow_unverified")
        desk = self.desks[id(self.engine0)]
        router = self.router
        # the router never indexes automatic prefix blocks (memory.router.UNROUTED_KINDS)
        allow = Access(self.store, tenant).allow()
        hits = await asyncio.to_thread(lambda: desk.search(router.get(), task, top_k=1, allow=allow))
        if not hits or hits[0].score < min_score:
            return {"recall": {"block_id": None, "score": hits[0].score if hits else None, "min_score": min_score}}
        block = self.store.get(hits[0].block_id)
        chain = chain_of(self.store, block)
        try:  # the routed block's text goes before the messages: its consent is asked now, as Memory.recall does
            desk.consent(block, consent or self.allow_unverified, chain)
        except GraftmemError as exc:
            raise HTTPError(400, str(exc), param="graftmem.allow_unverified", code=type(exc).__name__) from exc
        # the messages now follow the block: no second BOS
        segments[0] = self.engine0.tokenize(texts[0], add_special=False)
        segments[:0] = [list(b.tokens) for b in chain]
        texts[:0] = [b.text for b in chain]
        return {"recall": {"block_id": block.id, "score": hits[0].score, "min_score": min_score}}

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise HTTPError(400, "prompt must be a non-empty string (one prompt per request)", param="prompt")
        check.text("prompt", prompt)
        engine = self.engine0

        def cut() -> tuple[list[list[int]], list[str]]:
            # the length is checked on the token count before the prompt is cut (cutting an 8 MB prompt
            # into 256-token segments took seconds on the event loop, for a prompt refused afterwards)
            n = len(engine.tokenize(prompt, add_special=True))
            if n + 1 > engine.n_ctx:
                raise HTTPError(400, f"this model's context is {engine.n_ctx} tokens; the prompt is {n} tokens. "
                                "Shorten it or start the server with a larger n_ctx", param="prompt",
                                code="context_length_exceeded")
            return chunk_prompt(engine, prompt)

        segments, texts = await off_loop(len(prompt), cut)
        job = await self._job(body, segments, texts, chat=False)
        job.tenant = tenant_of(request.scope)
        return await self._serve(request, body, job, chat=False)

    # ------------------------------------------------------------------ running
    def _start(self, engine: Any, job: Job, loop: asyncio.AbstractEventLoop,
               done: "asyncio.Future[Result]") -> None:
        def work() -> None:
            outcome: tuple[Optional[Result], Optional[BaseException]] = (None, None)
            try:
                outcome = (run_job(self.desks[id(engine)], self.cache, job), None)
                if outcome[0] is not None and outcome[0].finish_reason == "cancelled":
                    log.info("serve: a request was cancelled (its client went away) after %d token(s)",
                             len(outcome[0].tokens))
            except BaseException as exc:  # noqa: BLE001 - handed to the request, which reports it
                outcome = (None, exc)
            finally:
                try:
                    loop.call_soon_threadsafe(finish, *outcome)
                except RuntimeError:  # the server stopped while this request was storing its prefix
                    log.debug("serve: request finished after the event loop closed")

        def finish(result: Optional[Result], exc: Optional[BaseException]) -> None:
            self.pool.release(engine)  # first: a client that has its answer finds the engine free
            if result is not None:
                for hook in self.on_result:
                    hook(result, job.tenant)
            if not done.done():
                if exc is not None:
                    done.set_exception(exc)
                else:
                    done.set_result(result)  # type: ignore[arg-type]

        with self._workers_lock:  # on the engine's own thread (`EnginePool.run`: never a thread per request)
            self._workers = {f for f in self._workers if not f.done()} | {self.pool.run(engine, work)}

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until every request's worker has finished, learning included (a non-streamed answer is
        sent before its request stores what it learned); False if some are still running at ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._workers_lock:
            workers = list(self._workers)
        if futures.wait(workers, timeout).not_done:
            return False
        # the prefixes those requests learned are written by the prefix cache's thread after them
        return self.cache is None or self.cache.flush(max(0.0, deadline - time.monotonic()))

    async def _serve(self, request: Request, body: dict[str, Any], job: Job, *, chat: bool,
                     tools: Optional[ToolSpec] = None) -> Response:
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise HTTPError(400, "stream must be a boolean", param="stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise HTTPError(400, "stream_options must be an object such as {\"include_usage\": true}",
                            param="stream_options")
        include_usage = (options or {}).get("include_usage")
        include_usage = False if include_usage is None else include_usage
        if not isinstance(include_usage, bool):
            raise HTTPError(400, "stream_options.include_usage must be a boolean", param="stream_options")
        loop = asyncio.get_running_loop()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not stream:
            # a client that goes away cancels the request: while it waits for an engine, and while it
            # decodes (at the next token); a non-streamed answer used to decode to max_tokens for nobody
            gone = asyncio.ensure_future(client_gone(request))
            try:
                return await self._answer(gone, job, loop, rid, created, chat=chat, tools=tools,
                                          reasoning=body.get("reasoning_format", "auto") != "none")
            finally:
                gone.cancel()
        events, done = await self.stream(job)  # 429 here, before the stream starts
        # the answer's one parser (`graftmem.core.answers`): reasoning, content and calls as they arrive
        parser = AnswerParser(self.answer_spec(job, tools, body.get("reasoning_format", "auto") != "none")) \
            if chat else None
        return StreamingResponse(self._sse(rid, created, job, events, done, chat=chat, usage=include_usage,
                                           parser=parser),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def answer(self, request: Request, job: Job) -> Optional[Result]:
        """Run ``job`` to its result for a non-streamed answer (None: the client went away, its decode
        was cancelled; answer 499). Other protocols' doors format the result their way."""
        loop = asyncio.get_running_loop()
        gone = asyncio.ensure_future(client_gone(request))
        try:
            return await self._result(gone, job, loop)
        finally:
            gone.cancel()

    async def stream(self, job: Job) -> tuple["asyncio.Queue[tuple[str, Any]]", "asyncio.Future[Result]"]:
        """Start ``job`` for a streamed answer: its ``("delta", (text, logprobs))`` / ``("done", Result)``
        events and the future of its result (which holds its exception if it failed). A full queue is a
        429 raised here, before any byte of the stream is sent."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        job.emit = lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        engine = await self.pool.acquire(job.prefer)
        done: asyncio.Future[Result] = loop.create_future()
        self._start(engine, job, loop, done)
        return events, done

    async def _answer(self, gone: "asyncio.Future[None]", job: Job, loop: asyncio.AbstractEventLoop, rid: str,
                      created: int, *, chat: bool, tools: Optional[ToolSpec], reasoning: bool = True) -> Response:
        """A non-streamed answer, given up (and its decode cancelled) as soon as ``gone`` completes."""
        result = await self._result(gone, job, loop)
        if result is None:
            return Response(status_code=499)
        receipt = self._receipt(job, result)
        payload = self._final(rid, created, result, receipt, job, chat=chat, tools=tools, reasoning=reasoning)
        return JSONResponse(payload, headers={RECEIPT_HEADER: json.dumps(receipt)})

    async def _result(self, gone: "asyncio.Future[None]", job: Job,
                      loop: asyncio.AbstractEventLoop) -> Optional[Result]:
        acquire = asyncio.ensure_future(self.pool.acquire(job.prefer))
        await asyncio.wait((acquire, gone), return_when=asyncio.FIRST_COMPLETED)
        if not acquire.done():
            acquire.cancel()  # the pool hands back an engine given to a waiter that left
            return None
        engine = acquire.result()  # 429 raised here
        done: asyncio.Future[Result] = loop.create_future()
        answered: asyncio.Future[Result] = loop.create_future()

        def on_done(r: Result) -> None:
            if not answered.done():
                answered.set_result(r)

        # the answer is sent as soon as it is decoded; storing a learned prefix happens after it
        job.emit = lambda kind, payload: loop.call_soon_threadsafe(on_done, payload) if kind == "done" else None
        self._start(engine, job, loop, done)
        done.add_done_callback(_log_late_failure)
        try:
            await asyncio.wait((answered, done, gone), return_when=asyncio.FIRST_COMPLETED)
            if not (answered.done() or done.done()):
                job.cancel.set()  # the decode loop sees it at its next token and frees the engine
                return None
            return answered.result() if answered.done() else done.result()
        except GraftmemError as exc:  # the engine refused (context full, ...): say so, no local paths
            raise HTTPError(500, public_message(str(exc), str(self.store.home)), code=type(exc).__name__) from exc

    async def _sse(self, rid: str, created: int, job: Job, events: "asyncio.Queue[tuple[str, Any]]",
                   done: "asyncio.Future[Result]", *, chat: bool, usage: bool,
                   parser: Optional[AnswerParser] = None) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        calls: list[dict[str, Any]] = []

        def chunk(choice: dict[str, Any], **extra: Any) -> bytes:
            d = {"id": rid, "object": obj, "created": created, "model": self.model_id,
                 "choices": [choice] if choice else [], **extra}
            return sse(d)

        def parsed(events: list[Any], entries: list[dict[str, Any]]) -> bytes:
            out = b""
            for e in events:
                if e.kind == "reasoning":
                    out += chunk({"index": 0, "delta": {"reasoning_content": e.text}, "logprobs": None,
                                  "finish_reason": None})
                elif e.kind == "content":
                    out += chunk({"index": 0, "delta": {"content": e.text},
                                  "logprobs": {"content": entries} if job.logprobs else None, "finish_reason": None})
                    entries = []
                else:
                    calls.append(e.call)
            if entries and job.logprobs:
                out += chunk({"index": 0, "delta": {"content": ""}, "logprobs": {"content": entries},
                              "finish_reason": None})
            return out

        def delta(text: str, entries: list[dict[str, Any]]) -> bytes:
            if parser is not None:
                return parsed(parser.feed(text), entries)
            return chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})

        try:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            async for kind, payload in job_events(events, done):
                if kind == "delta":
                    if piece := delta(*payload):
                        yield piece
                    continue
                result: Result = payload
                reason = "stop" if result.finish_reason in ("stop", "cancelled") else result.finish_reason
                if parser is not None:
                    if rest := parsed(parser.finish(), []):
                        yield rest
                    if calls:
                        yield chunk({"index": 0, "delta": {"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]},
                                     "logprobs": None, "finish_reason": None})
                        reason = "tool_calls"
                yield chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason} if chat else
                            {"index": 0, "text": "", "logprobs": None, "finish_reason": reason},
                            graftmem=self._receipt(job, result))
                if usage:
                    yield chunk({}, usage=self._usage(result))
                yield b"data: [DONE]\n\n"
                return
        except HTTPError as exc:
            yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse({"error": {"message": f"internal error ({type(exc).__name__})", "type": "server_error",
                                 "param": None, "code": "internal_error"}})
        finally:
            job.cancel.set()  # a client that went away stops the decode at the next token

    def answer_spec(self, job: Optional[Job], tools: Optional[ToolSpec], reasoning: bool = True) -> AnswerSpec:
        """How the answer to ``job`` splits (`graftmem.server.tools.answer_spec`): the same for every
        door, streamed or not."""
        tail = job.texts[-1] if job is not None and job.texts else ""
        return answer_spec(self.template, tools, reasoning=reasoning, prompt_tail=tail)

    def split_answer(self, r: Result, job: Optional[Job], tools: Optional[ToolSpec], reasoning: bool = True) -> Answer:
        """The whole answer split into content, reasoning and tool calls (OpenAI's ``tool_calls``
        entries): the stream's parser fed at once; what other protocols' doors turn into their blocks."""
        return split_answer(r.text, self.answer_spec(job, tools, reasoning))

    @staticmethod
    def receipt(job: Job, r: Result) -> dict[str, Any]:
        """The receipt of a request: the engine's (what was grafted, from where) and what routing added."""
        return {**r.receipt.model_dump(mode="json"), **(job.extra or {})}

    @staticmethod
    def _receipt(job: Job, r: Result) -> dict[str, Any]:
        return {**r.receipt.model_dump(mode="json"), **(job.extra or {})}

    @staticmethod
    def _usage(r: Result) -> dict[str, Any]:
        n = len(r.tokens)
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": n, "total_tokens": r.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    def _final(self, rid: str, created: int, r: Result, receipt: dict[str, Any], job: Optional[Job] = None, *, chat: bool,
               tools: Optional[ToolSpec] = None, reasoning: bool = True) -> dict[str, Any]:
        reason = "stop" if r.finish_reason in ("stop", "cancelled") else r.finish_reason
        if chat:
            # a thinking model's reasoning apart from its answer (llama-server's default --reasoning-format;
            # "reasoning_format": "none" keeps it in the content), with or without calls
            answer = self.split_answer(r, job, tools, reasoning)
            message: dict[str, Any] = {"role": "assistant", "content": answer.content}
            if answer.reasoning is not None:
                message["reasoning_content"] = answer.reasoning
            if answer.calls:
                message["tool_calls"] = answer.calls
                reason = "tool_calls"
            choice: dict[str, Any] = {"index": 0, "message": message,
                                      "logprobs": {"content": r.logprobs} if r.logprobs else None,
                                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            lp = None
            if r.logprobs:
                lp = {"tokens": [e["token"] for e in r.logprobs],
                      "token_logprobs": [e["logprob"] for e in r.logprobs],
                      "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in r.logprobs],
                      "text_offset": []}
            choice = {"index": 0, "text": r.text, "logprobs": lp, "finish_reason": reason}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": self.model_id, "choices": [choice],
                "usage": self._usage(r), "graftmem": receipt}

