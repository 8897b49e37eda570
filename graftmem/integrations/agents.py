"""An OpenAI Agents SDK ``Session`` whose conversation is a chain of stored Responses on a ``graftmem
serve`` (extra ``graftmem[agents]``).

Why: an Agents SDK session (``SQLiteSession``, ``RedisSession``) keeps the items and the runner sends
the whole history with every turn, so the server prefills the conversation again, or renders it anew
and finds its cache missed. graftmem stores each response as a verified KV chain (prompt and generated
tokens, never re-rendered: `graftmem.server.responses`) and ``previous_response_id`` grafts it, so
a turn prefills only what is new. This session keeps a pointer to the last stored response of its
conversation (its *head*), and the model it hands out (`GraftmemSession.model`) sends each turn as
``previous_response_id=<head>`` plus the items that follow it. The history is read back from the
server (each response's input items and output), so a new process with the same ``path`` resumes the
conversation, and the server grafts it, after either side restarted.

The runner still sees an ordinary session: `get_items` gives the whole history, `add_items` records
what the run added. The model rewrites a request only where its leading items are exactly a stored
chain's (compared by role, text, call id, name and arguments); anything else goes out whole, as any
session's would. Items added without a model call (``add_items`` by hand, ``pop_item``) are kept as a
*tail* in ``path`` and sent with the next turn. The heads file holds ids only, never text; one process
writes a session at a time (as with ``SQLiteSession``'s file).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Sequence

try:
    from agents import OpenAIResponsesModel
    from agents.memory import SessionSettings
    from openai import AsyncOpenAI
except ImportError as exc:  # the extra is missing: say which one
    raise ImportError("graftmem's Agents SDK session needs openai-agents: pip install 'graftmem[agents]'") from exc

from ..store import atomic_file

__all__ = ["GraftmemSession", "GraftmemResponsesModel"]

#: Item fields that say what an item is (ids, statuses and annotations vary between the SDK's copy and
#: the server's and say nothing about the conversation)
_MESSAGE, _CALL, _OUTPUT = "message", "function_call", "function_call_output"


def _plain(item: Any) -> dict[str, Any]:
    if isinstance(item, dict):
        return item
    dump = getattr(item, "model_dump", None)
    return dump(exclude_unset=True, mode="json") if dump is not None else dict(item)


def _key(item: Any) -> tuple:
    """What an item says, for comparing the runner's copy of a history with the server's."""
    d = _plain(item)
    kind = d.get("type") or (_MESSAGE if "role" in d else None)
    if kind == _MESSAGE:
        content = d.get("content")
        text = content if isinstance(content, str) else "".join(
            str(p.get("text", "")) for p in (content or []) if isinstance(p, dict))
        return (_MESSAGE, d.get("role"), text)
    if kind == _CALL:
        return (_CALL, d.get("call_id"), d.get("name"), d.get("arguments"))
    if kind == _OUTPUT:
        out = d.get("output")
        return (_OUTPUT, d.get("call_id"), out if isinstance(out, str) else json.dumps(out, sort_keys=True))
    return (kind, json.dumps({k: v for k, v in d.items() if k not in ("id", "status")}, sort_keys=True, default=str))


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """A stored response's output item as the input item the runner would hold for it."""
    if item.get("type") == _MESSAGE:
        return {"type": _MESSAGE, "role": item.get("role", "assistant"), "id": item.get("id"),
                "status": item.get("status", "completed"),
                "content": [{"type": "output_text", "text": p.get("text", ""), "annotations": []}
                            for p in item.get("content") or [] if isinstance(p, dict)]}
    return {k: v for k, v in item.items() if v is not None}


class GraftmemSession:
    """An Agents SDK session (the ``Session`` protocol) backed by stored Responses chains.

    ``session_id`` names the conversation; ``client`` is the `AsyncOpenAI` client of the ``graftmem serve``
    that stores it (``base_url=.../v1``, the tenant's key); ``path`` a JSON file keeping each session's head
    response id and tail (None: kept in this object only). Run the agent with `model` (or give
    `GraftmemResponsesModel` this session): that is what sends ``previous_response_id``."""

    session_settings: Optional[SessionSettings] = None

    def __init__(self, session_id: str, client: AsyncOpenAI, *, path: "str | os.PathLike[str] | None" = None,
                 session_settings: Optional[SessionSettings] = None) -> None:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty str")
        self.session_id, self.client = session_id, client
        self.path = Path(path) if path is not None else None
        self.session_settings = session_settings
        self._lock = threading.Lock()
        state = self._load().get(session_id, {})
        self.head: Optional[str] = state.get("head")
        self.tail: list[dict[str, Any]] = list(state.get("tail", []))
        #: chains the model knows: (the items a stored response covers, its id), longest matched first
        self._chains: list[tuple[list[tuple], str]] = []
        self._pending: Optional[str] = None
        self._seen: list[dict[str, Any]] = []  #: the history the head covers, as last read
        self._read: dict[str, tuple[list[dict[str, Any]], Optional[str]]] = {}  #: response id -> items, previous

    # ------------------------------------------------------------------ the heads file
    def _load(self) -> dict[str, Any]:
        if self.path is None or not self.path.exists():
            return {}
        data = json.loads(self.path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}

    def _save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            data = self._load()
            if self.head is None and not self.tail:
                data.pop(self.session_id, None)
            else:
                data[self.session_id] = {"head": self.head, "tail": self.tail}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(self.path) as f:  # atomic: a crash leaves the old file
                f.write(json.dumps(data).encode("utf-8"))

    # ------------------------------------------------------------------ the chain on the server
    async def _chain(self) -> list[tuple[str, list[dict[str, Any]]]]:
        """(response id, the items it covers: its input items then its output), oldest first."""
        out: list[tuple[str, list[dict[str, Any]]]] = []
        rid, seen = self.head, set[str]()
        while rid is not None and rid not in seen and len(seen) < 10_000:
            seen.add(rid)
            known = self._read.get(rid)  # a stored response never changes: read once per session object
            if known is None:
                resp = await self.client.responses.retrieve(rid)
                items = [_plain(it) async for it in self.client.responses.input_items.list(rid, order="asc", limit=100)]
                items += [_as_input(_plain(it)) for it in resp.output if _plain(it).get("type") != "reasoning"]
                known = self._read[rid] = (items, resp.previous_response_id)
            out.append((rid, known[0]))
            rid = known[1]
        out.reverse()
        return out

    async def _history(self) -> list[dict[str, Any]]:
        chain = await self._chain()
        items: list[dict[str, Any]] = []
        self._chains = []
        for rid, covered in chain:
            items += covered
            self._chains.append(([_key(i) for i in items], rid))
        self._seen = list(items)
        return items

    # ------------------------------------------------------------------ the Session protocol
    async def get_items(self, limit: Optional[int] = None) -> list[Any]:
        items = await self._history() + list(self.tail)
        return items[-limit:] if limit else items

    async def add_items(self, items: list[Any]) -> None:
        """What a run added. Where the model stored a response covering the history, this run's input and
        what came before the response's output, the head moves to it; the items after it (a final tool
        output, items added by hand) stay in the tail, sent with the next turn."""
        everything = [*self._seen, *self.tail, *(_plain(i) for i in items)]
        head = self._pending
        covered = next((k for k, rid in reversed(self._chains) if rid == head), None) if head else None
        if covered is not None and len(everything) >= len(covered) and \
                [_key(i) for i in everything[:len(covered)]] == covered:
            self.head, self._seen, self.tail = head, everything[:len(covered)], everything[len(covered):]
            self._pending = None
        else:  # nothing stored lines up with these items (yet): they wait in the tail
            self.tail = everything[len(self._seen):]
        self._save()

    async def pop_item(self) -> Optional[Any]:
        if self.tail:
            item = self.tail.pop()
            self._save()
            return item
        chain = await self._chain()
        if not chain:
            return None
        rid, items = chain[-1]
        self.head = self._read[rid][1]  # the last response's other items go back to the tail
        self.tail = items[:-1]
        self._seen = [i for _, its in chain[:-1] for i in its]
        self._save()
        return items[-1] if items else None

    async def clear_session(self) -> None:
        self.head, self.tail, self._chains, self._pending, self._seen = None, [], [], None, []
        self._save()

    def fork(self, session_id: str) -> "GraftmemSession":
        """A new session that continues this conversation (both share its stored chain)."""
        other = GraftmemSession(session_id, self.client, path=self.path, session_settings=self.session_settings)
        other.head, other.tail = self.head, list(self.tail)
        other._save()
        return other

    def model(self, model: str = "default") -> "GraftmemResponsesModel":
        """The Responses model that continues this session's stored chain (``Agent(model=...)``)."""
        return GraftmemResponsesModel(model, self.client, session=self)

    # ------------------------------------------------------------------ for the model
    def _continue(self, items: list[Any]) -> tuple[Optional[str], list[Any]]:
        """The stored response whose items lead ``items``, and what follows them (or (None, items))."""
        keys = [_key(i) for i in items]
        for covered, rid in sorted(self._chains, key=lambda c: -len(c[0])):
            if covered and len(covered) <= len(keys) and keys[:len(covered)] == covered:
                return rid, items[len(covered):]
        return None, items

    def _stored(self, sent: Sequence[Any], rid: str, output: Sequence[Any]) -> None:
        """A response the model got (``sent``: the whole input it stands for): a chain to continue."""
        covered = [_key(i) for i in sent] + [_key(_as_input(_plain(o))) for o in output
                                              if _plain(o).get("type") != "reasoning"]
        self._chains.append((covered, rid))
        self._pending = rid


class GraftmemResponsesModel(OpenAIResponsesModel):
    """`OpenAIResponsesModel` for a `GraftmemSession`: a request whose leading items are a stored response's
    goes out as ``previous_response_id`` and the items after it; the server grafts the chain."""

    def __init__(self, model: str, openai_client: AsyncOpenAI, *, session: GraftmemSession) -> None:
        super().__init__(model, openai_client)
        self.session = session

    def _split(self, input: Any, previous_response_id: Optional[str]) -> tuple[Optional[str], Any]:
        if previous_response_id is not None or isinstance(input, str):
            return previous_response_id, input
        rid, rest = self.session._continue(list(input))
        return (rid, rest) if rid is not None and rest else (None, input)

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any, tools: Any,
                           output_schema: Any, handoffs: Any, tracing: Any, previous_response_id: Optional[str] = None,
                           conversation_id: Optional[str] = None, prompt: Any = None) -> Any:
        rid, rest = self._split(input, previous_response_id)
        got = await super().get_response(system_instructions, rest, model_settings, tools, output_schema, handoffs,
                                         tracing, previous_response_id=rid, conversation_id=conversation_id,
                                         prompt=prompt)
        if got.response_id and not isinstance(input, str):
            self.session._stored(list(input), got.response_id, got.output)
        return got

    async def stream_response(self, system_instructions: Any, input: Any, model_settings: Any, tools: Any,
                              output_schema: Any, handoffs: Any, tracing: Any,
                              previous_response_id: Optional[str] = None, conversation_id: Optional[str] = None,
                              prompt: Any = None) -> AsyncIterator[Any]:
        rid, rest = self._split(input, previous_response_id)
        async for event in super().stream_response(system_instructions, rest, model_settings, tools, output_schema,
                                                   handoffs, tracing, previous_response_id=rid,
                                                   conversation_id=conversation_id, prompt=prompt):
            done = getattr(event, "response", None) if getattr(event, "type", None) == "response.completed" else None
            if done is not None and not isinstance(input, str):
                self.session._stored(list(input), done.id, done.output)
            yield event
