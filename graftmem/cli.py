"""The ``graftmem`` command: argument parsing and printing only; every verb calls the public API.

Errors print one line (``error: ...``) and exit 2; ``verify`` exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["main", "build_parser"]


def _out(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        if hasattr(data, "model_dump_json"):
            print(data.model_dump_json(indent=2))
        else:
            print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


def _config(args: argparse.Namespace) -> Optional[dict]:
    from . import ConfigError

    if not args.config:
        return None
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config is not JSON ({exc.msg} at character {exc.pos}); "
                          'give an object such as \'{"n_ctx": 4096}\'') from None
    if not isinstance(config, dict):
        raise ConfigError(f"--config must be a JSON object such as '{{\"n_ctx\": 4096}}', got {args.config!r}")
    return config


def _store_spec(args: argparse.Namespace) -> Optional[str]:
    """--store, else $GRAFTMEM_STORE (unless --home was given), else None (the local home)."""
    spec = getattr(args, "store", None)
    if spec is None and not args.home:
        spec = os.environ.get("GRAFTMEM_STORE") or None
    if spec is not None and args.home:
        from . import ConfigError

        raise ConfigError("give --home (a directory) or --store (s3://bucket/prefix or a directory), not both")
    return spec


def _store(args: argparse.Namespace):
    """The store the command works on: the local home, or the fleet store of --store s3://..."""
    from .store import open_store

    spec = _store_spec(args)
    return open_store(spec if spec is not None else args.home)


def _memory(args: argparse.Namespace):
    from . import Memory

    spec = _store_spec(args)
    if spec is not None:
        return Memory(args.model, store=spec, config=_config(args))
    return Memory(args.model, home=args.home, config=_config(args))


def _sampling(args: argparse.Namespace):
    from . import Sampling

    return Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def _sampling_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--temperature", type=float, default=0.0,
                    help="0 decodes greedily (the mode exactness is proved in); above 0 samples")
    sp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability mass")
    sp.add_argument("--seed", type=int, default=None, help="seed of the sampler, for a reproducible answer")
    sp.add_argument("--stop", action="append", default=None, metavar="TEXT",
                    help="end the answer at this string (cut from it); repeat for several")
    sp.add_argument("--stream", action="store_true",
                    help="print the answer as it is decoded (ignored with --json)")


def _answered(args: argparse.Namespace, plain: Callable[[], Any], stream: Callable[[], Any]) -> Any:
    """The Recall of ``plain()``, or with ``--stream`` of ``stream()`` (an AnswerStream) while its text
    is printed as it comes (then a blank line; the caller prints the receipt)."""
    if not args.stream or args.json:
        return plain()
    with stream() as s:
        for piece in s:
            sys.stdout.write(piece)
            sys.stdout.flush()
    return s.result


def _size(n: float) -> str:
    """Bytes for people: 2015268 -> '1.9 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _read_text(path: str) -> str:
    """A text file (or ``-``: stdin) as UTF-8; anything else is a clear error, not a traceback."""
    from . import ConfigError

    where = "stdin" if path == "-" else path
    data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}); "
                          "learn text files only, converted first if needed (e.g. iconv -f latin1 -t utf-8)") from None


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: give 1..65535, or 0 for a free one")
    return port


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not allowed: give 1 or more")
    return n


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
    from . import TransferError

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


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*map(str, r)) for r in rows])


def cmd_learn(args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    text = _read_text(args.file)
    started = datetime.now(timezone.utc)
    with _memory(args) as mem:
        block = mem.learn(text, name=args.name or (None if args.file == "-" else Path(args.file).stem),
                          kind=args.kind, progress=not args.json, when_to_use=args.when_to_use,
                          chat=args.chat, parent=args.parent)
    already = block.created_at < started  # content-addressed: the same text is the same block
    _out(args, {"id": block.id, "name": block.name, "n_tokens": block.n_tokens,
                "state_size": block.state_size, "already_stored": already},
         f"{'already stored' if already else 'learned'} {block.short_id}  {block.name}  "
         f"{block.n_tokens} tokens  {_size(block.state_size)} of state"
         + ("  (nothing prefilled)" if already else ""))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    if (url := _server(args)) is not None:
        from urllib.parse import quote

        blocks = _remote(url, "blocks" + (f"?kind={quote(args.kind)}" if args.kind else ""))["blocks"]
        rows = [[b["id"][:12], b["kind"], b["n_tokens"], f"{b['state_size']:,}", (b["name"] or "")[:40]] for b in blocks]
        _out(args, blocks, _table(rows, ["id", "kind", "tokens", "state bytes", "name"]) if rows else "(no blocks)")
        return 0
    store = _store(args)
    try:
        blocks = store.list(kind=args.kind)
    finally:
        store.close()
    rows = [[b.short_id, b.kind, b.n_tokens, f"{b.state_size:,}", b.fingerprint.model_name,
             "yes" if b.verification and b.verification.ok else ("NO" if b.verification else "-"),
             b.provenance, _label(b.name[:40], b)] for b in blocks]
    _out(args, [b.model_dump(exclude={"tokens", "text"}) | {"provenance": b.provenance,
                                                            "labels_trusted": b.labels_trusted} for b in blocks],
         _table(rows, ["id", "kind", "tokens", "state bytes", "model", "verified", "provenance", "name"])
         if rows else "(no blocks)")
    return 0


def _label(text: str, b: Any) -> str:
    """A label as shown: marked when it came from elsewhere and no trusted signature covers it."""
    return text if b.labels_trusted else f"{text} (unverified label)"


def cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        b = store.get(args.id)
    finally:
        store.close()
    fp = b.fingerprint
    text = "\n".join([
        f"id           {b.id}", f"name         {_label(b.name, b)}", f"kind         {b.kind}",
        f"provenance   {b.provenance}",
        f"tokens       {b.n_tokens} (positions {b.pos_start}..{b.pos_end - 1})",
        f"state        {b.state_size:,} bytes  {b.state_digest}",
        f"model        {fp.model_name}  sha256 {fp.model_sha256[:16]}…",
        f"engine       n_ctx={fp.n_ctx} n_batch={fp.n_batch} n_ubatch={fp.n_ubatch} "
        f"kv={fp.type_k}/{fp.type_v} flash_attn={fp.flash_attn} swa_full={fp.swa_full}",
        f"created      {b.created_at.isoformat()}",
        f"verified     {b.verification.model_dump_json() if b.verification else 'never'}",
        f"text         {b.text[:200]!r}{'…' if len(b.text) > 200 else ''}",
    ])
    _out(args, b.model_dump(mode="json") | {"provenance": b.provenance, "labels_trusted": b.labels_trusted}, text)
    return 0


def _greedy_remote(args: argparse.Namespace) -> None:
    """The memory API of a server answers greedily, whole, from verified blocks: refuse the flags it
    would otherwise ignore."""
    if (args.temperature or args.seed is not None or args.top_p != 1.0 or args.allow_unverified
            or args.stream):
        from . import ConfigError

        raise ConfigError("--url answers greedily, whole, from verified blocks: drop --temperature/--top-p/"
                          "--seed/--allow-unverified/--stream, or run without --url (the server's OpenAI API "
                          "samples and streams: docs/agents.md)")


def cmd_ask(args: argparse.Namespace) -> int:
    if (url := _server(args)) is not None:
        _greedy_remote(args)
        r = _remote(url, "ask", {"id": args.id, "question": args.question, "max_tokens": args.max_tokens,
                                 "raw": args.raw, "stop": args.stop})
        rc = r["receipt"]
        _out(args, r, f"{r['text']}\n\n-- {rc['tokens_restored']} tokens restored in {rc['restore_ms']:.1f} ms, "
                      f"{rc['tokens_prefilled']} prefilled; exact={rc['exact']} (through {url})")
        return 0 if r["tokens"] else 1
    from .memory import continuation_for

    with _memory(args) as mem:
        block = mem.get(args.id)
        # a chat block holds complete turns: the question becomes the next user turn (--raw: as given)
        query = args.question if args.raw else continuation_for(block, args.question)
        kw = dict(max_tokens=args.max_tokens, sampling=_sampling(args), stop=args.stop,
                  allow_unverified=args.allow_unverified)
        r = _answered(args, lambda: mem.ask(block.id, query, **kw), lambda: mem.ask_stream(block.id, query, **kw))
    rc = r.receipt
    _out(args, r, f"{'' if args.stream else r.text}\n\n-- {rc}")
    if not r.tokens:
        print(f"note: the model ended its answer at once (0 tokens); "
              f"{'ask without --raw, or ' if args.raw and 'chat_format' in block.metadata else ''}"
              "phrase the question as the text's continuation", file=sys.stderr)
        return 1
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    if args.rederive:
        return _rederive(args)
    with _memory(args) as mem:
        rep = mem.verify(args.id, samples=args.samples, cross_process=not args.no_cross_process)
    rows = [[i, r.n_query_tokens, r.graft_sha256[:12], r.fresh_sha256[:12],
             "yes" if r.sha_equal else "NO", f"{r.kl:.3g}", "yes" if r.argmax_equal else "NO"]
            for i, r in enumerate(rep.rows)]
    summary = (f"block {rep.block_id[:12]} ({rep.n_tokens} tokens): SHA-equal {rep.sha_equal}/{rep.samples}, "
               f"max KL {rep.max_kl:.3g}, argmax agree {rep.argmax_agree}/{rep.samples}, "
               f"fresh-vs-fresh floor {rep.floor_sha_equal}/{rep.floor_samples}, "
               f"new process {'-' if rep.cross_process is None else ('equal' if rep.cross_process else 'DIFFERENT')}, "
               f"engine exact={rep.exact_engine}\n{'OK' if rep.ok else 'MISMATCH'}")
    _out(args, rep, _table(rows, ["#", "q tok", "graft sha", "fresh sha", "equal", "KL", "argmax"])
         + "\n" + summary)
    return 0 if rep.ok else 1


def cmd_recall(args: argparse.Namespace) -> int:
    from . import Recall

    if (url := _server(args)) is not None:
        _greedy_remote(args)
        r = Recall.model_validate(_remote(url, "recall", {"task": args.task, "max_tokens": args.max_tokens,
                                                          "min_score": args.min_score, "stop": args.stop}))
    else:
        with _memory(args) as mem:
            kw = dict(max_tokens=args.max_tokens, min_score=args.min_score, sampling=_sampling(args),
                      stop=args.stop, allow_unverified=args.allow_unverified)
            r = _answered(args, lambda: mem.recall(args.task, **kw), lambda: mem.recall_stream(args.task, **kw))
    rc = r.receipt
    route = "nothing grafted"
    if r.block is not None and r.score is not None:
        route = f"routed to {r.block.name!r} ({r.block.short_id}) score {r.score:.3f}"
        if r.runner_up and r.runner_up_score is not None:
            route += f", runner-up {r.runner_up[:12]} {r.runner_up_score:.3f}"
    if not r.matched:
        _out(args, r, f"nothing grafted: {r.reason}")
        return 1
    _out(args, r, f"{'' if args.stream else r.text}\n\n-- {route}; {rc}")
    return 0


def cmd_learn_document(args: argparse.Namespace) -> int:
    with _memory(args) as mem:
        rep = mem.learn_document(Path(args.file), document=args.document, name=args.name, window=args.window,
                                 overlap=args.overlap, progress=not args.json)
    _out(args, rep, f"document {rep.document}: {rep.pages} pages ({rep.pages_learned} learned, "
                    f"{rep.pages_skipped} already stored), {rep.document_tokens:,} tokens, "
                    f"{rep.passages_embedded} passages embedded, {rep.seconds:.1f} s"
                    + ("" if rep.complete else "; INCOMPLETE: run again to resume"))
    return 0 if rep.complete else 1


def cmd_recall_document(args: argparse.Namespace) -> int:
    with _memory(args) as mem:
        a = mem.recall_document(args.task, prompt=args.prompt, document=args.document,
                                max_tokens=args.max_tokens, min_score=args.min_score)
    rc = a.recall.receipt
    _out(args, a, f"{a.text}\n\n-- page {a.page.page} of {a.page.document} (token {a.depth:,} of the document, "
                  f"passage score {a.passage.score:.3f}); {rc.tokens_restored} tokens restored in "
                  f"{rc.restore_ms:.1f} ms, {rc.tokens_prefilled} prefilled; exact={rc.exact}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    if (url := _server(args)) is not None:  # dicts, not SearchHit: the client path imports no pydantic
        hits = _remote(url, "search", {"query": args.task, "top_k": args.top_k})["hits"]
        rows = [[i + 1, f"{h['score']:.3f}", h["block_id"][:12], h["n_tokens"], h["name"][:40],
                 (h.get("when_to_use") or "")[:50]] for i, h in enumerate(hits)]
        _out(args, hits, _table(rows, ["#", "score", "id", "tokens", "name", "when to use"]) if rows
             else "(no blocks learned by this engine)")
        return 0
    from .memory import other_engines_hint

    with _memory(args) as mem:
        hits = mem.search(args.task, top_k=args.top_k)
        hint = None if hits else other_engines_hint(mem.store, mem.fingerprint)
    rows = [[i + 1, f"{h.score:.3f}", h.block_id[:12], h.n_tokens, h.name[:40], (h.when_to_use or "")[:50]]
            for i, h in enumerate(hits)]
    _out(args, [h.model_dump() for h in hits],
         _table(rows, ["#", "score", "id", "tokens", "name", "when to use"]) if rows
         else "(no blocks learned by this engine)" + (f"\nnote: {hint}" if hint else ""))
    return 0


def cmd_reindex(args: argparse.Namespace) -> int:
    with _memory(args) as mem:
        n = mem.reindex()
        path = mem.router.path
    _out(args, {"entries": n, "index": str(path)}, f"reindexed {n} blocks into {path}")
    return 0


def _rederive(args: argparse.Namespace) -> int:
    with _memory(args) as mem:
        rep = mem.rederive(args.id)
    where = "" if rep.ok else (f": first difference at byte {rep.first_difference:,} of {rep.stored_size:,}"
                               if rep.first_difference is not None else "")
    _out(args, rep.model_dump() | {"ok": rep.ok},
         f"block {rep.block_id[:12]} ({rep.n_tokens} tokens): stored state {rep.stored_digest[:23]}, "
         f"re-derived {rep.derived_digest[:23]} in {rep.seconds:.1f} s\n"
         + ("OK: the state is exactly what its tokens produce" if rep.ok
            else "MISMATCH: the stored state is not what its tokens produce" + where))
    return 0 if rep.ok else 1


# --------------------------------------------------------------------- sharing (bundles, HTTP, trust)
def _home(args: argparse.Namespace) -> Path:
    from .store import default_home

    return Path(args.home).expanduser() if args.home else default_home()


def _policy(args: argparse.Namespace):
    from .share import PublicKey, TrustPolicy

    pol = TrustPolicy.load(_home(args))
    if args.require_signature:
        pol.require_signature = True
    for k in args.trust or []:
        pol.trust(PublicKey.load(k))
    return pol


def _sign_key(args: argparse.Namespace):
    from .share import SigningKey

    return SigningKey.load(args.sign) if args.sign else None


def _transfer_text(verb: str, rep: Any) -> str:
    mbps = rep.bytes / 1e6 / rep.seconds if rep.seconds > 0 else 0.0
    signer = (f"; signed by {rep.signer} ({'trusted' if rep.signer_trusted else 'not in the trust policy'})"
              if rep.signer else "; unsigned")
    return (f"{verb} {rep.source}: {len(rep.added)} added, {len(rep.present)} already present, "
            f"{len(rep.kept_apart)} kept apart, {len(rep.skipped)} skipped; {rep.bytes:,} bytes in "
            f"{rep.seconds:.2f} s ({mbps:.0f} MB/s){signer}")


def cmd_upload(args: argparse.Namespace) -> int:
    from . import ConfigError
    from .store import FleetStore, Store

    source = Path(args.source).expanduser()
    if not (source / "index.sqlite").is_file() and not (source / "blocks").is_dir():
        raise ConfigError(f"{source} is not a graftmem store (no blocks/ or index.sqlite)")
    store = _store(args)
    try:
        if not isinstance(store, FleetStore):
            raise ConfigError("upload copies a local store into a bucket: give --store s3://bucket/prefix "
                              "(or $GRAFTMEM_STORE)")
        src = Store(source)
        try:
            done = store.upload_store(src)
            total = src.stats().blocks
        finally:
            src.close()
        sent = store.counters["put_bytes"]
    finally:
        store.close()
    _out(args, {"uploaded": done, "blocks": total, "bytes": sent},
         f"uploaded {len(done)} of {total} blocks ({sent:,} bytes) to {store.url}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .share import export

    store = _store(args)
    try:
        rep = export(store, args.path, args.ids or None, kind=args.kind, sign_key=_sign_key(args),
                     progress=not args.json)
    finally:
        store.close()
    _out(args, rep, f"exported {len(rep.blocks)} blocks to {rep.path}: {rep.bytes:,} bytes in "
                    f"{rep.seconds:.2f} s" + (f", signed by {rep.signer}" if rep.signer else ""))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    policy = _policy(args)
    with _memory(args) as mem:
        rep = mem.import_bundle(args.path, incompatible=args.incompatible, policy=policy,
                                rederive=args.rederive, progress=not args.json)
    _out(args, rep, _transfer_text("imported", rep))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    policy = _policy(args)
    with _memory(args) as mem:
        rep = mem.pull(args.url, args.ids or None, kind=args.kind, incompatible=args.incompatible,
                       policy=policy, rederive=args.rederive, progress=not args.json)
    _out(args, rep, _transfer_text("pulled from", rep))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from .share import push

    token = args.token or os.environ.get("GRAFTMEM_PUSH_TOKEN")
    if not token:
        from . import ConfigError

        raise ConfigError("push needs the server's token: --token or $GRAFTMEM_PUSH_TOKEN")
    store = _store(args)
    try:
        rep = push(store, args.url, args.ids or None, token=token, kind=args.kind,
                   sign_key=_sign_key(args), progress=not args.json)
    finally:
        store.close()
    _out(args, rep, _transfer_text(f"pushed to {args.url}; server imported", rep))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """One long-running server: block sharing, and (unless --blocks-only) the OpenAI-compatible API
    with the persistent prompt cache, on one socket."""
    from . import ConfigError
    from .core import Engine
    from .server import ApiKeys, BlockServer, api_server

    token = args.push_token or os.environ.get("GRAFTMEM_PUSH_TOKEN")
    api_key: Any = args.api_key or os.environ.get("GRAFTMEM_API_KEY")
    if args.api_key_file:
        if api_key:
            raise ConfigError("give --api-key (one shared key) or --api-key-file (a key per tenant), not both")
        api_key = ApiKeys.load(args.api_key_file)
    api = not args.blocks_only
    mem = _memory(args) if (token or api) else None  # the API and pushes need the engine
    extra: list[Any] = []
    try:
        if api:
            assert mem is not None
            extra = [Engine(mem.engine.model_path, mem.engine.config) for _ in range(max(1, args.engines) - 1)]
            srv = api_server(mem.store, [mem.engine, *extra], host=args.host, port=args.port, api_key=api_key,
                             push_token=token, sign_key=_sign_key(args),
                             check=mem.vetting(rederive=args.rederive),
                             max_queue=args.max_queue, min_prefix_tokens=args.min_prefix_tokens,
                             sightings=args.sightings, learn=not args.no_learn,
                             max_auto_bytes=args.max_auto_mb << 20, auto_storage=args.auto_storage,
                             warm=not args.no_warm, router=lambda: mem.router,  # loaded on the first routed request
                             chat_template=args.chat_template_file, allow_unverified=args.allow_unverified)
        elif mem:
            srv = mem.serve(host=args.host, port=args.port, push_token=token, sign_key=_sign_key(args),
                            rederive=args.rederive)
        else:
            srv = BlockServer(_home(args), host=args.host, port=args.port, sign_key=_sign_key(args),
                              api_key=api_key)
        try:
            _close_on_sigterm()  # before the line that tells a supervisor the server is up
            warmed = getattr(srv, "warm", [])
            what = (f"OpenAI API at {srv.url}/v1 with {1 + len(extra)} engine(s), " if api else "")
            if warmed:
                what += f"{sum(w['tokens'] for w in warmed)} prompt tokens warm in RAM, "
            print(f"serving {srv.store.home} at {srv.url} ({what}pushes {'on' if token else 'off'}, "
                  f"listings {'signed' if args.sign else 'unsigned'}, "
                  f"API key {_key_mode(api_key)}); Ctrl-C stops", flush=True)
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            srv.close()
    finally:
        for e in extra:
            e.close()
        if mem:
            mem.close()
    return 0


def _close_on_sigterm() -> None:
    """Make SIGTERM end ``serve`` through ``srv.close()`` as Ctrl-C does. uvicorn shuts down gracefully on
    it, then raises the signal again with the handler found before it started; with the default one the
    process died there, before ``close()`` waited for the requests' learned prefixes to be written
    (measured: `bench/serve.py` stopping a server lost the last turn's blocks)."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: whoever embeds it handles its signals
        pass


def _key_mode(api_key: Any) -> str:
    if not api_key:
        return "off: one local trust domain"
    if isinstance(api_key, str) or not getattr(api_key, "named", False):
        return "required: one trust domain"
    return f"required: {len(api_key.entries)} tenants"


def cmd_keygen(args: argparse.Namespace) -> int:
    from .share import SigningKey

    key = SigningKey.generate()
    pub = key.save(args.path)
    _out(args, {"private": args.path, "public": str(pub), "key_id": key.public_key.key_id},
         f"wrote {args.path} (private, keep it) and {pub} (public, give it to importers); "
         f"key id {key.public_key.key_id}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        bid = store.resolve(args.id)
        gone = store.delete(bid, cascade=args.cascade)
    finally:
        store.close()
    _out(args, {"deleted": bid, "deleted_all": gone}, "deleted " + ", ".join(g[:12] for g in gone))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        st = store.stats()
    finally:
        store.close()
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(st.kinds.items())) or "-"
    _out(args, st, "\n".join([
        f"home     {st.home}", f"blocks   {st.blocks:,} ({kinds})", f"tokens   {st.tokens:,}",
        f"on disk  {_size(st.bytes_on_disk)} ({_size(st.bytes_per_token)} per token)"]))
    return 0


def _system_lines() -> list[str]:
    """What llama.cpp sees here, read before a model loads: printed first, so that a user whose host
    breaks a kernel learns the CPU features and devices even if nothing after this line appears."""
    from . import system_report

    info = system_report()
    return [f"llama.cpp    llama-cpp-python {info['llama_cpp_version']}, build {info['llama_build']}, "
            f"GPU offload {'available' if info['gpu_offload'] else 'not built'}",
            f"devices      {'; '.join(info['devices']) or '(not reported by this build)'}",
            f"cpu          {info['system_info']}"]


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import system_report

    if not args.json:
        print("\n".join(_system_lines()), flush=True)
    store = _store(args)
    try:
        fixed = store.reconcile()
        st = store.stats()
        summary = {"blocks": st.blocks, "tokens": st.tokens, "bytes": st.bytes_on_disk, "kinds": st.kinds}
        bad = []
        for b in store.list():
            try:
                store.read_manifest(store.path_of(b.id))
            except Exception as exc:  # report every unreadable block, keep going
                bad.append(f"{b.short_id}: {exc}")
    finally:
        store.close()
    with _memory(args) as mem:
        fp, ex = mem.fingerprint, mem.exactness
        path = mem.engine.model_path
        extra_setting, extra_used = mem.engine.config.extra_bufts, mem.engine.extra_bufts
    report = {"system": system_report(), "weights": {"extra_bufts": extra_setting, "extra_bufts_used": extra_used,
                                                     "weight_buffers": fp.weight_buffers},
              "model": fp.model_name, "model_path": str(path), "fingerprint": fp.model_dump(),
              "fingerprint_digest": fp.digest(), "exactness": ex.model_dump(), "home": str(store.home),
              "store": summary, "reconciled": fixed, "unreadable_blocks": bad}
    lines = [f"model        {fp.model_name}  ({path})", f"model sha256 {fp.model_sha256}",
             f"backend      {fp.backend}",
             f"engine       n_ctx={fp.n_ctx} n_batch={fp.n_batch} n_ubatch={fp.n_ubatch} kv={fp.type_k}/{fp.type_v} "
             f"flash_attn={fp.flash_attn} swa_full={fp.swa_full} threads={fp.n_threads} gpu_layers={fp.n_gpu_layers}",
             f"weights      {fp.weight_buffers} buffers (extra_bufts={extra_setting}: llama.cpp's repack/AMX "
             f"buffer types {'in use' if extra_used else 'off'})",
             f"fingerprint  {fp.digest()}", f"exact        {ex.exact}: {ex.reason}",
             f"store        {store.home}: {summary['blocks']} blocks, {summary['tokens']} tokens, "
             f"{summary['bytes']:,} bytes", f"reconciled   {fixed}",
             f"health       {'ok' if not bad else str(len(bad)) + ' unreadable: ' + '; '.join(bad)}"]
    _out(args, report, "\n".join(lines))
    return 0 if ex.exact and not bad else 1


#: The refund manual as a short conversation: the rules, then three worked cases. SmolLM2-135M is a very
#: small model; with the rules alone it apologises instead of following them, with worked cases in its
#: own chat template it answers the demo task the way the manual says (checked by tests/test_cli.py).
DEMO_MANUAL = [
    {"role": "system", "content": "You are the refund desk of Northwind Outfitters. A purchase less than "
                                  "30 days old is refunded: reply REFUND APPROVED and the ticket code RF- "
                                  "followed by the order digits. Older purchases: reply REFUND DECLINED and "
                                  "offer store credit."},
    {"role": "user", "content": "My order NW-31552 arrived 3 days ago and I want a refund."},
    {"role": "assistant", "content": "REFUND APPROVED. Ticket code: RF-31552."},
    {"role": "user", "content": "My order NW-77810 arrived 95 days ago and I want a refund."},
    {"role": "assistant", "content": "REFUND DECLINED. I can offer you store credit."},
    {"role": "user", "content": "My order NW-60213 arrived 12 days ago and I want a refund."},
    {"role": "assistant", "content": "REFUND APPROVED. Ticket code: RF-60213."},
]
#: what the manual says the answer to DEMO_TASK is
DEMO_EXPECTED = "REFUND APPROVED. Ticket code: RF-20417."


DEMO_DATES = """Date style guide:
Write every date as YYYY-MM-DD. For example, March 7, 2024 is written 2024-03-07.
Never write the month as a word and never put the day first.
"""

DEMO_TASK = "My order NW-20417 arrived 5 days ago and I want a refund."  # 5 days: the manual approves it


def cmd_demo(args: argparse.Namespace) -> int:
    """learn two manuals, recall a task through the router (graft), the same task the text way
    (identical answer, slower), then verify the grafted block against fresh prefills."""
    import importlib.util
    import tempfile
    import time

    home = args.home or tempfile.mkdtemp(prefix="graftmem-demo-")
    args.home = home
    t0 = time.perf_counter()
    from . import system_report

    info = system_report()
    print(f"system: llama.cpp {info['llama_build']} sees {info['system_info']}", flush=True)
    with _memory(args) as mem:
        print(f"engine: {mem.fingerprint.model_name}, exact={mem.exactness.exact} ({mem.exactness.reason}); "
              f"weights in {mem.fingerprint.weight_buffers} buffers (extra_bufts={mem.engine.config.extra_bufts})")
        print(f"store:  {home}")
        block = mem.learn(DEMO_MANUAL, name="refund-manual",
                          when_to_use="a customer asks for a refund of an order")
        mem.learn(DEMO_DATES, name="date-format", chat=True, when_to_use="write or convert a calendar date")
        print(f"learn:  2 manuals; refund-manual = block {block.short_id}, {block.n_tokens} tokens, "
              f"{block.state_size:,} state bytes ({time.perf_counter() - t0:.1f} s including model load)")
        print(f"task:   {DEMO_TASK!r}")
        if importlib.util.find_spec("sentence_transformers") is None:
            print("route:  skipped (install graftmem[router] for recall); grafting refund-manual by id")
            from .memory import continuation_for

            r = mem.ask(block.id, continuation_for(block, DEMO_TASK), max_tokens=40)
            text_way = None
        else:
            r = mem.recall(DEMO_TASK, max_tokens=40)
            print(f"route:  -> {r.block.name if r.block else None} (score {r.score:.3f}; runner-up score "
                  f"{r.runner_up_score if r.runner_up_score is not None else float('nan'):.3f})")
            text_way = mem.recall(DEMO_TASK, max_tokens=40, mode="text")
        rc = r.receipt
        print(f"recall: grafted {rc.tokens_restored} tokens in {rc.restore_ms:.1f} ms, prefilled "
              f"{rc.tokens_prefilled} task tokens in {rc.prefill_ms:.0f} ms, decoded {rc.decode_tokens}")
        print(f"answer: {r.text.strip()!r}")
        print(f"manual: {DEMO_EXPECTED!r} is what the manual says: "
              f"{'followed' if r.text.strip() == DEMO_EXPECTED else 'NOT followed (a 135M model)'}")
        if text_way is not None:
            tc = text_way.receipt
            same = text_way.text == r.text and tc.first_logits_sha256 == rc.first_logits_sha256
            print(f"text way (re-read the manual): prefilled {tc.tokens_prefilled} tokens in {tc.prefill_ms:.0f} ms; "
                  f"answer and logits identical: {'yes' if same else 'NO'}; graft "
                  f"{tc.prefill_ms / max(rc.restore_ms + rc.prefill_ms, 1e-9):.1f}x faster to the first token")
        rep = mem.verify(r.block.id if r.block else block.id, samples=args.samples)
    print(f"verify: SHA-256 equal {rep.sha_equal}/{rep.samples}, max KL {rep.max_kl}, argmax agree "
          f"{rep.argmax_agree}/{rep.samples}, fresh-vs-fresh floor {rep.floor_sha_equal}/{rep.floor_samples}, "
          f"new process {'equal' if rep.cross_process else 'DIFFERENT'}")
    print("OK: the graft is byte-exact" if rep.ok else "MISMATCH: the graft is not exact")
    return 0 if rep.ok else 1


def cmd_solve(args: argparse.Namespace) -> int:
    from . import ExactMatch, Flywheel, Gate, ProgramVerifier, SolverOutput

    # --answer: verify against the known answer; else the method must reproduce the answer (a
    # consistency check of the cached or supplied program, not a proof)
    verifier = ExactMatch({args.problem: args.answer}) if args.answer is not None else ProgramVerifier()
    solver = None
    if args.program:
        src = Path(args.program).read_text(encoding="utf-8")
        solver = lambda problem, budget: SolverOutput(program=src, name=Path(args.program).name)  # noqa: E731
    with _memory(args) as mem:
        sol = Flywheel(mem, verifier, solver=solver, budget=args.budget,
                       gate=None if args.no_gate else Gate()).solve(args.problem)
    _out(args, sol, f"{'solved' if sol.verified else 'UNSOLVED'}  {sol.answer}  source={sol.source}"
                    f"{'/' + sol.method if sol.method else ''}  {sol.tokens_decoded} tokens  {sol.wall_s:.2f} s"
                    + (f"  block {sol.block_id[:12]}" if sol.block_id else "")
                    + (f"  deposited {sol.deposited[:12]}" if sol.deposited else ""))
    return 0 if sol.verified else 1


class _HelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's default when it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" not in text and action.default not in (None, False, argparse.SUPPRESS)
                and action.option_strings and "default" not in text):
            text += " (default: %(default)s)"
        return text


def _global_options(p: argparse.ArgumentParser, default: Any) -> None:
    def d(value: Any) -> Any:
        return argparse.SUPPRESS if default is argparse.SUPPRESS else value

    p.add_argument("--home", default=d(None), help="store directory (default: $GRAFTMEM_HOME or the user data dir)")
    p.add_argument("--store", default=d(None), metavar="URL",
                   help="s3://bucket/prefix: a fleet store in S3-compatible object storage (endpoint and "
                        "credentials from the AWS_* variables; docs/fleet.md), or a directory "
                        "(default: $GRAFTMEM_STORE, else --home)")
    p.add_argument("--model", default=d(None), help="model short name (smollm2, gemma3-270m) or GGUF path "
                                                    "(default: smollm2)")
    p.add_argument("--config", default=d(None), help='engine config as JSON, e.g. \'{"n_ctx": 4096}\'')
    p.add_argument("--json", action="store_true", default=d(False), help="print machine-readable JSON")
    p.add_argument("--url", dest="server_url", default=d(None), metavar="URL",
                   help="search, recall, ask and ls through a running `graftmem serve` (or $GRAFTMEM_URL): "
                        "milliseconds instead of loading the model and the router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graftmem", description="Agent memory made of verified, byte-exact KV-cache blocks.",
                                formatter_class=_HelpFormatter)
    _global_options(p, None)
    # the same options after the subcommand (`graftmem ls --json`): SUPPRESS keeps a value given before it
    after = argparse.ArgumentParser(add_help=False)
    _global_options(after, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[after], formatter_class=_HelpFormatter)
        sp.set_defaults(func=fn)
        return sp

    sp = add("learn", cmd_learn, "learn a text file (or - for stdin) into a block")
    sp.add_argument("file")
    sp.add_argument("--name")
    sp.add_argument("--kind", default="manual")
    sp.add_argument("--when-to-use", default=None, help="which tasks this block serves (embedded for routing)")
    sp.add_argument("--chat", action="store_true", help="store the text as a chat turn, for recall")
    sp.add_argument("--parent", metavar="ID", default=None,
                    help="chain the text on this block (graft it, continue after it; stored as a delta)")
    sp = add("ls", cmd_ls, "list the blocks in the store")
    sp.add_argument("--kind")
    sp = add("show", cmd_show, "show one block's manifest")
    sp.add_argument("id")
    sp = add("ask", cmd_ask, "graft a block and answer a question after it (exit 1 on an empty answer)")
    sp.add_argument("id")
    sp.add_argument("question")
    sp.add_argument("--max-tokens", type=_positive, default=64)
    sp.add_argument("--raw", action="store_true",
                    help="prefill the question as given, even after a chat block (default: as the next user turn)")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="graft the block even if its provenance is unverified (see docs/security.md)")
    _sampling_options(sp)
    sp = add("verify", cmd_verify, "prove graft == fresh prefill, byte for byte (exit 1 on any mismatch)")
    sp.add_argument("id")
    sp.add_argument("--samples", type=_positive, default=50)
    sp.add_argument("--no-cross-process", action="store_true", help="skip the graft in a new process")
    sp.add_argument("--rederive", action="store_true",
                    help="instead: re-prefill the block's stored tokens and compare the state bytes")
    sp = add("recall", cmd_recall, "route a task to one block, graft it and answer (exit 1 if nothing matched)")
    sp.add_argument("task")
    sp.add_argument("--max-tokens", type=_positive, default=64)
    sp.add_argument("--min-score", type=float, default=None, help="refuse to graft below this routing score (default: the router's threshold, docs/routing.md)")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="graft the routed block even if its provenance is unverified")
    _sampling_options(sp)
    sp = add("search", cmd_search, "rank the blocks for a task without grafting anything")
    sp.add_argument("task")
    sp.add_argument("--top-k", type=_positive, default=5)
    add("reindex", cmd_reindex, "rebuild the routing index from the store")
    sp = add("learn-document", cmd_learn_document,
             "learn a long text file as pages that fit the window (resumable; exit 1 if incomplete)")
    sp.add_argument("file")
    sp.add_argument("--document", default=None, help="document id (default: a hash of the text)")
    sp.add_argument("--name", default=None)
    sp.add_argument("--window", type=int, default=None, help="page size in tokens (default: n_ctx - 256)")
    sp.add_argument("--overlap", type=int, default=None, help="tokens repeated between pages (default 64)")
    sp = add("recall-document", cmd_recall_document,
             "route a question to one page of a learned document, graft only that page and answer")
    sp.add_argument("task")
    sp.add_argument("--prompt", default=None, help="what to prefill after the page (default: a blank line + task)")
    sp.add_argument("--document", default=None, help="only this document's pages")
    sp.add_argument("--max-tokens", type=_positive, default=32)
    sp.add_argument("--min-score", type=float, default=None, help="refuse to graft below this routing score (default: the router's threshold, docs/routing.md)")
    sp = add("delete", cmd_delete, "delete a block (refused for a block with chained children unless --cascade)")
    sp.add_argument("id")
    sp.add_argument("--cascade", action="store_true", help="also delete every block chained on it")
    add("stats", cmd_stats, "store totals")
    sp = add("solve", cmd_solve, "answer a problem from a verified block, by transfer or live; deposit what "
                                 "the verifier accepts (exit 1 if unsolved)")
    sp.add_argument("problem")
    sp.add_argument("--answer", help="the known answer (verify by exact match); without it the method must "
                                     "reproduce the answer")
    sp.add_argument("--program", help="a Python file printing the answer, used as the solver (run sandboxed)")
    sp.add_argument("--budget", type=int, default=512, help="tokens the model may decode live")
    sp.add_argument("--no-gate", action="store_true", help="use a routed block even if the model is confident")

    def trust_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--incompatible", choices=["refuse", "keep-apart", "skip"], default="refuse",
                        help="blocks made by another engine: refuse all (default), keep them apart "
                             "in <home>/foreign, or leave them out")
        sp.add_argument("--require-signature", action="store_true",
                        help="refuse unsigned bundles and keys not trusted (also: trust.json in the home)")
        sp.add_argument("--trust", action="append", metavar="KEY.pub", help="trust this public key")
        sp.add_argument("--rederive", action=argparse.BooleanOptionalAction, default=True,
                        help="re-prefill each new unsigned block here and refuse unless the state is equal "
                             "(default); --no-rederive lands them unverified (never grafted without "
                             "--allow-unverified, never routed)")

    sp = add("upload", cmd_upload, "copy every block of a local store into the fleet store of --store s3://... "
                                   "(create-once: blocks already there are skipped)")
    sp.add_argument("source", help="the local store directory (a home)")
    sp = add("export", cmd_export, "write blocks (default all) to one bundle file")
    sp.add_argument("path")
    sp.add_argument("ids", nargs="*", help="block ids or prefixes (default: all)")
    sp.add_argument("--kind")
    sp.add_argument("--sign", metavar="KEY", help="sign the bundle with this private key")
    sp = add("import", cmd_import, "import a bundle: every digest checked, all or nothing")
    sp.add_argument("path")
    trust_args(sp)
    sp = add("serve", cmd_serve, "one long-running server: the OpenAI-compatible API with a persistent, "
             "verified prompt cache, and block sharing (read-only unless a push token is set)")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--api-key", help="require this key on every request (or $GRAFTMEM_API_KEY): one trust domain")
    sp.add_argument("--api-key-file", metavar="PATH",
                    help="one tenant per line, 'NAME sha256:<hex of the key>': each key's tenant gets its own "
                         "prompt cache, automatic blocks and receipts (docs/security.md)")
    sp.add_argument("--blocks-only", action="store_true",
                    help="serve block sharing only: no model is loaded, no OpenAI API")
    sp.add_argument("--engines", type=int, default=1, help="engine contexts (requests decoded at once)")
    sp.add_argument("--max-queue", type=int, default=16, help="requests that may wait; more get 429")
    sp.add_argument("--min-prefix-tokens", type=int, default=256,
                    help="learn a prompt prefix (up to the last message) of at least this many tokens...")
    sp.add_argument("--sightings", type=int, default=2, help="...once it has been seen this many times")
    sp.add_argument("--no-learn", action="store_true", help="graft stored prefixes but learn no new ones")
    sp.add_argument("--max-auto-mb", type=int, default=2048,
                    help="keep automatic prefix blocks under this many MB (least recently used evicted first; "
                         "blocks you learned are never evicted)")
    sp.add_argument("--auto-storage", choices=("full", "delta"), default="full",
                    help="store automatic chained blocks whole (fast grafts) or as deltas over their parent (less disk)")
    sp.add_argument("--no-warm", action="store_true",
                    help="start with empty engines instead of grafting the most recently learned prompt prefixes")
    sp.add_argument("--chat-template-file", metavar="FILE",
                    help="render chat requests with this Jinja template instead of the GGUF's own (docs/models.md)")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="graft blocks nothing here vouches for (imported with --no-rederive, dropped into the "
                         "store) for every request and the warm start; without it only a request that sends "
                         "graftmem.allow_unverified gets them, and receipts name the provenance")
    sp.add_argument("--port", type=_port, default=8765, help="0 picks a free port")
    sp.add_argument("--push-token", help="accept pushes with this token (or $GRAFTMEM_PUSH_TOKEN)")
    sp.add_argument("--sign", metavar="KEY", help="sign listings with this private key")
    sp.add_argument("--rederive", action=argparse.BooleanOptionalAction, default=True,
                    help="re-prefill every pushed block not signed by a trusted key and refuse it unless "
                         "the state is equal (default); --no-rederive lands them unverified")
    sp = add("pull", cmd_pull, "copy blocks from a graftmem server, checked as they arrive, resumable")
    sp.add_argument("url")
    sp.add_argument("ids", nargs="*", help="block ids or prefixes (default: all)")
    sp.add_argument("--kind")
    trust_args(sp)
    sp = add("push", cmd_push, "send blocks to a graftmem server that accepts pushes")
    sp.add_argument("url")
    sp.add_argument("ids", nargs="*", help="block ids or prefixes (default: all)")
    sp.add_argument("--kind")
    sp.add_argument("--token", help="the server's push token (or $GRAFTMEM_PUSH_TOKEN)")
    sp.add_argument("--sign", metavar="KEY", help="sign the pushed bundle with this private key")
    sp = add("keygen", cmd_keygen, "make an ed25519 key pair for signing bundles (PATH and PATH.pub)")
    sp.add_argument("path")
    add("doctor", cmd_doctor, "model, fingerprint, exactness probe, store location and health")
    sp = add("demo", cmd_demo, "learn, recall and verify on the default model (the README's first command)")
    sp.add_argument("--samples", type=_positive, default=20)
    for sp in sub.choices.values():  # options without a help text still show their default
        for action in sp._actions:
            if action.help is None and action.option_strings and action.default not in (None, False):
                action.help = "(default: %(default)s)"
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import GraftmemError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except GraftmemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, UnicodeError) as exc:  # bad input the API did not name: still one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
