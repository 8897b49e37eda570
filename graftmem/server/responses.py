"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``, with stored responses kept as verified KV chains.

What ``client.responses.create(...)`` (and the OpenAI Agents SDK's default model, and Codex) sends, with
no change but ``base_url``. A thin adapter: the request's ``instructions`` and ``input`` items become the
chat messages they stand for and are served by the chat pipeline (`graftmem.server.pipeline.ChatPipeline`) (the
model's template, the prefix cache, consent through `graftmem.memory.verbs.MemoryVerbs`, tenants,
bounds); only the answer is formatted as a Response (output items, the ``response.*`` stream events).

**Stored responses are KV chains.** With ``store`` (the default, as OpenAI's), the engine that generated
a response captures its cells after the last generated token (`graftmem.server.generate.EndState`: the
state of that very computation, never a re-prefill of text) and it is written as one automatic block
chained on the stored prefix the request was served from, its metadata holding the response (input
and output items). ``previous_response_id`` grafts that chain (or finds it still in the engine's RAM)
and prefills only what follows it: the end of the assistant's turn as the model's template puts it,
the new input, the generation header (`graftmem.server.chat.continuation_segments`). Nothing of the
conversation is rendered again, so a template that drops earlier reasoning, dates its system block or
moves the system prompt cannot make the stored state miss. Two responses continuing one response share
its blocks (each new block's parent is the continued one). On a fleet store the blocks (record included)
live in the bucket, so any worker continues any conversation.

**Exact** here means: the continued turn computes the bytes the process that generated the response
would compute had it kept its context and appended the same new tokens (same prefill calls) and decoded
(the receipt's first-step logits SHA-256 and the greedy answer are equal; tests/test_server_responses.py
checks it across a restart). It is not equal to re-sending the whole conversation as text, which is
prefilled in other calls and, for many templates, rendered differently.

When the request's ``instructions`` or ``tools`` differ from the stored response's (its chain holds
the old ones), the conversation is re-rendered from the stored items with the new ones and served like
any chat request (the prefix cache still applies); the receipt's ``response`` part says which way.

Retention: a stored response is automatic data of its tenant: its blocks count in ``--max-auto-mb``,
least recently used first (an evicted response is gone: 404), and it expires ``responses_ttl`` seconds
after it was created (`ResponseStore.sweep`). Another tenant's response id is a 404 everywhere.
Refused with a 400 naming the field: built-in tools, ``background``, ``conversation``, ``prompt``,
``include`` values, ``top_logprobs``, input images and files (docs/agents.md has the table).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ..core.errors import GraftmemError
from ..core.blocks import AUTO_KIND
from ..memory.verbs import first_untrusted
from ..store.chain import CALLS_KEY, chain_of
from .chat import continuation_segments
from .http import HTTPError, guarded, in_band, sse
from .pipeline import RECEIPT_HEADER, ChatPipeline, ChatRequest, job_events
from .prefix import Match
from .tenants import owner_of, tenant_of
from .tools import MAX_TOOLS, AnswerParser, ToolSpec

if TYPE_CHECKING:
    from ..core.blocks import Block
    from ..core.engine import Engine
    from .generate import EndState, Job, Result
    from .prefix import PrefixCache

__all__ = ["ResponsesRoutes", "ResponseStore", "DEFAULT_TTL"]

log = logging.getLogger("graftmem")

#: How long a stored response is kept by default (OpenAI keeps them 30 days).
DEFAULT_TTL = 30 * 24 * 3600.0

#: Fields accepted and not acted on (they change nothing a local model computes).
_IGNORED = ("metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
            "service_tier", "stream_options", "max_tool_calls", "model")
_SUPPORTED = ("input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
              "text", "stream", "store", "previous_response_id", "include", "truncation", "reasoning",
              "graftmem", "seed", "parallel_tool_calls")


def _bad(field: str, why: str, code: str = "unsupported_parameter") -> HTTPError:
    return HTTPError(400, f"{field}: {why}", param=field, code=code)


#: The longest id a request may name (a response, an item, a call): the ids this server makes are under
#: 64 characters, other servers' call ids about 30.
MAX_ID_CHARS = 256


def _id(field: str, value: Any) -> str:
    """An id a request names, checked before it is looked up, stored or echoed: a string UTF-8 can encode (a
    lone surrogate in ``previous_response_id`` was a 500: the 404 naming it could not be encoded), of at
    most `MAX_ID_CHARS` characters; else a 400 naming ``field``."""
    if not isinstance(value, str) or not value:
        raise _bad(field, f"must be a non-empty string, got {type(value).__name__}", "invalid_value")
    if len(value) > MAX_ID_CHARS:
        raise _bad(field, f"is {len(value)} characters, over the {MAX_ID_CHARS}-character limit of an id",
                   "invalid_value")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(field, "is not text UTF-8 can encode (a lone surrogate?)", "invalid_value") from None
    return value


def _not_found(rid: str, param: Optional[str] = None) -> HTTPError:
    return HTTPError(404, f"{param + ': ' if param else ''}Response with id '{rid[:80]}' not found.", param=param,
                     code="not_found",
                     name="BlockNotFound")


def _text_parts(content: Any, where: str) -> str:
    """The text of a message's content: a string, or ``input_text`` / ``output_text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "content must be a string or a list of content parts", "invalid_value")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise _bad(f"{where}[{j}].type", f"content parts of type {kind!r} are not supported on this server "
                       "(text only: input_text, output_text)")
    return "\n".join(out)


def items_to_messages(items: Any, where: str = "input") -> list[dict[str, Any]]:
    """Responses input items as the OpenAI chat messages they stand for (400 naming the item otherwise):
    messages (``input_text`` / ``output_text`` content; ``developer`` is ``system``), ``function_call``
    items (the assistant's ``tool_calls``, consecutive ones in one message) and ``function_call_output``
    items (``tool`` messages). Earlier ``reasoning`` items are dropped, as the templates drop them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad(where, "input must be a string or a list of items", "invalid_value")
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(it, dict):
            raise _bad(at, "an input item must be an object", "invalid_value")
        kind = it.get("type", "message" if "role" in it else None)
        if it.get("id") is not None:  # kept with the stored input items and listed by input_items
            _id(f"{at}.id", it["id"])
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{at}.role", f"role must be user, assistant, system or developer, got {role!r}",
                           "invalid_value")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_parts(it.get("content"), f"{at}.content")})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(it.get(k), str):
                    raise _bad(f"{at}.{k}", "a function_call item needs string call_id, name and arguments",
                               "invalid_value")
            _id(f"{at}.call_id", it["call_id"])
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)  # the same answer's text and calls
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _bad(f"{at}.call_id", "a function_call_output item needs a string call_id", "invalid_value")
            _id(f"{at}.call_id", it["call_id"])
            output = it.get("output")
            text = output if isinstance(output, str) else _text_parts(output, f"{at}.output")
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(f"{at}.type", f"input items of type {kind!r} are not supported on this server "
                       "(message, function_call, function_call_output, reasoning)")
    # leading system / developer messages are one system message (templates take one, first)
    lead = 0
    while lead < len(out) and out[lead]["role"] == "system":
        lead += 1
    if lead > 1:
        out[:lead] = [{"role": "system", "content": "\n\n".join(m["content"] for m in out[:lead])}]
    return out


def _chat_tools(tools: Any) -> Optional[list[dict[str, Any]]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list", "invalid_value")
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"tools holds {len(tools)} tools, over the limit of {MAX_TOOLS}", "invalid_value")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}].type", f"tools of type {kind!r} are not supported on this server (only "
                       "function tools: built-in tools such as web_search run on OpenAI's side)")
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}].name", "a function tool needs a name", "invalid_value")
        fn: dict[str, Any] = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
               "\"name\": ...} on this server")


def _response_format(text: Any) -> Optional[dict[str, Any]]:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "text must be an object such as {\"format\": {\"type\": \"text\"}}", "invalid_value")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise _bad("text.format.type", f"text.format of type {kind!r} is not supported (text, json_object, json_schema)")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat request it means, without its input (400 on what it cannot mean)."""
    for k in body:
        if k not in _SUPPORTED and k not in _IGNORED and body[k] is not None:
            if k in ("background", "conversation", "prompt", "top_logprobs", "context_management",
                     "prompt_cache_options"):
                if k == "background" and body[k] is False:
                    continue
                raise _bad(k, "not supported on this server")
            raise _bad(k, "unknown parameter", "unknown_parameter")
    include = body.get("include")
    if include:
        raise _bad("include", f"include values are not supported on this server, got {include!r}")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise _bad("truncation", "truncation must be 'disabled' or 'auto'", "invalid_value")
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())):
        raise _bad("reasoning", "reasoning options are not supported on this server: a model that reasons does "
                   "so in its text")
    out: dict[str, Any] = {}
    mt = body.get("max_output_tokens")
    if mt is not None:
        out["max_tokens"] = mt
    for k in ("temperature", "top_p", "seed", "graftmem"):
        if body.get(k) is not None:
            out[k] = body[k]
    tools = _chat_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        choice = _chat_tool_choice(body.get("tool_choice"))
        if choice is not None:
            out["tool_choice"] = choice
        if body.get("parallel_tool_calls") is not None:  # how many calls a forced answer may hold
            out["parallel_tool_calls"] = body["parallel_tool_calls"]
    else:
        _chat_tool_choice(body.get("tool_choice"))
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    return out


def _tools_key(chat: dict[str, Any]) -> Optional[str]:
    tools = chat.get("tools")
    return None if not tools else hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest()


def _sse(data: dict[str, Any]) -> bytes:
    return sse(data, event=data["type"])


class ResponseStore:
    """Stored responses: each is the last block of its chain (kind ``auto``, owned by its tenant), whose
    metadata ``response`` holds the record (the Response object, its input items, its turn as chat
    messages, what its prompt was rendered with). Found by id through an index rebuilt when the store
    changes, so a second process (or a server on the same fleet bucket) finds what another stored."""

    def __init__(self, store: Any, cache: Optional["PrefixCache"], *, ttl: Optional[float] = DEFAULT_TTL,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.cache, self.ttl, self.clock = store, cache, ttl, clock
        self._lock = threading.RLock()
        self._index: dict[str, str] = {}
        self._version: Optional[tuple[int, int]] = None
        self._next_sweep = 0.0

    def _refresh(self, force: bool = False) -> None:
        refresh = getattr(self.store, "refresh", None)
        if refresh is not None:  # a fleet store: see what other servers wrote to the bucket (polled)
            refresh(force=force)
        now = (self.store.data_version(), self.store.stats().blocks)
        with self._lock:
            if now == self._version:
                return
            index = {}
            for b in self.store.list(kind=AUTO_KIND):
                rec = b.metadata.get("response")
                if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                    index[rec["id"]] = b.id
            self._index, self._version = index, now

    def find(self, rid: str, tenant: Optional[str], *, deleted: bool = False) -> Optional[tuple["Block", dict]]:
        """The block and record of ``rid`` if ``tenant`` owns it (and, unless ``deleted``, it is neither
        deleted nor expired)."""
        if not isinstance(rid, str):
            return None
        self._refresh()
        bid = self._index.get(rid)
        if bid is None and hasattr(self.store, "refresh"):
            # a fleet store lists the bucket every poll interval: an id another worker stored a moment
            # ago is looked for now (a load balancer needs no stickiness)
            self._refresh(force=True)
            bid = self._index.get(rid)
        if bid is None:
            return None
        try:
            block = self.store.get(bid)
        except GraftmemError:
            return None
        rec = block.metadata.get("response")
        if not isinstance(rec, dict) or owner_of(block) != tenant:
            return None
        if not deleted and (rec.get("deleted") or self._expired(rec, self.clock())):
            return None
        return block, rec

    def _expired(self, rec: dict, now: float) -> bool:
        return self.ttl is not None and now - float(rec.get("created_at", 0)) >= self.ttl

    def history(self, rec: dict, tenant: Optional[str]) -> list[dict[str, Any]]:
        """The chat messages of the conversation up to and including ``rec``'s answer (its ancestors'
        turns first), for a request that must re-render it."""
        turns = [rec.get("messages", [])]
        seen = {rec.get("id")}
        prev = rec.get("previous_response_id")
        while prev:
            found = self.find(prev, tenant, deleted=True)
            if found is None or prev in seen or len(seen) > 4096:
                raise _not_found(prev, "previous_response_id")
            seen.add(prev)
            turns.append(found[1].get("messages", []))
            prev = found[1].get("previous_response_id")
        return [m for t in reversed(turns) for m in t]

    def put(self, job: "Job", end: "EndState", record: dict[str, Any], engine: "Engine") -> Optional["Block"]:
        """Write the response's last block (its parent: the chain its prompt was served from); ``engine``:
        one of the served model's (its vocabulary spells the block's name)."""
        if self.cache is None:
            return None
        n = end.parent.n_segments if end.parent is not None else 0
        parts = [*job.segments[:n], end.tokens]
        block = self.cache.store_captured(engine, parts, [*job.texts[:n], end.text], n,
                                          [end.state], end.parent, job.tenant,
                                          metadata={"response": record, CALLS_KEY: end.calls},
                                          response=record["id"], calls=[end.one_token],
                                          keys=job.keys_then(n, end.tokens))
        with self._lock:
            self._version = None
        return block

    def delete(self, block: "Block") -> None:
        """Remove a response: its block, or, when later responses continue it (their chains need its
        state), its record only (marked deleted: 404 from then on, the block goes with its last child)."""
        if self.store.children(block.id):
            rec = dict(block.metadata.get("response") or {})
            rec["deleted"] = True
            self.store.set_manifest(block.model_copy(update={"metadata": {**block.metadata, "response": rec}}))
        else:
            self.store.delete(block.id)
        with self._lock:
            self._version = None
        if self.cache is not None:
            self.cache.refresh(force=True)

    def maybe_sweep(self, every: float = 60.0) -> None:
        """`sweep` at most once per ``every`` seconds of the clock (it lists the automatic blocks)."""
        now = self.clock()
        if now >= self._next_sweep:
            self._next_sweep = now + every
            self.sweep(now)

    def sweep(self, now: Optional[float] = None) -> list[str]:
        """Expire responses older than ``ttl`` and drop deleted ones no chain needs any more; the ids of
        the blocks deleted. Bounded: each pass deletes at least one leaf or stops."""
        now = self.clock() if now is None else now
        removed: list[str] = []
        for _ in range(10_000):
            blocks = [b for b in self.store.list(kind=AUTO_KIND) if isinstance(b.metadata.get("response"), dict)]
            gone = [b for b in blocks if (b.metadata["response"].get("deleted") or
                                          self._expired(b.metadata["response"], now)) and not self.store.children(b.id)]
            if not gone:
                break
            for b in gone:
                try:
                    self.store.delete(b.id)
                    removed.append(b.id)
                except GraftmemError as exc:
                    log.warning("responses: could not delete expired block %s: %s", b.short_id, exc)
                    return removed
        if removed:
            with self._lock:
                self._version = None
            if self.cache is not None:
                self.cache.refresh(force=True)
            log.info("responses: %d stored response block(s) expired or deleted", len(removed))
        return removed


class ResponsesRoutes:
    """The Responses door (a translator over `ChatPipeline`) and the stored responses."""

    def __init__(self, pipe: ChatPipeline, *, ttl: Optional[float] = DEFAULT_TTL,
                 clock: Callable[[], float] = time.time) -> None:
        self.pipe = pipe
        self.stored = ResponseStore(pipe.store, pipe.cache, ttl=ttl, clock=clock)

    def routes(self) -> list[BaseRoute]:
        home = str(self.pipe.store.home)
        return [Route("/v1/responses", guarded(self.create, home), methods=["POST"]),
                Route("/v1/responses/{rid}", guarded(self.get, home), methods=["GET"]),
                Route("/v1/responses/{rid}", guarded(self.delete, home), methods=["DELETE"]),
                Route("/v1/responses/{rid}/input_items", guarded(self.input_items, home), methods=["GET"])]

    # ------------------------------------------------------------------ stored
    async def _find(self, request: Request, param: Optional[str] = None) -> tuple["Block", dict]:
        rid = _id("response_id", request.path_params["rid"])
        found = await asyncio.to_thread(self.stored.find, rid, tenant_of(request.scope))
        if found is None:
            raise _not_found(rid, param)
        return found

    async def get(self, request: Request) -> Response:
        _, rec = await self._find(request)
        return JSONResponse(rec["object"])

    async def delete(self, request: Request) -> Response:
        block, rec = await self._find(request)
        await asyncio.to_thread(self.stored.delete, block)
        return JSONResponse({"id": rec["id"], "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        _, rec = await self._find(request)
        items = list(rec.get("input_items", []))
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise _bad("order", "order must be 'asc' or 'desc'", "invalid_value")
        if order == "desc":
            items.reverse()
        after = request.query_params.get("after")
        if after:
            _id("after", after)
            ids = [it.get("id") for it in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            raise _bad("limit", "limit must be an integer", "invalid_value") from None
        page = items[:max(1, min(limit, 100))]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})

    # ------------------------------------------------------------------ create
    async def create(self, request: Request) -> Response:
        body = await self.pipe.read_json(request)
        stream = body.get("stream") or False
        store = body.get("store", True)
        if not isinstance(stream, bool):
            raise _bad("stream", "stream must be a boolean", "invalid_value")
        if store is None:
            store = True
        if not isinstance(store, bool):
            raise _bad("store", "store must be a boolean", "invalid_value")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _bad("instructions", "instructions must be a string on this server", "invalid_value")
        if body.get("input") is None:
            raise _bad("input", "input is required", "missing_required_parameter")
        self.pipe.bound(body["input"], "input")  # first: rendering is quadratic in the messages
        chat = to_chat(body)
        new = turn = items_to_messages(body["input"])  # ``turn``: this request's own messages, as stored
        if not new:
            raise _bad("input", "input has no message", "invalid_value")
        tenant = tenant_of(request.scope)
        prev_id = body.get("previous_response_id")
        rid = "resp_" + uuid.uuid4().hex
        info: dict[str, Any] = {}
        if prev_id is not None:
            _id("previous_response_id", prev_id)
            found = await asyncio.to_thread(self.stored.find, prev_id, tenant)
            if found is None:
                raise _not_found(prev_id, "previous_response_id")
            block, prec = found
            same = prec.get("system") == instructions and prec.get("tools_key") == _tools_key(chat)
            if same and (chat.get("graftmem") or {}).get("cache", True) is not False:
                job, tools = await self._continue_job(request, self.pipe.parse_chat({**chat, "messages": new}), block,
                                                      instructions)
                info = {"previous_response_id": prev_id, "chain": block.id, "chain_tokens": block.pos_end,
                        "continued": True}
            else:
                history = await asyncio.to_thread(self.stored.history, prec, tenant)
                system = [{"role": "system", "content": instructions}] if instructions else []
                req = self.pipe.parse_chat({**chat, "messages": system + history + new})
                job, tools = await self.pipe.chat_job(request, req), req.tools
                info = {"previous_response_id": prev_id, "chain": None, "continued": False,
                        "why": "instructions or tools differ from the stored response's (or graftmem.cache is "
                               "false): the conversation was re-rendered from its items"}
        else:
            system = [{"role": "system", "content": instructions}] if instructions else []
            if system and new[0]["role"] == "system":
                new = [{"role": "system", "content": f"{instructions}\n\n{new[0]['content']}"}, *new[1:]]
                system = []
            req = self.pipe.parse_chat({**chat, "messages": system + new})
            job, tools = await self.pipe.chat_job(request, req), req.tools
        job.extra = {**(job.extra or {}), "response": info} if info else job.extra
        created = int(time.time())
        obj = self._object(rid, created, body, instructions, store)
        input_items = self._input_items(rid, body["input"])
        record_base = {"id": rid, "created_at": self.stored.clock(), "input_items": input_items,
                       "previous_response_id": prev_id, "system": instructions, "tools_key": _tools_key(chat)}
        job.capture_end = store and self.pipe.cache is not None
        state: dict[str, Any] = {}

        def on_end(result: "Result", end: Optional["EndState"]) -> None:
            final = self._complete(obj, result, tools, job)
            state["final"] = final
            if not store or end is None:
                final["store"] = False
                return
            out_msgs = self._output_messages(final["output"])
            record = {**record_base, "object": final, "messages": turn + out_msgs}
            if self.stored.put(job, end, record, self.pipe.pool.engines[0]) is None:
                final["store"] = False
            if self.stored.ttl is not None:
                self.stored.maybe_sweep()

        job.on_end = on_end
        if not stream:
            result = await self.pipe.answer(request, job)
            if result is None:
                return Response(status_code=499)
            final = state.get("final") or self._complete(obj, result, tools, job)
            return JSONResponse(final, headers={RECEIPT_HEADER: json.dumps(final["graftmem"])})
        events, done = await self.pipe.stream(job)  # a 429 is raised here, before the stream starts
        return StreamingResponse(self._events(obj, job, tools, events, done, state),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _continue_job(self, request: Request, req: ChatRequest, block: "Block",
                            system: Optional[str]) -> tuple["Job", Optional[ToolSpec]]:
        """The job of a turn that continues a stored response: its chain's blocks are the prompt's first
        segments (grafted, or kept in RAM), the continuation of ``req.messages`` (`continuation_segments`)
        the rest."""
        pipe, tools = self.pipe, req.tools

        def build() -> tuple[list[Any], list[str], list[list[int]]]:
            chain = chain_of(pipe.store, block)
            texts, segs = continuation_segments(pipe.engine0, pipe.template, pipe.fmt, system, req.messages, tools,
                                                cache=pipe.tokens, pool=pipe.renders)
            return chain, texts, segs

        chain, texts, segs = await pipe.budgeted(build)
        if not segs:
            raise _bad("input", "input renders as nothing to add to the conversation", "invalid_value")
        job = await pipe.job(req.options, [list(b.tokens) for b in chain] + segs, [b.text for b in chain] + texts,
                             chat=True, tools=tools)
        job.tenant = tenant_of(request.scope)
        job.base = Match(block, len(chain), block.pos_end, tuple(chain), first_untrusted(chain))
        if pipe.cache is not None:
            pipe.cache.touch([b.id for b in chain])
        return job, tools

    # ------------------------------------------------------------------ formatting
    def _object(self, rid: str, created: int, body: dict[str, Any], instructions: Optional[str],
                store: bool) -> dict[str, Any]:
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        return {"id": rid, "object": "response", "created_at": created, "status": "in_progress", "error": None,
                "incomplete_details": None, "instructions": instructions,
                "max_output_tokens": body.get("max_output_tokens"), "model": self.pipe.model_id, "output": [],
                "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
                "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
                "store": store, "temperature": body.get("temperature", 1.0), "text": {"format": fmt or {"type": "text"}},
                "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                "top_p": body.get("top_p", 1.0), "truncation": body.get("truncation") or "disabled", "usage": None,
                "user": body.get("user"), "metadata": body.get("metadata") or {}}

    @staticmethod
    def _input_items(rid: str, items: Any) -> list[dict[str, Any]]:
        if isinstance(items, str):
            items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
        out = []
        for i, it in enumerate(items):
            it = dict(it)
            it.setdefault("type", "message")
            it.setdefault("id", f"item_{rid[5:]}_{i}")
            if it["type"] == "message" and isinstance(it.get("content"), str):
                it["content"] = [{"type": "input_text", "text": it["content"]}]
            out.append(it)
        return out

    def _output(self, rid: str, result: "Result", tools: Optional[ToolSpec], job: "Job") -> list[dict[str, Any]]:
        answer = self.pipe.split_answer(result, job, tools)  # the stream's parser fed at once
        content, calls, thought = answer.content, answer.calls, answer.reasoning
        status = "incomplete" if result.finish_reason == "length" else "completed"
        items: list[dict[str, Any]] = []
        if content or not calls:
            items.append({"id": f"msg_{rid[5:]}", "type": "message", "role": "assistant", "status": status,
                          "content": [{"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}]})
        if thought:  # after the message: a stream sends the message's text first, at output_index 0
            items.append({"id": f"rs_{rid[5:]}", "type": "reasoning", "summary": [],
                          "content": [{"type": "reasoning_text", "text": thought}], "status": status})
        for j, c in enumerate(calls):
            items.append({"id": f"fc_{rid[5:]}_{j}", "type": "function_call", "status": "completed",
                          "call_id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        return items

    def _complete(self, obj: dict[str, Any], result: "Result", tools: Optional[ToolSpec], job: "Job") -> dict[str, Any]:
        out = dict(obj)
        out["output"] = self._output(obj["id"], result, tools, job)
        length = result.finish_reason == "length"
        out["status"] = "incomplete" if length else "completed"
        out["incomplete_details"] = {"reason": "max_output_tokens"} if length else None
        out["usage"] = {"input_tokens": result.prompt_tokens,
                        "input_tokens_details": {"cached_tokens": result.cached_tokens},
                        "output_tokens": len(result.tokens), "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": result.prompt_tokens + len(result.tokens)}
        out["graftmem"] = self.pipe.receipt(job, result)
        return out

    @staticmethod
    def _output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The answer as the chat messages a re-render of the conversation puts after its prompt."""
        return items_to_messages([it for it in output if it["type"] != "reasoning"], "output")

    async def _events(self, obj: dict[str, Any], job: "Job", tools: Optional[ToolSpec],
                      events: "asyncio.Queue[tuple[str, Any]]", done: "asyncio.Future[Result]",
                      state: dict[str, Any]) -> AsyncIterator[bytes]:
        """``response.created``, ``response.in_progress``, the message item opened at the first text
        (``output_item.added``, ``content_part.added``, ``output_text.delta`` ...), closed at the end, then
        each function call as one item (``function_call_arguments.delta`` / ``.done``: a call is only
        known whole), ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``)."""
        parser = AnswerParser(self.pipe.answer_spec(job, tools))  # the whole answer's parser, fed as it arrives
        seq = 0
        msg_id = f"msg_{obj['id'][5:]}"
        text_open = False
        streamed: list[str] = []

        def ev(kind: str, **data: Any) -> bytes:
            nonlocal seq
            seq += 1
            return _sse({"type": kind, "sequence_number": seq - 1, **data})

        def open_text() -> bytes:
            nonlocal text_open
            text_open = True
            item = {"id": msg_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            return (ev("response.output_item.added", output_index=0, item=item) +
                    ev("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

        try:
            yield ev("response.created", response=obj)
            yield ev("response.in_progress", response=obj)
            async for kind, payload in job_events(events, done):
                if kind == "delta":
                    piece = "".join(e.text for e in parser.feed(payload[0]) if e.kind == "content")
                    if piece:
                        out = b"" if text_open else open_text()
                        streamed.append(piece)
                        yield out + ev("response.output_text.delta", item_id=msg_id, output_index=0,
                                       content_index=0, delta=piece, logprobs=[])
                    continue
                result: "Result" = payload
                final = state.get("final") or self._complete(obj, result, tools, job)
                items = final["output"]
                msg = next((it for it in items if it["type"] == "message"), None)
                index = 0
                if msg is not None:
                    text = msg["content"][0]["text"]
                    have = "".join(streamed)
                    if not text_open:
                        yield open_text()
                    if text.startswith(have) and len(text) > len(have):
                        yield ev("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                 delta=text[len(have):], logprobs=[])
                    part = msg["content"][0]
                    yield ev("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
                             text=text, logprobs=[])
                    yield ev("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
                    yield ev("response.output_item.done", output_index=0, item=msg)
                    index = 1
                for it in items[index:]:
                    if it["type"] == "function_call":
                        yield ev("response.output_item.added", output_index=index,
                                 item={**it, "arguments": "", "status": "in_progress"})
                        yield ev("response.function_call_arguments.delta", item_id=it["id"], output_index=index,
                                 delta=it["arguments"])
                        yield ev("response.function_call_arguments.done", item_id=it["id"], output_index=index,
                                 arguments=it["arguments"], name=it["name"])
                    else:
                        yield ev("response.output_item.added", output_index=index, item=it)
                    yield ev("response.output_item.done", output_index=index, item=it)
                    index += 1
                kind_done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield ev(kind_done, response=final)
                return
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, in the error map's terms
            err = in_band(exc, self.pipe.store.home)
            yield ev("error", code=err.code, message=err.message, param=err.param)
        finally:
            job.cancel.set()
