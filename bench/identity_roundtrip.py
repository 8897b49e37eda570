"""The held-out check of issue 38: every block a served store made leaves it and grafts exactly on arrival.

Today's failure it guards against: block ids are made with salts (the tenant, a stored response, the
one-token thread count) and a reader that recomputed the id without them refused the block as forged,
so ``graftmem export`` exited 2 on the first salted block and nothing a server made could leave it.

On loopback, with SmolLM2 (the default model) and the real CLI:

1. ``graftmem serve`` with two tenants' keys (``--api-key-file``) learns: each tenant's chat turns over a
   long system prompt (automatic prefix chains, tenant-salted), a stored Responses turn (``store: true``)
   and its continuation (``previous_response_id``: response-salted blocks), and a tenant's
   ``POST /v1/memory/learn``; then it is stopped (a graceful stop flushes the prefix writer).
2. ``graftmem export`` of every block into one bundle, ``graftmem import`` of it into another home with
   the default re-derivation (each block re-prefilled there and refused unless its state is equal).
3. ``graftmem serve`` over the first store again, ``graftmem pull`` from it into a third home with each
   tenant's key (a tenant sees its blocks and the shared ones; together they are every block).
4. In each destination: every block present under the same id, its provenance, and
   `Memory.verify` (graft then query vs a fresh prefill then query, logits SHA-256, ``--samples``
   queries): byte-identical.

Prints a table and writes bench/results/identity_roundtrip.json. Exit 1 if any block is missing or
not exact, or a CLI step fails.

    python -m bench.identity_roundtrip [--samples 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from bench.harness import RESULTS, ROOT, write_results
from graftmem import Memory
from graftmem.server import hash_key
from graftmem.store import Store
from tests.conftest import long_text

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-9876543210"}
MODEL = "smollm2"


def cli(home: Path, *argv: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """``python -m graftmem --home HOME ARGV`` (the installed CLI, this checkout's code)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "graftmem", "--home", str(home), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def serving(home: Path, keys: Path, *extra: str) -> Iterator[str]:
    """``graftmem serve`` on a free loopback port over ``home`` with the tenants of ``keys``; its URL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    log = open(home.parent / f"serve-{home.name}.log", "a")
    proc = subprocess.Popen([sys.executable, "-m", "graftmem", "--home", str(home), "serve", "--port", "0",
                             "--api-key-file", str(keys), *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    try:
        url = None
        for _ in range(50):  # bounded: the banner's first lines name the URL
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise SystemExit(f"graftmem serve did not start (see {log.name})")
        yield url
    finally:
        proc.terminate()  # graceful: the prefix writer is flushed before exit
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def _post(url: str, path: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"POST {path}: {r.status_code} {r.text[:300]}")
    return r.json()


def make_store(url: str, system_words: int) -> dict[str, Any]:
    """What a served store holds after a short day of two tenants: chat prefixes, a stored response and
    its continuation, a tenant's learned block."""
    made: dict[str, Any] = {}
    for tenant, seed in (("alice", 3), ("bob", 5)):
        system = f"You are {tenant}'s assistant. " + long_text(system_words, seed=seed)
        msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
        for turn, q in enumerate(("What is two plus two?", "And three plus three?", "Thanks. Bye.")):
            msgs.append({"role": "user", "content": q})
            out = _post(url, "/v1/chat/completions", KEYS[tenant],
                        {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0})
            msgs.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or "OK"})
            made.setdefault("chat_cached_tokens", []).append(
                out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
    first = _post(url, "/v1/responses", KEYS["alice"],
                  {"model": MODEL, "input": "Name a colour.", "store": True, "max_output_tokens": 4,
                   "instructions": "You answer in one word."})
    second = _post(url, "/v1/responses", KEYS["alice"],
                   {"model": MODEL, "input": "Another one.", "store": True, "max_output_tokens": 4,
                    "previous_response_id": first["id"]})
    made["responses"] = [first["id"], second["id"]]
    learned = _post(url, "/v1/memory/learn", KEYS["bob"],
                    {"text": "Refunds: open the order page, press Refund, quote the ticket number.",
                     "name": "refunds", "chat": True})
    made["learned"] = learned.get("id") or learned.get("block", {}).get("id")
    return made


def describe(store: Store) -> dict[str, dict[str, Any]]:
    """Each block: kind, tokens, parent, the salts its metadata records, provenance."""
    out = {}
    for b in store.list():
        meta = b.metadata or {}
        salts = [k for k in ("tenant", "response", "one_token_calls") if meta.get(k) is not None]
        out[b.id] = {"kind": b.kind, "tokens": b.n_tokens, "parent": b.parent, "salts": salts,
                     "provenance": store.provenance(b.id)}
    return out


def verify_all(home: Path, ids: list[str], samples: int) -> dict[str, dict[str, Any]]:
    """`Memory.verify` of each block present in ``home`` (graft + query vs fresh prefill + query)."""
    out: dict[str, dict[str, Any]] = {}
    with Memory(home=home, model=MODEL) as m:
        have = {b.id for b in m.store.list()}
        for bid in ids:
            if bid not in have:
                out[bid] = {"present": False, "exact": False}
                continue
            t0 = time.perf_counter()
            rep = m.verify(bid, samples=samples, cross_process=False, record=False)
            out[bid] = {"present": True, "exact": rep.ok, "sha_equal": rep.sha_equal, "samples": rep.samples,
                        "provenance": m.store.provenance(bid), "s": round(time.perf_counter() - t0, 2)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2, help="verify queries per block (default: 2)")
    ap.add_argument("--system-words", type=int, default=150, help="words of each tenant's system prompt")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="graftmem-idrt-"))
    work.mkdir(parents=True, exist_ok=True)
    keys = work / "keys.txt"
    keys.write_text("".join(f"{n} {hash_key(k)}\n" for n, k in KEYS.items()))
    served, imported, pulled = work / "served", work / "imported", work / "pulled"
    steps: dict[str, Any] = {}

    t0 = time.perf_counter()
    with serving(served, keys, "--min-prefix-tokens", "16", "--sightings", "1") as url:
        made = make_store(url, args.system_words)
    steps["serve"] = {"s": round(time.perf_counter() - t0, 1), **made}
    st = Store(served)
    blocks = describe(st)
    st.close()
    ids = sorted(blocks)

    bundle = work / "all.gmb"
    t0 = time.perf_counter()
    r = cli(served, "export", str(bundle))
    steps["export"] = {"rc": r.returncode, "s": round(time.perf_counter() - t0, 1), "err": r.stderr.strip()[-400:]}
    t0 = time.perf_counter()
    r = cli(imported, "import", str(bundle)) if bundle.exists() else None
    steps["import"] = {"rc": r.returncode if r else None, "s": round(time.perf_counter() - t0, 1),
                       "err": (r.stderr.strip()[-400:] if r else "no bundle")}
    t0 = time.perf_counter()
    with serving(served, keys, "--no-learn", "--no-warm") as url:
        steps["pull"] = {}
        for tenant, key in KEYS.items():
            r = cli(pulled, "pull", url, "--api-key", key)
            steps["pull"][tenant] = {"rc": r.returncode, "err": r.stderr.strip()[-400:]}
    steps["pull"]["s"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    checks = {"served": verify_all(served, ids, args.samples), "imported": verify_all(imported, ids, args.samples),
              "pulled": verify_all(pulled, ids, args.samples)}
    steps["verify_s"] = round(time.perf_counter() - t0, 1)

    print(f"{'block':14} {'kind':9} {'tok':>5} {'salts':28} " + " ".join(f"{h:>16}" for h in checks))
    for bid in ids:
        b = blocks[bid]
        cells = []
        for h in checks:
            c = checks[h][bid]
            cells.append(f"{'exact' if c['exact'] else ('MISMATCH' if c['present'] else 'MISSING'):>8} "
                         f"{str(c.get('provenance') or '-')[:7]:>7}")
        print(f"{bid[:12]:14} {b['kind'][:9]:9} {b['tokens']:5} {','.join(b['salts'])[:28]:28} " + " ".join(cells))
    summary = {h: {"blocks": len(ids), "present": sum(c["present"] for c in checks[h].values()),
                   "exact": sum(c["exact"] for c in checks[h].values())} for h in checks}
    kinds: dict[str, int] = {}
    for b in blocks.values():
        kinds[b["kind"]] = kinds.get(b["kind"], 0) + 1
    salted = sum(bool(b["salts"]) for b in blocks.values())
    print(f"\n{len(ids)} blocks ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}; {salted} salted)")
    for step in ("export", "import"):
        print(f"{step}: exit {steps[step]['rc']} in {steps[step]['s']} s {steps[step]['err'][-160:]!r}"
              if steps[step]["rc"] else f"{step}: exit 0 in {steps[step]['s']} s")
    print("pull: " + ", ".join(f"{t} exit {steps['pull'][t]['rc']}" for t in KEYS) + f" in {steps['pull']['s']} s")
    for h, s in summary.items():
        print(f"{h:9} {s['present']}/{s['blocks']} present, {s['exact']}/{s['blocks']} exact")
    ok = (steps["export"]["rc"] == 0 and steps["import"]["rc"] == 0
          and all(steps["pull"][t]["rc"] == 0 for t in KEYS)
          and all(s["present"] == s["exact"] == s["blocks"] for s in summary.values()) and len(ids) > 0)
    path = write_results(RESULTS / "identity_roundtrip.json",
                         {"ok": ok, "model": MODEL, "samples": args.samples, "kinds": kinds, "salted": salted,
                          "steps": steps, "summary": summary, "blocks": blocks, "checks": checks}, args=args)
    print(f"{'OK' if ok else 'FAILED'}; results in {path.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
