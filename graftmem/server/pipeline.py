"""One pipeline for every chat request, whichever door it came through.

The doors (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages``) are
translators: each turns its protocol's body into the chat shape, hands it to `ChatPipeline`, and turns the
`Result` back into its protocol's answer. What lies between is here, once:

1. **parse**: `ChatPipeline.parse_chat` reads and checks a body into a `ChatRequest` (its messages counted,
   its tools, its schemas walked against `Limits.grammar`, its sampling and graftmem options in `Options`)
   before anything renders or tokenizes it; a refusal is a 400 naming the field;
2. **build**: `ChatPipeline.chat_job` renders the messages with the model's own template (in render
   processes, within the render budget), cuts them into segments, tokenizes them, puts a routed block's
   chain before them (opt-in recall) and makes the answer's grammar: a `Job`, whose prefix keys are
   computed once (`Job.keys`);
3. **run**: `ChatPipeline.answer` (whole) or `ChatPipeline.stream` (deltas) acquire an engine from the
   pool and run the job on that engine's thread (`graftmem.server.generate.run_job`: graft, prefill,
   decode, hand the learned prefix to the writer);
4. **split**: `ChatPipeline.split_answer` parses the answer into text and tool calls in the tools' family
   format, the same for every door.

Errors: a refusal is an `HTTPError`; a graftmem error raised anywhere on the way keeps its class, and
`graftmem.server.http.guarded` gives it its status and its type in the door's own error shape
(`graftmem.server.http.status_of`: one map), never a bare 500.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Sequence, TypeVar

import anyio.to_thread
from starlette.requests import Request

from ..core.budget import Overrun, within
from ..core.decoding import Sampling
from ..core.errors import ConfigError, GraftmemError
from ..core.grammar_limits import check_schema
from ..core.segments import detect_format, literal_spans, request_template, tokenize_cut
from ..core.renderpool import RenderPool
from ..core.toolcalls import call_grammar
from ..memory import validate as check
from ..memory.access import Access
from ..memory.router import DEFAULT_MIN_SCORE, LEX_WEIGHT
from ..memory.verbs import MemoryVerbs
from ..store.chain import chain_of
from .chat import TokenCache, bound_messages, render_segments, template_kwargs, template_segments
from .generate import Job, Result, check_fits, run_job
from .http import HTTPError, Limits, client_gone, read_json
from .pool import EnginePool
from .routing import RouterRef
from .tenants import tenant_of
from .tools import Answer, AnswerSpec, ToolSpec, answer_spec, request_tools, split_answer

if TYPE_CHECKING:
    from ..store.protocol import BlockStore
    from .prefix import PrefixCache

__all__ = ["ChatPipeline", "ChatRequest", "Options", "RECEIPT_HEADER", "job_events", "read_options"]

log = logging.getLogger("graftmem")

#: the header every door puts a non-streamed answer's receipt in (JSON)
RECEIPT_HEADER = "X-Graftmem-Receipt"
T = TypeVar("T")
#: Without ``max_tokens`` an answer may run to the end of the context, as llama-server's (``n_predict``
#: -1): a reasoning model's thinking alone once ran past a 256-token default and the Agents SDK raised
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


def _flag(d: dict[str, Any], name: str, default: bool, where: str) -> bool:
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise HTTPError(400, f"{where}{name} must be a boolean", param=f"{where}{name}", code="invalid_value")
    return v


@dataclass(frozen=True)
class Options:
    """What a request asks of its answer and of graftmem, read and checked once (`read_options`), in the
    chat (or completions) shape every door translates its body into."""

    max_tokens: Optional[int]  #: None: up to the end of the context (`DEFAULT_MAX_TOKENS`)
    sampling: Sampling
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    #: ``graftmem.cache``: false serves cold (no lookup, nothing learned)
    cache: bool = True
    #: ``graftmem.allow_unverified``: the request's own consent to graft blocks nothing here vouches for
    allow_unverified: bool = False
    #: ``graftmem.recall``: route the last user message to one block and put its chain first
    recall: bool = False
    min_score: float = DEFAULT_MIN_SCORE
    stream: bool = False
    include_usage: bool = False
    #: ``reasoning_format`` other than ``"none"``: a thinking model's reasoning apart from its answer
    reasoning: bool = True
    #: ``response_format`` as sent (its shape is checked when its grammar is made)
    response_format: Any = None


def read_options(body: dict[str, Any], *, chat: bool, n_ctx: int) -> Options:
    """``body``'s sampling, output and graftmem options, each checked (a 400 naming the field): the one
    reading of them, before anything renders the request."""
    if body.get("n", 1) != 1:
        raise HTTPError(400, "n must be 1: this server generates one choice per request", param="n",
                        code="unsupported_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _num({"max_tokens": max_tokens}, "max_tokens", DEFAULT_MAX_TOKENS, int, 1, n_ctx)
    temperature = _num(body, "temperature", 1.0, float, 0.0, 2.0)
    top_p = _num(body, "top_p", 1.0, float, 0.0, 1.0)
    seed = _num(body, "seed", None, int, -(2 ** 63), 2 ** 64 - 1)
    if top_p == 0.0:
        top_p = 1e-9  # OpenAI allows 0: the most likely token only
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
        raise HTTPError(400, "stop must be a non-empty string or a list of up to 4 of them", param="stop")
    stream = _flag(body, "stream", False, "")
    usage = body.get("stream_options")
    if usage is not None and not isinstance(usage, dict):
        raise HTTPError(400, "stream_options must be an object such as {\"include_usage\": true}",
                        param="stream_options")
    include_usage = _flag(usage or {}, "include_usage", False, "stream_options.")
    if chat:
        logprobs = _flag(body, "logprobs", False, "")
        top = _num(body, "top_logprobs", 0, int, 0, 20)
    else:
        lp = body.get("logprobs")
        logprobs, top = lp is not None, _num(body, "logprobs", 0, int, 0, 5)
        if logprobs and stream:
            raise HTTPError(400, "logprobs are not streamed by /v1/completions on this server",
                            param="logprobs")
    gm = body.get("graftmem") or {}
    if not isinstance(gm, dict):
        raise HTTPError(400, "graftmem must be an object such as {\"cache\": false}", param="graftmem")
    recall = _flag(gm, "recall", False, "graftmem.")
    min_score = _num(gm, "min_score", DEFAULT_MIN_SCORE, float, -1.0, 1.0 + LEX_WEIGHT)  # dense + weighted coverage
    try:
        sampling = Sampling(temperature=temperature, top_p=top_p, seed=None if seed is None else seed % (2 ** 63))
    except ConfigError as exc:
        raise HTTPError(400, str(exc), code="invalid_value") from exc
    return Options(max_tokens=max_tokens, sampling=sampling, stops=tuple(stops), logprobs=logprobs, top_logprobs=top,
                   cache=_flag(gm, "cache", True, "graftmem."),
                   allow_unverified=_flag(gm, "allow_unverified", False, "graftmem."),
                   recall=recall, min_score=min_score, stream=stream, include_usage=include_usage,
                   reasoning=body.get("reasoning_format", "auto") != "none",
                   response_format=body.get("response_format"))


@dataclass(frozen=True)
class ChatRequest:
    """A chat request as parsed and checked once (`ChatPipeline.parse_chat`), before any render."""

    messages: list[Any]
    tools: Optional[ToolSpec]
    options: Options
    #: ``chat_template_kwargs``, checked (`graftmem.server.chat.template_kwargs`)
    template_kwargs: dict[str, Any]
    #: prefixes of the messages (counts) the client asked to be stored (Anthropic's ``cache_control``)
    marks: tuple[int, ...] = ()


async def job_events(events: "asyncio.Queue[tuple[str, Any]]",
                     done: "asyncio.Future[Result]") -> AsyncIterator[tuple[str, Any]]:
    """A streamed job's events in order: each ``("delta", payload)`` as it arrives, then ``("done",
    Result)`` once, also when the job finished (or failed: raised here) before its last deltas were read.
    Every streaming door reads its job through this one loop."""
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


class ChatPipeline:
    """Parse, build, run and split every chat request over an engine pool, one store and its prefix cache."""

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
        #: called on the event loop with each request's result and tenant (the server's metrics count its
        #: tokens, for that tenant)
        self.on_result: list[Callable[[Result, Optional[str]], None]] = []

    def close(self) -> None:
        if self.renders is not None:
            self.renders.close()  # the render processes end

    # ------------------------------------------------------------------ parse
    async def read_json(self, request: Request) -> dict[str, Any]:
        """The request's body as a JSON object, within `Limits` (size, rate, depth; off the event loop
        when large): every JSON door reads its body through here."""
        return await read_json(request, self.limits)

    def parse_chat(self, body: dict[str, Any], marks: Sequence[int] = ()) -> ChatRequest:
        """``body`` (OpenAI's chat shape: other doors translate into it) read and checked once: its messages
        counted (`bound`: rendering is quadratic in them), its tools, the schemas a grammar will be made of
        (`Limits.grammar`: a grammar bomb is refused before its request is rendered), the template's
        kwargs and every option (`read_options`)."""
        if self.fmt is None and self.template is None:
            raise HTTPError(400, f"model {self.model_id!r} has no chat template graftmem knows; use "
                            "/v1/completions", code="unsupported_model")
        messages = body.get("messages")
        self.bound(messages)
        tools = self.tool_spec(body)
        options = read_options(body, chat=True, n_ctx=self.engine0.n_ctx)
        self._check_schemas(options.response_format, tools)
        kwargs = template_kwargs(body.get("chat_template_kwargs"))
        return ChatRequest(messages=messages, tools=tools, options=options, template_kwargs=kwargs,  # type: ignore[arg-type]
                           marks=tuple(marks))

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
        """The request's tools in the call grammar the model answers in (`request_tools`)."""
        return request_tools(body, self.template)

    def _check_schemas(self, fmt: Any, tools: Optional[ToolSpec]) -> None:
        """The schemas a grammar will be made of, checked against `Limits.grammar` (a walk, no conversion)
        before the request's prompt is rendered and tokenized: a 100,000-value enum in a forced tool's
        schema was otherwise rendered into a 900,000-token prompt first."""
        limits = self.limits.grammar
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            check_schema(fmt["json_schema"].get("schema"), "response_format.json_schema.schema", limits)
        if tools is not None and tools.forced:
            for f in tools.functions:
                if f["name"] in tools.forced:
                    check_schema(f.get("parameters"), f"tools.{f['name']}.parameters", limits)

    # ------------------------------------------------------------------ build
    async def chat_job(self, request: Request, req: ChatRequest) -> Job:
        """The `Job` of a parsed chat request: its messages rendered by the model's own template (or the
        hand-written format), cut into segments and tokenized, once, in a worker thread within the render
        budget; a routed block put first (opt-in); its grammar made.

        ``req.marks`` become the last segment boundary at or before the end of their messages
        (`Job.marks`), which the prefix cache stores at first sight (`PrefixCache.learn_target`)."""
        marks = req.marks
        fmt, template = self.fmt, self.template
        ends: list[int] = []  # per message: the prompt's characters up to its end (for ``marks``)
        joined: list[bool] = []  # whether the generation header joined the last turn (its last token a segment)

        def prompt() -> tuple[list[str], list[list[int]], Optional[list[str]], Any]:
            notes, literal = None, None
            _check_contents(req.messages)  # before anything tokenizes them (a lone surrogate was a 500)
            if template is not None:  # the model's own template (graftmem.core.template)
                texts, notes, literal = template_segments(self.engine0, template, req.messages, req.tools,
                                                          req.template_kwargs, ends, marks, joined, pool=self.renders)
            else:
                assert fmt is not None
                untrusted: list[Any] = []
                texts = render_segments(fmt, req.messages, req.tools, untrusted, ends, marks, self.engine0, joined)
                literal, found = literal_spans(self.engine0, texts, untrusted)
                notes = found or None
            for i, t in enumerate(texts):  # a lone surrogate never reaches the tokenizer (it was a 500)
                check.text(f"messages[{i}]", t, empty=True)
            texts, segments, whole = tokenize_cut(self.engine0, texts, literal, self.tokens, check_apart=notes is not None)
            if whole is not None and notes is not None:
                notes.append(whole)
            return texts, segments, notes, literal

        # rendered and tokenized in a worker thread, within the render budget: the event loop keeps serving
        texts, segments, notes, literal = await self.budgeted(prompt)
        stops = list(itertools.accumulate(map(len, texts)))  # each segment's end, in characters
        cuts = {bisect.bisect_right(stops, ends[k - 1]) for k in marks if 0 < k <= len(ends)}
        n_before = len(segments)
        tenant = tenant_of(request.scope)
        routed = await self._recall(req, segments, texts, tenant) if req.options.recall else None
        job = await self.job(req.options, segments, texts, chat=True, tools=req.tools)
        if joined and joined[-1] and n_before > 1:  # (not when the prompt fell back to one segment)
            job.learn_tail = 1  # the last segment is the header's last token: only it is never learned
        job.extra = routed
        job.tenant = tenant
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
        job.specials = self.answer_spec(job, req.tools).specials  # the family's markers: text in the answer
        return job

    async def job(self, options: Options, segments: list[list[int]], texts: list[str], *, chat: bool,
                  tools: Optional[ToolSpec] = None) -> Job:
        """The `Job` of segments already built (a chat request's, a completion's chunks, a stored chain and
        its continuation): the context checked against ``options.max_tokens``, the grammar made."""
        max_tokens = options.max_tokens
        if max_tokens is None:  # up to the context (DEFAULT_MAX_TOKENS)
            max_tokens = max(1, self.engine0.n_ctx - sum(len(s) for s in segments))
        if (why := check_fits(self.engine0, segments, max_tokens)) is not None:
            raise HTTPError(400, why, param="messages" if chat else "prompt", code="context_length_exceeded")
        grammar = None
        fmt = options.response_format
        if (tools is not None and tools.forced) or not (fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text"):
            # converted and compiled in a worker thread: bounded by `Limits.grammar` (checked first), but a
            # schema of 100,000 enum values once held the event loop 13 s
            grammar = await self.budgeted(lambda: self._grammar(fmt, tools, texts), "making the answer's grammar",
                                          "response_format")
        return Job(segments=segments, texts=texts, max_tokens=max_tokens, sampling=options.sampling,
                   stops=list(options.stops), logprobs=options.logprobs, top_logprobs=options.top_logprobs,
                   use_cache=options.cache, learn_tail=2 if chat else 1,
                   allow_unverified=options.allow_unverified or self.allow_unverified, grammar=grammar,
                   grammar_limits=self.limits.grammar)

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

    async def _recall(self, req: ChatRequest, segments: list[list[int]], texts: list[str],
                      tenant: Optional[str] = None) -> Optional[dict]:
        """Opt-in routing (``"graftmem": {"recall": true, "min_score": 0.4}``): the router picks ONE block
        for the last user message and its chain is put before the messages, as ``Memory.recall`` puts
        it before the task. The prefix cache then grafts it like any stored prefix (exact: the cold
        path prefills the same segments). Mutates ``segments`` / ``texts``; returns the receipt part.
        Only blocks ``tenant`` sees are routed to (`graftmem.memory.access`: its own and the shared ones)."""
        if not self.router.available:
            raise HTTPError(400, "this server was started without a router: routed recall is off",
                            param="graftmem.recall", code="recall_unavailable")
        min_score = req.options.min_score
        users = [m for m in req.messages if isinstance(m, dict) and m.get("role") == "user"]
        task = users[-1].get("content") if users else None
        if not isinstance(task, str) or not task.strip():
            raise HTTPError(400, "routed recall needs a last user message with text content", param="messages")
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
            desk.consent(block, req.options.allow_unverified or self.allow_unverified, chain)
        except GraftmemError as exc:
            raise HTTPError(400, str(exc), param="graftmem.allow_unverified", code=type(exc).__name__) from exc
        # the messages now follow the block: no second BOS
        segments[0] = self.engine0.tokenize(texts[0], add_special=False)
        segments[:0] = [list(b.tokens) for b in chain]
        texts[:0] = [b.text for b in chain]
        return {"recall": {"block_id": block.id, "score": hits[0].score, "min_score": min_score}}

    # ------------------------------------------------------------------ run
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

    async def answer(self, request: Request, job: Job) -> Optional[Result]:
        """Run ``job`` to its result for a non-streamed answer (None: the client went away, its decode
        was cancelled; the door answers 499). A client that goes away cancels the request: while it
        waits for an engine, and while it decodes (at the next token)."""
        gone = asyncio.ensure_future(client_gone(request))
        try:
            return await self._result(gone, job)
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

    async def _result(self, gone: "asyncio.Future[None]", job: Job) -> Optional[Result]:
        loop = asyncio.get_running_loop()
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
        await asyncio.wait((answered, done, gone), return_when=asyncio.FIRST_COMPLETED)
        if not (answered.done() or done.done()):
            job.cancel.set()  # the decode loop sees it at its next token and frees the engine
            return None
        # a graftmem error (the engine refused: context full, ...) keeps its class: `http.guarded` maps it
        return answered.result() if answered.done() else done.result()

    # ------------------------------------------------------------------ split
    def answer_spec(self, job: Optional[Job], tools: Optional[ToolSpec], reasoning: bool = True) -> AnswerSpec:
        """How the answer to ``job`` splits (`graftmem.server.tools.answer_spec`): the same for every
        door, streamed or not."""
        tail = job.texts[-1] if job is not None and job.texts else ""
        return answer_spec(self.template, tools, reasoning=reasoning, prompt_tail=tail)

    def split_answer(self, r: Result, job: Optional[Job], tools: Optional[ToolSpec], reasoning: bool = True) -> Answer:
        """The whole answer split into content, reasoning and tool calls (OpenAI's ``tool_calls``
        entries): the stream's parser (`graftmem.core.answers.AnswerParser`) fed at once, so a streamed
        and a whole answer cannot disagree; what every door turns into its own blocks."""
        return split_answer(r.text, self.answer_spec(job, tools, reasoning))

    @staticmethod
    def receipt(job: Job, r: Result) -> dict[str, Any]:
        """The receipt of a request: the engine's (what was grafted, from where) and what routing added."""
        return {**r.receipt.model_dump(mode="json"), **(job.extra or {})}
