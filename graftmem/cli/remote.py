"""The CLI's client for a running ``graftmem serve`` (``--url``): one request per command, errors
mapped to graftmem's exceptions."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional



def _server(args: argparse.Namespace) -> Optional[str]:
    """The running server to ask instead of loading the model (--url or $GRAFTMEM_URL), if any."""
    url = getattr(args, "server_url", None) or os.environ.get("GRAFTMEM_URL")
    return url.rstrip("/") if url else None


def _exchange(url: str, method: str, path: str, headers: dict[str, str], data: Optional[bytes]) -> tuple[int, bytes]:
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
            with urllib.request.urlopen(req, timeout=300) as r:
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
    with socket.create_connection((addr, port), timeout=300) as sock:
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


def _remote(url: str, path: str, body: Optional[dict[str, Any]] = None) -> Any:
    """POST ``body`` (GET without one) to a graftmem server's memory API; its error as a graftmem error.

    The client path stays light on purpose (stdlib only, no model, no server, no pydantic, no numpy):
    a verb through a running server costs a Python start and one request."""
    from .. import TransferError

    key = os.environ.get("GRAFTMEM_API_KEY")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        status, raw = _exchange(url, "GET" if body is None else "POST", f"/v1/memory/{path}", headers,
                                None if body is None else json.dumps(body).encode())
    except OSError as exc:  # refused, unreachable, timed out, cut short (urllib's URLError is one too)
        raise TransferError(f"cannot reach the graftmem server at {url}: {exc}; is `graftmem serve` "
                            "running? (or drop --url / unset GRAFTMEM_URL)") from None
    if status >= 400:
        try:
            msg = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = raw[:200].decode("utf-8", "replace")
        raise TransferError(f"the server at {url} answered {status}: {msg}")
    try:
        return json.loads(raw)
    except ValueError:  # a proxy's HTML page, or not a graftmem server at all
        raise TransferError(f"the server at {url} answered {status} with a body that is not JSON: "
                            f"{raw[:60]!r}; is it a graftmem server?") from None


def _greedy_remote(args: argparse.Namespace) -> None:
    """The memory API of a server answers greedily, whole, from verified blocks: refuse the flags it
    would otherwise ignore."""
    if (args.temperature or args.seed is not None or args.top_p != 1.0 or args.allow_unverified
            or args.stream):
        from .. import ConfigError

        raise ConfigError("--url answers greedily, whole, from verified blocks: drop --temperature/--top-p/"
                          "--seed/--allow-unverified/--stream, or run without --url (the server's OpenAI API "
                          "samples and streams: docs/agents.md)")
