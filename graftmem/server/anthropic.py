"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

What the ``anthropic`` package (and Claude Code, and any tool built on it) sends, with no change but
``base_url``. A thin adapter: a request is translated into the OpenAI chat form that
`graftmem.server.pipeline.ChatPipeline` already serves (`to_chat`), so it is rendered by the model's own
template, grafted from the prefix cache through the same verbs (consent first, provenance stamped),
bounded, queued and tenant-salted exactly like a chat completion; only the answer is formatted in
Anthropic's shape (content blocks, ``stop_reason``, the ``message_start`` ... ``message_stop`` events).

Translation: ``system`` (a string or text blocks) becomes the system message; text blocks are joined
with newlines; an assistant's ``tool_use`` blocks become its ``tool_calls``; a user's ``tool_result``
blocks become ``tool`` messages (before the user's own text, as the calls they answer came first);
``tools`` (``input_schema``) become function tools (``parameters``); ``tool_choice`` auto / any / tool
/ none become auto / required / the named function / none. ``thinking`` and ``redacted_thinking``
blocks of earlier turns are dropped (templates drop earlier reasoning too). Images and documents are
refused (400), as are ``top_k``, enabled ``thinking`` and ``output_config.format`` (structured
outputs), which this server cannot honour yet. Claude Code's billing line (`BILLING_HEADER`, whose
``cch`` changes on every request) is dropped from the system prompt: kept, no prefix would ever match.
docs/agents.md has the table of every field.

``cache_control`` breakpoints (on a system block, a tool, a content block, or at the top level) are
prefixes the client wants kept: `to_chat` turns them into prefixes of the chat messages, `ChatPipeline.chat_job`
into segment boundaries (a breakpoint inside a message moves to that message's end: blocks are cut per
message), and the prefix cache stores each one not stored yet at its first sighting
(`PrefixCache.learn_target`), from the request's own cells, after the answer.

Usage: the prompt in three parts that sum to it. ``cache_read_input_tokens``: tokens not prefilled
(grafted from a stored block, or kept in RAM from the previous request: the receipt's ``source`` says
which); ``cache_creation_input_tokens``: tokens this request writes to new blocks (`Result.created_tokens`:
a breakpoint's prefix, or a prefix learned on its second sighting; 0 when stored already);
``input_tokens``: the rest. A stream's ``message_start`` waits until the prompt's start is restored
(`Job.on_start`), so its usage already has the split.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ..core import jsontext
from .http import HTTPError, anthropic_error, guarded, in_band, sse
from .pipeline import RECEIPT_HEADER, ChatPipeline, job_events
from .tools import MAX_TOOLS, AnswerParser, ToolSpec

if TYPE_CHECKING:
    from .generate import Job, Result

__all__ = ["AnthropicRoutes", "BILLING_HEADER", "to_chat"]

log = logging.getLogger("graftmem")

#: How Claude Code's billing line starts: ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli;
#: cch=<5 hex digits>;`` as the first system block. ``cch`` changes on every request, so a prompt that
#: keeps it differs from the previous one at its first tokens and no prefix is ever found again. It is
#: metadata for Anthropic's own servers (which lift it out), not text for the model: that line is dropped
#: before rendering, as vLLM, SGLang and vllm-mlx drop it (llama-server blanks the ``cch`` value).
BILLING_HEADER = "x-anthropic-billing-header:"


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks (other block types are refused)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise HTTPError(400, f"{where} must be a string or a list of content blocks")
    parts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise HTTPError(400, f"{where}.{i}: only text blocks are supported here, got {kind!r}")
        parts.append(b["text"])
    return "\n".join(parts)


def _cache_control(b: Any, where: str) -> bool:
    """Whether block ``b`` carries a ``cache_control`` breakpoint (a malformed one is a 400). Its ``ttl``
    (``5m`` / ``1h``) is accepted: a stored block is kept until evicted, not for a time."""
    cc = b.get("cache_control") if isinstance(b, dict) else None
    if cc is None:
        return False
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral" or cc.get("ttl", "5m") not in ("5m", "1h"):
        raise HTTPError(400, f"{where}.cache_control must be {{\"type\": \"ephemeral\"}} (with an optional "
                        "\"ttl\" of \"5m\" or \"1h\")")
    return True


def _system_text(system: Any) -> tuple[str, bool]:
    """The system prompt's text without Claude Code's billing line (`BILLING_HEADER`), and whether one
    of its blocks carries a ``cache_control`` breakpoint."""
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system
    if not isinstance(blocks, list):
        raise HTTPError(400, "system must be a string or a list of content blocks")
    marked = any([_cache_control(b, f"system.{i}") for i, b in enumerate(blocks)])
    _text_of(blocks, "system")  # every block is a text block
    texts = [t for t in (_without_billing(b["text"]) for b in blocks) if t]
    return "\n".join(texts), marked


def _without_billing(text: str) -> str:
    """``text`` without a first line that is Claude Code's billing header (see `BILLING_HEADER`)."""
    if not text.startswith(BILLING_HEADER):
        return text
    return text.split("\n", 1)[1] if "\n" in text else ""


def _message(i: int, m: Any, marked: Optional[list[bool]] = None) -> list[dict[str, Any]]:
    """One Anthropic message as the OpenAI chat messages it stands for. ``marked`` receives whether one
    of its content blocks carries a ``cache_control`` breakpoint."""
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise HTTPError(400, f"{where}: a message needs role 'user' or 'assistant'")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise HTTPError(400, f"{where}.content must be a string or a list of content blocks")
    if marked is not None:
        marked.append(any([_cache_control(b, f"{where}.content.{j}") for j, b in enumerate(content)]))
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning: the model's template drops it as well
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                    not isinstance(b.get("input", {}), dict):
                raise HTTPError(400, f"{at}: tool_use needs a string id, a string name and an object input")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise HTTPError(400, f"{at}: tool_result needs a string tool_use_id")
            text = _text_of(b.get("content", ""), f"{at}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        else:
            raise HTTPError(400, f"{at}: content blocks of type {kind!r} are not supported on this server "
                            f"({role} messages take text{', tool_use' if role == 'assistant' else ', tool_result'})")
    out: list[dict[str, Any]] = list(results)
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise HTTPError(400, "tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                    "{\"type\": \"tool\", \"name\": ...}")


def to_chat(body: dict[str, Any], *, count_only: bool = False, marks: Optional[list[int]] = None) -> dict[str, Any]:
    """An Anthropic Messages request as the OpenAI chat request it means (400 on what it cannot mean).
    ``count_only``: for ``count_tokens``, which sends no ``max_tokens``. ``marks`` receives the request's
    ``cache_control`` breakpoints as prefixes of the chat messages (counts of messages, for
    `ChatPipeline.chat_job`): a tool's or a system block's is the end of the first message (the system
    prompt, where templates render the tools), a message's is the end of that message, a top-level
    ``cache_control`` (automatic caching) is the end of the last message."""
    if not count_only:
        mt = body.get("max_tokens")
        if mt is None:
            raise HTTPError(400, "max_tokens: Field required")
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise HTTPError(400, f"max_tokens must be a positive integer, got {mt!r}")
    if body.get("top_k") is not None:
        raise HTTPError(400, "top_k is not supported on this server (use temperature and top_p)")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise HTTPError(400, "thinking is not supported on this server: a model that reasons does so in its text")
    output = body.get("output_config")
    if isinstance(output, dict) and output.get("format") is not None:
        raise HTTPError(400, "output_config.format (structured outputs) is not supported on this server yet")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise HTTPError(400, "messages: a non-empty list of messages is required")
    chat: list[dict[str, Any]] = []
    found: list[int] = []
    system = body.get("system")
    if system is not None:
        text, marked = _system_text(system)
        if text:
            chat.append({"role": "system", "content": text})
        if marked:
            found.append(1)
    for i, m in enumerate(msgs):
        flags: list[bool] = []
        chat.extend(_message(i, m, flags))
        if any(flags):
            found.append(len(chat))
    if _cache_control(body, "request"):
        found.append(len(chat))
    out: dict[str, Any] = {"messages": chat, "max_tokens": 1 if count_only else body["max_tokens"]}
    temperature = body.get("temperature")
    if temperature is not None:
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 1:
            raise HTTPError(400, f"temperature must be a number in [0, 1], got {temperature!r}")
        out["temperature"] = temperature
    for name in ("top_p", "graftmem"):
        if body.get(name) is not None:
            out[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise HTTPError(400, "stop_sequences must be a list of strings")
        if stops:
            out["stop"] = stops
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise HTTPError(400, f"tools must be a list of up to {MAX_TOOLS} tools")
        fns = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
                raise HTTPError(400, f"tools.{i}: only custom tools with a name and an input_schema are supported")
            if _cache_control(t, f"tools.{i}"):
                found.append(1)
            fn: dict[str, Any] = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            fns.append({"type": "function", "function": fn})
        out["tools"] = fns
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None and tools:
        out["tool_choice"] = choice
    if marks is not None:
        marks.extend(sorted(set(found)))
    return out


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return sse(data, event=event)


def _usage(prompt: int, read: int, created: int, output: int) -> dict[str, Any]:
    """Anthropic's usage: the prompt counted in three parts that sum to it (read from the cache, written
    to new blocks, the rest)."""
    return {"input_tokens": prompt - read - created, "output_tokens": output,
            "cache_read_input_tokens": read, "cache_creation_input_tokens": created}


class AnthropicRoutes:
    """The Anthropic Messages door: a translator over the chat pipeline (`ChatPipeline`)."""

    def __init__(self, pipe: ChatPipeline) -> None:
        self.pipe = pipe

    def routes(self) -> list[BaseRoute]:
        home = str(self.pipe.store.home)
        return [Route("/v1/messages", guarded(self.messages, home), methods=["POST"]),
                Route("/v1/messages/count_tokens", guarded(self.count_tokens, home), methods=["POST"])]

    async def count_tokens(self, request: Request) -> Response:
        body = await self.pipe.read_json(request)
        self.pipe.bound(body.get("messages"))  # before translating: the chat door's limits, on the blocks too
        job = await self.pipe.chat_job(request, self.pipe.parse_chat(to_chat(body, count_only=True)))
        return JSONResponse({"input_tokens": sum(len(s) for s in job.segments)})

    async def messages(self, request: Request) -> Response:
        body = await self.pipe.read_json(request)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HTTPError(400, "stream must be a boolean")
        marks: list[int] = []
        self.pipe.bound(body.get("messages"))  # before translating: the chat door's limits, on the blocks too
        req = self.pipe.parse_chat(to_chat(body, marks=marks), marks)
        job, tools = await self.pipe.chat_job(request, req), req.tools
        mid = "msg_" + uuid.uuid4().hex[:24]
        if not stream:
            result = await self.pipe.answer(request, job)
            if result is None:
                return Response(status_code=499)
            receipt = self.pipe.receipt(job, result)
            answer = self.pipe.split_answer(result, job, tools)
            calls = answer.calls
            blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": answer.reasoning, "signature": ""}] \
                if answer.reasoning else []
            blocks += [{"type": "text", "text": answer.content}] if answer.content else []
            blocks += [self._tool_use(c) for c in calls]
            return JSONResponse({
                "id": mid, "type": "message", "role": "assistant", "model": self.pipe.model_id, "content": blocks,
                "stop_reason": self._stop_reason(result, calls), "stop_sequence": result.stop_sequence,
                "usage": self._usage(result), "graftmem": receipt}, headers={RECEIPT_HEADER: json.dumps(receipt)})
        loop = asyncio.get_running_loop()
        started: asyncio.Future[tuple[int, int]] = loop.create_future()

        def start(read: int, created: int) -> None:
            if not started.done():
                started.set_result((read, created))

        job.on_start = lambda read, created: loop.call_soon_threadsafe(start, read, created)
        events, done = await self.pipe.stream(job)  # a 429 is raised here, before the stream starts
        prompt = sum(len(s) for s in job.segments)
        return StreamingResponse(self._events(mid, prompt, job, tools, events, done, started),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ formatting
    @staticmethod
    def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
        try:  # arguments the model wrote as a JSON string may nest too deep to decode: then not an object
            args = jsontext.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                "input": args if isinstance(args, dict) else {"value": args}}

    @staticmethod
    def _stop_reason(r: "Result", calls: list[dict[str, Any]]) -> str:
        if calls:
            return "tool_use"
        if r.finish_reason == "length":
            return "max_tokens"
        return "stop_sequence" if r.stop_sequence is not None else "end_turn"

    @staticmethod
    def _usage(r: "Result") -> dict[str, Any]:
        return _usage(r.prompt_tokens, r.cached_tokens, r.created_tokens, len(r.tokens))

    async def _events(self, mid: str, prompt: int, job: "Job", tools: Optional[ToolSpec],
                      events: "asyncio.Queue[tuple[str, Any]]", done: "asyncio.Future[Result]",
                      started: "asyncio.Future[tuple[int, int]]") -> AsyncIterator[bytes]:
        """The stream: ``message_start`` (sent once the prompt's start is restored: its usage says what
        was read and what will be written), one text block (opened at the first text), then the tool_use
        blocks once the answer is complete (a call is only known whole), ``message_delta`` with the
        stop reason and the final usage, ``message_stop``."""
        parser = AnswerParser(self.pipe.answer_spec(job, tools))  # the answer's one parser, as the whole answer's
        index = 0
        open_kind: Optional[str] = None  # the block being streamed: "thinking" or "text"
        calls: list[dict[str, Any]] = []

        def blocks(events: list[Any]) -> bytes:
            nonlocal open_kind, index
            out = b""
            for e in events:
                if e.kind == "call":
                    calls.append(e.call)
                    continue
                kind = "thinking" if e.kind == "reasoning" else "text"
                if open_kind != kind:
                    if open_kind is not None:
                        out += _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                        index += 1
                    open_kind = kind
                    start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                        {"type": "text", "text": ""}
                    out += _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                        "content_block": start})
                delta = {"type": "thinking_delta", "thinking": e.text} if kind == "thinking" else \
                    {"type": "text_delta", "text": e.text}
                out += _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            return out

        try:
            await asyncio.wait((started, done), return_when=asyncio.FIRST_COMPLETED)
            read, created = started.result() if started.done() else (0, 0)
            yield _sse("message_start", {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": self.pipe.model_id, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt, read, created, 0)}})
            async for kind, payload in job_events(events, done):
                if kind == "delta":
                    if piece := blocks(parser.feed(payload[0])):
                        yield piece
                    continue
                result: "Result" = payload
                if rest := blocks(parser.finish()):
                    yield rest
                if open_kind is not None:
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                for call in calls:
                    use = self._tool_use(call)
                    yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": {**use, "input": {}}})
                    yield _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(use["input"])}})
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                yield _sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": self._stop_reason(result, calls),
                                                       "stop_sequence": result.stop_sequence},
                                             "usage": self._usage(result), "graftmem": self.pipe.receipt(job, result)})
                yield _sse("message_stop", {"type": "message_stop"})
                return
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, in the error map's terms
            yield _sse("error", anthropic_error(in_band(exc, self.pipe.store.home)))
        finally:
            job.cancel.set()  # a client that went away stops the decode at the next token
