"""The memory's verbs as commands: learn, ls, show, ask, verify, recall, documents, search, delete,
stats, solve. Each calls the public API (or the server, with ``--url``) and prints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .common import (_access, _answered, _label, _memory, _out, _read_text, _sampling, _scope_kw, _scoped, _size,
                     _store, _table)
from .remote import _client, _greedy_remote, _server


def cmd_learn(args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    text = _read_text(args.file)
    started = datetime.now(timezone.utc)
    with _memory(args) as mem:
        block = mem.learn(text, name=args.name or (None if args.file == "-" else Path(args.file).stem),
                          kind=args.kind, progress=not (args.json or args.quiet), when_to_use=args.when_to_use,
                          chat=args.chat, parent=args.parent, **_scope_kw(args))
    already = block.created_at < started  # content-addressed: the same text is the same block
    if args.quiet and not args.json:  # the id alone, so that a shell script can keep it in a variable
        print(block.id)
        return 0
    _out(args, {"id": block.id, "name": block.name, "n_tokens": block.n_tokens,
                "state_size": block.state_size, "already_stored": already},
         f"{'already stored' if already else 'learned'} {block.short_id}  {block.name}  "
         f"{block.n_tokens} tokens  {_size(block.state_size)} of state"
         + ("  (nothing prefilled)" if already else ""))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    if (url := _server(args)) is not None:
        lines = _client(url).ls(kind=args.kind, **_scope_kw(args))  # the server's summaries, as _summary's
        data: Any = lines
    else:
        with _access(args) as (_, access, scope):
            blocks = access.list(kind=args.kind, scope=scope)
        lines = [_summary(b) for b in blocks]
        data = [b.model_dump(exclude={"tokens", "text"}) | {"provenance": b.provenance,
                                                            "labels_trusted": b.labels_trusted} for b in blocks]
    # "verified" is `Block.verified_here` (the server's listing too): "-" beside provenance unverified
    rows = [[d["id"][:12], d["kind"], d["n_tokens"], f"{d['state_size']:,}", d.get("model") or "-",
             d.get("settings") or "-", {True: "yes", False: "NO"}.get(d.get("verified"), "-"),
             d.get("provenance") or "-", _label((d["name"] or "")[:40], d)] for d in lines]
    _out(args, data, _table(rows, ["id", "kind", "tokens", "state bytes", "model", "settings", "verified",
                                   "provenance", "name"])
         if rows else "(no blocks" + (" in this scope)" if _scoped(args) else ")"))
    return 0


def _summary(b: Any) -> dict[str, Any]:
    """A local block as the server's listing line (`graftmem.api.BlockSummary`'s fields), so ``ls``
    prints local and remote stores alike."""
    return {"id": b.id, "name": b.name, "kind": b.kind, "n_tokens": b.n_tokens, "state_size": b.state_size,
            "model": b.fingerprint.model_name, "settings": b.fingerprint.settings, "verified": b.verified_here,
            "provenance": b.provenance, "labels_trusted": b.labels_trusted}


def cmd_show(args: argparse.Namespace) -> int:
    with _access(args) as (_, access, scope):
        b = access.get(args.id, scope)
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


def cmd_ask(args: argparse.Namespace) -> int:
    if (url := _server(args)) is not None:
        _greedy_remote(args)
        r = _client(url).ask(args.id, args.question, max_tokens=args.max_tokens, turn=not args.raw, stop=args.stop,
                             **_scope_kw(args))
        rc = r["receipt"]
        _out(args, r, f"{r['text']}\n\n-- {rc['tokens_restored']} tokens restored in {rc['restore_ms']:.1f} ms, "
                      f"{rc['tokens_prefilled']} prefilled; exact={rc['exact']} (through {url})")
        return 0 if r["tokens"] else 1
    from ..memory import continuation_for

    if _scoped(args):  # the block must be the scope's, as through the server (else: not found)
        with _access(args) as (_, access, scope):
            access.get(args.id, scope)
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
    from .. import Recall

    if (url := _server(args)) is not None:
        _greedy_remote(args)
        r = Recall.model_validate(_client(url).recall(args.task, max_tokens=args.max_tokens, min_score=args.min_score,
                                                      stop=args.stop, **_scope_kw(args)))
    else:
        with _memory(args) as mem:
            kw = dict(max_tokens=args.max_tokens, min_score=args.min_score, sampling=_sampling(args),
                      stop=args.stop, allow_unverified=args.allow_unverified, **_scope_kw(args))
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
    hint = None
    if (url := _server(args)) is not None:  # dicts, not SearchHit: the client path imports no pydantic
        hits = _client(url).search(args.task, top_k=args.top_k, **_scope_kw(args))
    else:
        from ..memory import other_engines_hint

        with _memory(args) as mem:
            found = mem.search(args.task, top_k=args.top_k, **_scope_kw(args))
            hint = None if found else other_engines_hint(mem.store, mem.fingerprint)
        hits = [h.model_dump() for h in found]
    rows = [[i + 1, f"{h['score']:.3f}", h["block_id"][:12], h["n_tokens"], h["name"][:40],
             (h.get("when_to_use") or "")[:50]] for i, h in enumerate(hits)]
    _out(args, hits, _table(rows, ["#", "score", "id", "tokens", "name", "when to use"]) if rows
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


def cmd_delete(args: argparse.Namespace) -> int:
    from .. import ConfigError

    if args.id is None and not _scoped(args):
        raise ConfigError("give a block id, or a scope (--user-id/--agent-id/--session-id) to forget all its blocks")
    if (url := _server(args)) is not None:
        client = _client(url)
        ids = [args.id] if args.id is not None else [d["id"] for d in client.ls(**_scope_kw(args))]
        gone = [g for i in ids for g in client.delete(i, cascade=args.cascade, **_scope_kw(args))["deleted"]]
        _out(args, {"deleted": ids[0] if args.id else None, "deleted_all": gone, "kept": []},
             "deleted " + (", ".join(g[:12] for g in gone) or "nothing"))
        return 0
    with _access(args) as (_, access, scope):
        if args.id is None:  # forget the scope: its blocks nobody else learned go, shared ones stay theirs
            gone, kept = access.forget_scope(scope, cascade=args.cascade)
            bid = None
        else:
            bid, gone, _ = access.delete(args.id, scope, cascade=args.cascade)
            access.forget(gone, cascade_from=bid)
            kept = []
    _out(args, {"deleted": bid, "deleted_all": gone, "kept": kept},
         "deleted " + (", ".join(g[:12] for g in gone) or "nothing")
         + (f"; kept {len(kept)} block(s) other scopes also learned: {', '.join(k[:12] for k in kept)}"
            if kept else ""))
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


def cmd_solve(args: argparse.Namespace) -> int:
    from .. import ExactMatch, Flywheel, Gate, ProgramVerifier, SolverOutput

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
