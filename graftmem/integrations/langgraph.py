"""LangGraph on graftmem (extra ``graftmem[langgraph]``): a ``BaseStore`` whose items are blocks and a
checkpointer whose threads' conversations are stored KV chains.

`GraftmemStore`: a LangGraph long-term memory store on a ``graftmem serve`` (its memory REST routes,
through `graftmem.api.RemoteJSON`, under the server's keys and tenants). An item is a block: its text
(``namespace/key: <value["text"]>`` and the value's other fields, one per line: two keys with the same
text stay apart, and a changed field is a changed block) is learned once, as a chat block, in the scope ``agent_id="langgraph"``,
``user_id="<namespace joined by />"``; the value itself rides in the block's metadata. ``search`` with a
``query`` is the server's router (scores are its), without one a listing; `GraftmemStore.recall` routes a
task to one item of a namespace, grafts its KV state and answers after it, with the receipt. Putting a
key again learns the new text and deletes the old block.

`GraftmemCheckpointer`: LangGraph's in-memory saver made durable (``path``: one JSON file, rewritten
atomically after each change; bytes as base64, never pickle) and aware of graftmem's stored responses.
A graph whose model is ``ChatOpenAI(base_url=<graftmem serve>/v1, use_responses_api=True,
use_previous_response_id=True)`` keeps each answer's response id in its ``AIMessage``; when the thread
resumes (a new process reading ``path``), LangChain sends ``previous_response_id`` and only the messages
after it, and the server grafts the stored chain (prompt and generated tokens, never re-rendered:
`graftmem.server.responses`) instead of prefilling the conversation. With ``url``, a resumed thread
whose last response the server no longer holds (expired, evicted, deleted: a 404) is handed back
without those ids, so the next call sends the whole conversation instead of failing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

try:
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.store.base import (BaseStore, GetOp, Item, ListNamespacesOp, Op, PutOp, Result, SearchItem,
                                      SearchOp)
except ImportError as exc:  # the extra is missing: say which one
    raise ImportError("graftmem's LangGraph store and checkpointer need langgraph: "
                      "pip install 'graftmem[langgraph]'") from exc

from .. import BlockNotFound
from ..api import RemoteJSON
from ..store import atomic_file

__all__ = ["GraftmemCheckpointer", "GraftmemStore", "ITEM_KIND"]

#: The kind of the blocks that hold store items.
ITEM_KIND = "langgraph"
_AGENT = "langgraph"


def _when(text: Any) -> datetime:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return datetime.now(timezone.utc)


class GraftmemStore(BaseStore):
    """LangGraph's ``BaseStore`` on the ``graftmem serve`` at ``url`` (``api_key``: the tenant's key)."""

    supports_ttl = False

    def __init__(self, url: str, *, api_key: Optional[str] = None, timeout: float = 300.0) -> None:
        self.remote = RemoteJSON(url, api_key=api_key, timeout=timeout)
        self._manifests: dict[str, dict[str, Any]] = {}  # block id -> manifest (a block never changes)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ mapping
    @staticmethod
    def _scope(namespace: tuple[str, ...]) -> str:
        if not namespace or any(not isinstance(p, str) or not p or "/" in p for p in namespace):
            raise ValueError(f"a graftmem store namespace is non-empty labels without '/', got {namespace!r}")
        return "/".join(namespace)

    def _manifest(self, bid: str) -> dict[str, Any]:
        with self._lock:
            got = self._manifests.get(bid)
        if got is None:
            got = self.remote.get(bid)
            got.pop("tokens", None)
            with self._lock:
                self._manifests[bid] = got
        return got

    def _item(self, manifest: dict[str, Any], score: Optional[float] = None) -> Optional[Item]:
        rec = (manifest.get("metadata") or {}).get(ITEM_KIND)
        if manifest.get("kind") != ITEM_KIND or not isinstance(rec, dict):
            return None
        when = _when(manifest.get("created_at"))
        args = dict(value=rec["value"], key=rec["key"], namespace=tuple(rec["namespace"]), created_at=when,
                    updated_at=when)
        return SearchItem(**args, score=score) if score is not None else Item(**args)

    def _block_of(self, namespace: tuple[str, ...], key: str) -> Optional[dict[str, Any]]:
        for s in self.remote.ls(kind=ITEM_KIND, user_id=self._scope(namespace), agent_id=_AGENT):
            if s["name"] == key:
                m = self._manifest(s["id"])
                rec = (m.get("metadata") or {}).get(ITEM_KIND) or {}
                if tuple(rec.get("namespace", ())) == tuple(namespace) and rec.get("key") == key:
                    return m
        return None

    def _items(self) -> list[Item]:
        out = []
        for s in self.remote.ls(kind=ITEM_KIND):
            item = self._item(self._manifest(s["id"]))
            if item is not None:
                out.append(item)
        return out

    # ------------------------------------------------------------------ ops
    def _get(self, op: GetOp) -> Optional[Item]:
        m = self._block_of(tuple(op.namespace), op.key)
        return self._item(m) if m is not None else None

    def _put(self, op: PutOp) -> None:
        ns = tuple(op.namespace)
        old = self._block_of(ns, op.key)
        if op.value is not None:
            got = self.remote.learn(self._text(ns, op.key, op.value), name=op.key, kind=ITEM_KIND, chat=True,
                                    metadata={ITEM_KIND: {"namespace": list(ns), "key": op.key, "value": op.value}},
                                    user_id=self._scope(ns), agent_id=_AGENT)
            if old is not None and old["id"] == got["block"]["id"]:
                return
        if old is not None:
            try:
                self.remote.delete(old["id"], cascade=True)
            except BlockNotFound:
                pass

    def _text(self, namespace: tuple[str, ...], key: str, value: Mapping[str, Any]) -> str:
        """What the block holds: ``namespace/key: <value["text"]>`` and the value's other fields one per
        line (sorted, as JSON). Every field is in the text, so a changed value is another block (blocks are
        content-addressed: a value kept only in the metadata of an unchanged text would not be stored)."""
        text = value.get("text")
        rest = {k: v for k, v in value.items() if k != "text"} if isinstance(text, str) else dict(value)
        lines = [f"{self._scope(namespace)}/{key}:" + (f" {text}" if isinstance(text, str) else "")]
        lines += [f"{k}: {json.dumps(v, ensure_ascii=False, sort_keys=True, default=str)}" for k, v in sorted(rest.items())]
        return "\n".join(lines)

    @staticmethod
    def _matches(item: Item, op: SearchOp) -> bool:
        if tuple(item.namespace[:len(op.namespace_prefix)]) != tuple(op.namespace_prefix):
            return False
        return all(item.value.get(k) == v for k, v in (op.filter or {}).items())

    def _search(self, op: SearchOp) -> list[SearchItem]:
        if op.query:
            want = op.offset + op.limit
            hits = self.remote.search(op.query, top_k=min(100, max(want * 4, 10)))
            found: list[SearchItem] = []
            for h in hits:
                try:
                    item = self._item(self._manifest(h["block_id"]), score=float(h["score"]))
                except BlockNotFound:  # deleted since it was ranked
                    continue
                if isinstance(item, SearchItem) and self._matches(item, op):
                    found.append(item)
            return found[op.offset:want]
        items = sorted((i for i in self._items() if self._matches(i, op)), key=lambda i: i.updated_at, reverse=True)
        return [SearchItem(i.namespace, i.key, i.value, i.created_at, i.updated_at) for i in items][op.offset:
                                                                                                  op.offset + op.limit]

    def _namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        spaces = sorted({tuple(i.namespace) for i in self._items()})

        def ok(ns: tuple[str, ...]) -> bool:
            for cond in op.match_conditions or ():
                path = tuple(cond.path)
                part = ns[:len(path)] if cond.match_type == "prefix" else ns[-len(path):] if path else ()
                if len(ns) < len(path) or any(p != "*" and p != q for p, q in zip(path, part)):
                    return False
            return True
        spaces = [ns for ns in spaces if ok(ns)]
        if op.max_depth is not None:
            spaces = sorted({ns[:op.max_depth] for ns in spaces})
        return spaces[op.offset:op.offset + op.limit]

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        out: list[Result] = []
        for op in ops:
            if isinstance(op, GetOp):
                out.append(self._get(op))
            elif isinstance(op, PutOp):
                self._put(op)
                out.append(None)
            elif isinstance(op, SearchOp):
                out.append(self._search(op))
            elif isinstance(op, ListNamespacesOp):
                out.append(self._namespaces(op))
            else:
                raise ValueError(f"unknown store operation {type(op).__name__}")
        return out

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        return await asyncio.to_thread(self.batch, list(ops))

    # ------------------------------------------------------------------ graftmem's own
    def recall(self, namespace: tuple[str, ...], task: str, *, max_tokens: int = 64) -> dict[str, Any]:
        """Route ``task`` to one item of ``namespace``, graft its block and answer after it: the server's
        `Recall` as JSON (``text``, ``block``, ``receipt``; ``matched`` False when no item serves it)."""
        return self.remote.recall(task, max_tokens=max_tokens, user_id=self._scope(namespace), agent_id=_AGENT)


# ------------------------------------------------------------------------------- the checkpointer
def _b64(typed: tuple[str, bytes]) -> list[str]:
    return [typed[0], base64.b64encode(typed[1]).decode("ascii")]


def _unb64(pair: list[str]) -> tuple[str, bytes]:
    return pair[0], base64.b64decode(pair[1])


class GraftmemCheckpointer(InMemorySaver):
    """LangGraph's ``InMemorySaver``, kept in the JSON file ``path`` (None: in memory only), checking with
    the ``graftmem serve`` at ``url`` that a resumed thread's last stored response is still there."""

    def __init__(self, path: "str | os.PathLike[str] | None" = None, *, url: Optional[str] = None,
                 api_key: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = Path(path) if path is not None else None
        self.url = url.rstrip("/") if url else None
        self.api_key = api_key
        self._file_lock = threading.Lock()
        if self.path is not None and self.path.exists():
            self._read()

    # ------------------------------------------------------------------ the file
    def _read(self) -> None:
        assert self.path is not None
        data = json.loads(self.path.read_text(encoding="utf-8"))
        for thread, ns, cid, ckpt, meta, parent in data.get("storage", []):
            self.storage[thread][ns][cid] = (_unb64(ckpt), _unb64(meta), parent)
        for thread, ns, cid, task, idx, task2, channel, value, path in data.get("writes", []):
            self.writes.setdefault((thread, ns, cid), {})[(task, idx)] = (task2, channel, _unb64(value), path)
        for thread, ns, channel, version, value in data.get("blobs", []):
            self.blobs[(thread, ns, channel, version)] = _unb64(value)

    def _write(self) -> None:
        if self.path is None:
            return
        data = {
            "storage": [[t, ns, cid, _b64(c), _b64(m), p] for t, nss in self.storage.items()
                        for ns, cids in nss.items() for cid, (c, m, p) in cids.items()],
            "writes": [[t, ns, cid, task, idx, w[0], w[1], _b64(w[2]), w[3]]
                       for (t, ns, cid), ws in self.writes.items() for (task, idx), w in ws.items()],
            "blobs": [[t, ns, ch, v, _b64(b)] for (t, ns, ch, v), b in self.blobs.items()],
        }
        with self._file_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(self.path) as f:  # atomic: a crash leaves the previous file
                f.write(json.dumps(data).encode("utf-8"))

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        out = super().put(config, checkpoint, metadata, new_versions)
        self._write()
        return out

    def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
        super().put_writes(config, writes, task_id, task_path)
        self._write()

    def delete_thread(self, thread_id: str) -> None:
        super().delete_thread(thread_id)
        self._write()

    # ------------------------------------------------------------------ stored responses
    def get_tuple(self, config: Any) -> Any:
        tup = super().get_tuple(config)
        if tup is None or self.url is None:
            return tup
        messages = (tup.checkpoint.get("channel_values") or {}).get("messages")
        if not isinstance(messages, list):
            return tup
        last = next((m for m in reversed(messages) if str((getattr(m, "response_metadata", None) or {})
                                                           .get("id", "")).startswith("resp_")), None)
        if last is None or self._stored(last.response_metadata["id"]):
            return tup
        # the server no longer holds the chain: without the ids, the next call sends the whole conversation
        fresh = [m.model_copy(update={"response_metadata": {k: v for k, v in m.response_metadata.items()
                                                            if k != "id"}})
                 if str((getattr(m, "response_metadata", None) or {}).get("id", "")).startswith("resp_") else m
                 for m in messages]
        values = {**tup.checkpoint["channel_values"], "messages": fresh}
        return tup._replace(checkpoint={**tup.checkpoint, "channel_values": values})

    def _stored(self, rid: str) -> bool:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.get(f"{self.url}/v1/responses/{rid}", headers=headers, timeout=30)
        except httpx.HTTPError:
            return True  # unreachable: leave the thread as it is (the model call will say why)
        return r.status_code != 404
