"""`RemoteMemory`: the verbs of [`Memory`][graftmem.Memory] against a running ``graftmem serve``, over HTTP.

Why: an application (or the CLI's ``--url``) that talks to a server should not learn a second
vocabulary. The methods have `Memory`'s names and arguments, return the same typed results (`Block`,
`Recall` with its receipt, `SearchHit`) and raise the same exceptions, mapped from the server's error
response by the one mapping every client uses (`graftmem.core.errors.from_response`): a missing block
is `BlockNotFound`, a bad argument a `ConfigError` naming the field, a wrong key `AccessDenied`, a
server that cannot be reached a `TransferError`. Each verb is one request to the memory REST routes
(`graftmem.server.rest`), which call the same verbs `Memory` calls, so the answer is the one `Memory`
gives, receipt included.

Two views of one client. `RemoteMemory` (an application's: httpx with a kept-alive connection pool,
typed results) and `RemoteJSON` (the same verbs and errors returning the server's JSON, over one
stdlib socket per request). `RemoteJSON` is what the CLI's ``--url`` uses: a verb through a running
server is meant to cost a Python start and one request, and httpx + pydantic + the result models cost
0.23 s of imports on top of the CLI's 0.04 s (measured here: ``python -c "from graftmem import
RemoteMemory"``), so this module imports neither until a `RemoteMemory` is made.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence
from urllib.parse import quote, urlencode

from ..core.errors import ConfigError, TransferError, from_response

if TYPE_CHECKING:
    from ..core.blocks import Block, Recall, SearchHit, VerifyReport
    from .summary import BlockSummary

__all__ = ["RemoteJSON", "RemoteMemory"]

#: sends one request: (method, url path with query, headers, body) -> (status, response body)
Transport = Callable[[str, str, dict, Optional[bytes]], "tuple[int, bytes]"]


def _scope(user_id: Optional[str], agent_id: Optional[str], session_id: Optional[str]) -> dict[str, str]:
    return {k: v for k, v in (("user_id", user_id), ("agent_id", agent_id), ("session_id", session_id))
            if v is not None}


def _given(**fields: Any) -> dict[str, Any]:
    """The fields a caller gave (None: the server's default, as `Memory`'s)."""
    return {k: v for k, v in fields.items() if v is not None}


def _url(url: Any) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        exc = ConfigError(f"url must be an http(s) URL such as 'http://127.0.0.1:8765', got {url!r:.80}")
        exc.param = "url"  # type: ignore[attr-defined]
        raise exc
    return url.rstrip("/")


def _key(api_key: Any) -> Optional[str]:
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        exc = ConfigError("api_key must be a non-empty str (or None for a server without a key)")
        exc.param = "api_key"  # type: ignore[attr-defined]
        raise exc
    return api_key


class RemoteJSON:
    """`Memory`'s verbs on the server at ``url``, returning the server's JSON (dicts and lists) and
    raising graftmem's exceptions. `RemoteMemory` is the typed view of the same requests; this one
    imports neither httpx nor pydantic (see the module doc: the CLI's ``--url``).

    ``transport`` sends one request (default: one stdlib socket per request, urllib for ``https``)."""

    def __init__(self, url: str, *, api_key: Optional[str] = None, timeout: float = 300.0,
                 transport: Optional[Transport] = None) -> None:
        self.url = _url(url)
        key = _key(api_key)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._send: Transport = transport or (lambda method, path, headers, body: _exchange(
            self.url, method, path, headers, body, timeout))

    @classmethod
    def from_env(cls, url: Optional[str] = None, **kwargs: Any) -> "RemoteJSON":
        """``url`` (else ``$GRAFTMEM_URL``) with the key of ``$GRAFTMEM_API_KEY`` (what the CLI's
        ``--url`` uses)."""
        where = url or os.environ.get("GRAFTMEM_URL")
        if not where:
            raise ConfigError("no server URL: pass url or set GRAFTMEM_URL")
        return cls(where, api_key=os.environ.get("GRAFTMEM_API_KEY") or None, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def call(self, method: str, path: str, body: Optional[Mapping[str, Any]] = None,
             params: Optional[Mapping[str, Any]] = None) -> Any:
        """One request to ``/v1/memory/<path>``: its JSON, or the server's error as graftmem's exception
        (`graftmem.core.errors.from_response`: the class the server named)."""
        target = f"/v1/memory/{path}" + (f"?{urlencode(params)}" if params else "")
        headers = dict(self._headers)
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body).encode()
        try:
            status, raw = self._send(method, target, headers, data)
        except (OSError, TransferError) as exc:  # refused, unreachable, timed out, cut short, not HTTP
            raise TransferError(f"cannot reach the graftmem server at {self.url}: {exc}; is `graftmem serve` "
                                "running? (or drop --url / unset GRAFTMEM_URL)") from None
        if status >= 400:
            raise from_response(status, raw, f"the server at {self.url}")
        try:
            return json.loads(raw)
        except ValueError:  # a proxy's HTML page, or not a graftmem server at all
            raise TransferError(f"the server at {self.url} answered {status} with a body that is not JSON: "
                                f"{raw[:60]!r}; is it a graftmem server?") from None

    # ------------------------------------------------------------------ verbs (JSON)
    def learn(self, text: str, *, name: Optional[str] = None, kind: Optional[str] = None,
              metadata: Optional[Mapping[str, Any]] = None, when_to_use: Optional[str] = None,
              chat: bool = False, parent: Optional[str] = None, shared: Optional[bool] = None,
              user_id: Optional[str] = None, agent_id: Optional[str] = None,
              session_id: Optional[str] = None) -> dict[str, Any]:
        """``{"block": <summary>, "new": bool}``."""
        return self.call("POST", "learn", {"text": text, "chat": chat, **_given(
            name=name, kind=kind, metadata=metadata, when_to_use=when_to_use, parent=parent, shared=shared),
            **_scope(user_id, agent_id, session_id)})

    def ask(self, block_id: str, query: str, *, max_tokens: int = 64, stop: "str | Sequence[str] | None" = None,
            allow_unverified: bool = False, turn: bool = False, user_id: Optional[str] = None,
            agent_id: Optional[str] = None, session_id: Optional[str] = None) -> dict[str, Any]:
        """A `Recall` as JSON."""
        return self.call("POST", "ask", {
            "id": block_id, "question": query, "max_tokens": max_tokens, "raw": not turn,
            "allow_unverified": allow_unverified, **_given(stop=stop), **_scope(user_id, agent_id, session_id)})

    def search(self, task: str, *, top_k: int = 5, user_id: Optional[str] = None, agent_id: Optional[str] = None,
               session_id: Optional[str] = None) -> list[dict[str, Any]]:
        """`SearchHit`s as JSON, best first."""
        return self.call("POST", "search", {"query": task, "top_k": top_k,
                                            **_scope(user_id, agent_id, session_id)})["hits"]

    def recall(self, task: str, *, max_tokens: int = 64, min_score: Optional[float] = None,
               stop: "str | Sequence[str] | None" = None, allow_unverified: bool = False,
               user_id: Optional[str] = None, agent_id: Optional[str] = None,
               session_id: Optional[str] = None) -> dict[str, Any]:
        """A `Recall` as JSON."""
        return self.call("POST", "recall", {
            "task": task, "max_tokens": max_tokens, "allow_unverified": allow_unverified,
            **_given(min_score=min_score, stop=stop), **_scope(user_id, agent_id, session_id)})

    def verify(self, block_id: str, *, samples: Optional[int] = None, user_id: Optional[str] = None,
               agent_id: Optional[str] = None, session_id: Optional[str] = None) -> dict[str, Any]:
        """A `VerifyReport` as JSON (in the server's process, not recorded: ``POST /v1/memory/verify``)."""
        return self.call("POST", "verify", {"id": block_id, **_given(samples=samples),
                                            **_scope(user_id, agent_id, session_id)})

    def get(self, block_id: str, *, user_id: Optional[str] = None, agent_id: Optional[str] = None,
            session_id: Optional[str] = None) -> dict[str, Any]:
        """A `Block`'s manifest as JSON."""
        return self.call("GET", f"blocks/{quote(block_id, safe='')}", params=_scope(user_id, agent_id, session_id))

    def ls(self, *, kind: Optional[str] = None, user_id: Optional[str] = None, agent_id: Optional[str] = None,
           session_id: Optional[str] = None) -> list[dict[str, Any]]:
        """`BlockSummary`s as JSON."""
        return self.call("GET", "blocks", params={**_given(kind=kind), **_scope(user_id, agent_id, session_id)})["blocks"]

    def delete(self, block_id: str, *, cascade: bool = False, user_id: Optional[str] = None,
               agent_id: Optional[str] = None, session_id: Optional[str] = None) -> list[str]:
        """The ids deleted."""
        params = {**({"cascade": "true"} if cascade else {}), **_scope(user_id, agent_id, session_id)}
        return list(self.call("DELETE", f"blocks/{quote(block_id, safe='')}", params=params)["deleted"])


class RemoteMemory:
    """`Memory`'s verbs on the server at ``url`` (``http://127.0.0.1:8765``), typed: `Block`, `Recall`,
    `SearchHit`, `BlockSummary`. ``api_key`` when the server needs one (``serve --api-key`` /
    ``--api-key-file``: the key's tenant sees its own blocks and the shared ones). ``timeout``: seconds
    one request may take (an answer decodes on the server).

    Over httpx with a kept-alive connection pool; a context manager (``close()`` releases the pool);
    thread-safe as httpx's client is. ``.json`` is the `RemoteJSON` view of the same connection."""

    def __init__(self, url: str, *, api_key: Optional[str] = None, timeout: float = 300.0) -> None:
        import httpx

        base, key = _url(url), _key(api_key)
        self._client = httpx.Client(base_url=base, timeout=httpx.Timeout(timeout), follow_redirects=False)

        def send(method: str, path: str, headers: dict, body: Optional[bytes]) -> tuple[int, bytes]:
            try:
                resp = self._client.request(method, path, headers=headers, content=body)
            except httpx.HTTPError as exc:
                raise TransferError(str(exc) or type(exc).__name__) from exc
            return resp.status_code, resp.content

        self.json = RemoteJSON(base, api_key=key, transport=send)
        self.url = self.json.url

    @classmethod
    def from_env(cls, url: Optional[str] = None, **kwargs: Any) -> "RemoteMemory":
        """``url`` (else ``$GRAFTMEM_URL``) with the key of ``$GRAFTMEM_API_KEY``."""
        where = url or os.environ.get("GRAFTMEM_URL")
        if not where:
            raise ConfigError("no server URL: pass url or set GRAFTMEM_URL")
        return cls(where, api_key=os.environ.get("GRAFTMEM_API_KEY") or None, **kwargs)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RemoteMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteMemory({self.url!r})"

    # ------------------------------------------------------------------ verbs (typed)
    def learn(self, text: str, *, name: Optional[str] = None, kind: Optional[str] = None,
              metadata: Optional[Mapping[str, Any]] = None, when_to_use: Optional[str] = None,
              chat: bool = False, parent: Optional[str] = None, shared: Optional[bool] = None,
              user_id: Optional[str] = None, agent_id: Optional[str] = None,
              session_id: Optional[str] = None) -> "Block":
        """`Memory.learn` on the server: prefill ``text`` there once and store its block (deduplicated by
        content); returns the stored `Block` (a second request fetches its manifest). ``shared``
        (servers with tenants): learn it for every tenant (default: the server's ``shared_learned``)."""
        scope = _scope(user_id, agent_id, session_id)
        got = self.json.learn(text, name=name, kind=kind, metadata=metadata, when_to_use=when_to_use, chat=chat,
                              parent=parent, shared=shared, **scope)
        return self.get(got["block"]["id"], **scope)

    def ask(self, block_id: str, query: str, *, max_tokens: int = 64, stop: "str | Sequence[str] | None" = None,
            allow_unverified: bool = False, turn: bool = False, user_id: Optional[str] = None,
            agent_id: Optional[str] = None, session_id: Optional[str] = None) -> "Recall":
        """`Memory.ask` on the server: graft the block (id or unique prefix) and answer after ``query``,
        greedily. ``query`` is prefilled as given, as `Memory.ask` does; ``turn=True`` makes it the next
        user turn after a chat block instead (what ``graftmem ask`` does without ``--raw``). An
        ``unverified`` block is refused (`UnverifiedBlock`) unless ``allow_unverified``."""
        from ..core.blocks import Recall

        return Recall.model_validate(self.json.ask(
            block_id, query, max_tokens=max_tokens, stop=stop, allow_unverified=allow_unverified, turn=turn,
            user_id=user_id, agent_id=agent_id, session_id=session_id))

    def search(self, task: str, *, top_k: int = 5, user_id: Optional[str] = None, agent_id: Optional[str] = None,
               session_id: Optional[str] = None) -> "list[SearchHit]":
        """`Memory.search` on the server (its router): this engine's blocks ranked for ``task``, best
        first, nothing grafted."""
        from ..core.blocks import SearchHit

        return [SearchHit.model_validate(h) for h in self.json.search(
            task, top_k=top_k, user_id=user_id, agent_id=agent_id, session_id=session_id)]

    def recall(self, task: str, *, max_tokens: int = 64, min_score: Optional[float] = None,
               stop: "str | Sequence[str] | None" = None, allow_unverified: bool = False,
               user_id: Optional[str] = None, agent_id: Optional[str] = None,
               session_id: Optional[str] = None) -> "Recall":
        """`Memory.recall` on the server: route ``task`` to one block, graft it, answer greedily."""
        from ..core.blocks import Recall

        return Recall.model_validate(self.json.recall(
            task, max_tokens=max_tokens, min_score=min_score, stop=stop, allow_unverified=allow_unverified,
            user_id=user_id, agent_id=agent_id, session_id=session_id))

    def verify(self, block_id: str, *, samples: Optional[int] = None, user_id: Optional[str] = None,
               agent_id: Optional[str] = None, session_id: Optional[str] = None) -> "VerifyReport":
        """`Memory.verify` on the server: graft == fresh prefill on ``samples`` queries (the server's default
        when None), in the server's process; the report is not recorded in the block's manifest."""
        from ..core.blocks import VerifyReport

        return VerifyReport.model_validate(self.json.verify(block_id, samples=samples, user_id=user_id,
                                                            agent_id=agent_id, session_id=session_id))

    def get(self, block_id: str, *, user_id: Optional[str] = None, agent_id: Optional[str] = None,
            session_id: Optional[str] = None) -> "Block":
        """`Memory.get` on the server: the block with this id (or unique prefix); `BlockNotFound`
        otherwise (also for a block outside the scope, or another tenant's)."""
        from ..core.blocks import Block

        return Block.model_validate(self.json.get(block_id, user_id=user_id, agent_id=agent_id,
                                                  session_id=session_id))

    def ls(self, *, kind: Optional[str] = None, user_id: Optional[str] = None, agent_id: Optional[str] = None,
           session_id: Optional[str] = None) -> "list[BlockSummary]":
        """The blocks this key sees (of ``kind``, in the scope) as one-line summaries, in one request
        (``graftmem ls``); `get` fetches a whole block."""
        from .summary import BlockSummary

        return [BlockSummary.model_validate(b) for b in self.json.ls(
            kind=kind, user_id=user_id, agent_id=agent_id, session_id=session_id)]

    def delete(self, block_id: str, *, cascade: bool = False, user_id: Optional[str] = None,
               agent_id: Optional[str] = None, session_id: Optional[str] = None) -> list[str]:
        """`Memory.delete` on the server; the ids deleted. A block with chained children is refused
        unless ``cascade``; a block this key may not delete is `AccessDenied`."""
        return self.json.delete(block_id, cascade=cascade, user_id=user_id, agent_id=agent_id,
                                session_id=session_id)


# ---------------------------------------------------------------- the light transport (stdlib)
def _exchange(url: str, method: str, path: str, headers: dict[str, str], data: Optional[bytes],
              timeout: float = 300.0) -> tuple[int, bytes]:
    """One HTTP/1.1 request and its whole response: (status, body).

    For ``http://`` a plain socket, because the stdlib's ``http.client`` costs ~20 ms of imports (its
    e-mail header parser), more than the request itself, and a verb through a running server is meant
    to cost a Python start and one request. The request goes out in one ``sendall`` (headers and body
    together: no Nagle / delayed-ACK stall) with ``Connection: close``, so the response ends where the
    socket does. ``https://`` (a proxy in front of the server) goes through urllib."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http":
        import urllib.error
        import urllib.request

        req = urllib.request.Request(url + path, headers=headers, method=method, data=data)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
    import socket

    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    target = (parts.path.rstrip("/") + path) or "/"
    head = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items()), f"Content-Length: {len(data or b'')}"]
    try:  # an ASCII host as bytes: a str would load the IDNA codec (5 ms) to encode it
        addr: Any = host.encode("ascii")
    except UnicodeEncodeError:
        addr = host
    with socket.create_connection((addr, port), timeout=timeout) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (data or b""))
        chunks = []
        while True:
            got = sock.recv(1 << 16)
            if not got:
                break
            chunks.append(got)
    raw = b"".join(chunks)
    top, sep, body = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise OSError(f"not an HTTP response: {raw[:60]!r}") from None
    fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if not sep:
        raise OSError("the connection closed before the response's headers ended")
    if fields.get("transfer-encoding", "").lower() == "chunked":
        out, rest = [], body
        while True:
            size_line, found, rest = rest.partition(b"\r\n")
            try:
                n = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                n = -1
            if not found or n < 0:
                raise OSError(f"a malformed chunked body (chunk size line {size_line[:20]!r})")
            if n == 0:
                break
            if len(rest) < n + 2 or rest[n:n + 2] != b"\r\n":
                raise OSError(f"the response ended inside a chunk of {n} bytes")
            out.append(rest[:n])
            rest = rest[n + 2:]
        body = b"".join(out)
    elif "content-length" in fields:
        try:
            n = int(fields["content-length"])
        except ValueError:
            n = -1
        if n < 0:
            raise OSError(f"a malformed Content-Length: {fields['content-length'][:20]!r}")
        if len(body) < n:
            raise OSError(f"the response ended after {len(body)} of {n} bytes")
        body = body[:n]
    return status, body
