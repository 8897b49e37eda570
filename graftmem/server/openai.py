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
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ..memory import validate as check
from .chat import chunk_prompt
from .generate import Job, Result
from .http import HTTPError, guarded, in_band, off_loop, sse
from .pipeline import RECEIPT_HEADER, ChatPipeline, job_events, read_options
from .tenants import tenant_of
from .tools import AnswerParser, ToolSpec

__all__ = ["OpenAIRoutes"]


class OpenAIRoutes:
    """The OpenAI-compatible API: translators in and out of the chat pipeline (`graftmem.server.pipeline`)."""

    def __init__(self, pipe: ChatPipeline) -> None:
        self.pipe = pipe
        self.model_id = pipe.model_id
        self.created = int(time.time())

    def routes(self) -> list[BaseRoute]:
        home = str(self.pipe.store.home)
        return [Route("/v1/models", guarded(self.models, home), methods=["GET"]),
                Route("/v1/chat/completions", guarded(self.chat, home), methods=["POST"]),
                Route("/v1/completions", guarded(self.completions, home), methods=["POST"])]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "graftmem"}]})

    async def chat(self, request: Request) -> Response:
        body = await self.pipe.read_json(request)
        req = self.pipe.parse_chat(body)
        job = await self.pipe.chat_job(request, req)
        return await self._serve(request, job, req.options, chat=True, tools=req.tools)

    async def completions(self, request: Request) -> Response:
        body = await self.pipe.read_json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise HTTPError(400, "prompt must be a non-empty string (one prompt per request)", param="prompt")
        check.text("prompt", prompt)
        engine = self.pipe.engine0
        options = read_options(body, chat=False, n_ctx=engine.n_ctx)

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
        job = await self.pipe.job(options, segments, texts, chat=False)
        job.tenant = tenant_of(request.scope)
        return await self._serve(request, job, options, chat=False)

    async def _serve(self, request: Request, job: Job, options: Any, *, chat: bool,
                     tools: Optional[ToolSpec] = None) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not options.stream:
            result = await self.pipe.answer(request, job)
            if result is None:
                return Response(status_code=499)
            receipt = self.pipe.receipt(job, result)
            payload = self._final(rid, created, result, receipt, job, chat=chat, tools=tools, reasoning=options.reasoning)
            return JSONResponse(payload, headers={RECEIPT_HEADER: json.dumps(receipt)})
        events, done = await self.pipe.stream(job)  # 429 here, before the stream starts
        # the answer's one parser (`graftmem.core.answers`): reasoning, content and calls as they arrive
        parser = AnswerParser(self.pipe.answer_spec(job, tools, options.reasoning)) if chat else None
        return StreamingResponse(self._sse(rid, created, job, events, done, chat=chat, usage=options.include_usage,
                                           parser=parser),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

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
                            graftmem=self.pipe.receipt(job, result))
                if usage:
                    yield chunk({}, usage=self._usage(result))
                yield b"data: [DONE]\n\n"
                return
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, in the error map's terms
            err = in_band(exc, self.pipe.store.home)
            yield sse({"error": {"message": err.message, "type": "server_error" if err.status >= 500 else
                                 "invalid_request_error", "param": err.param, "code": err.code}})
        finally:
            job.cancel.set()  # a client that went away stops the decode at the next token

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
            answer = self.pipe.split_answer(r, job, tools, reasoning)
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

