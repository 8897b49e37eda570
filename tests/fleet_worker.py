"""One worker of the fleet test (tests/test_fleet_cluster.py), run as its own process:

    python tests/fleet_worker.py CONFIG.json

It loads the model at the config's ``model`` (a GGUF path or a short name), learns its texts into the
bucket, then asks blocks that any worker learned (from the listing) and compares each graft's
first-token logits with a fresh prefill of the block's own tokens. Everything
it does is appended to its report (JSON lines, flushed per line) so that a worker killed with -9
has reported exactly what it finished: ``learned`` (an id, after ``learn`` returned), ``reading`` (an
ask began), ``graft`` (id, exact or not), ``error`` (a typed error and its message), ``uploading`` (a
block upload began). It reads until the test creates its ``stop_file`` (or ``read_seconds`` /
``max_asks``, safety bounds, run out).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

QUERY = " Next:"


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    report = open(cfg["report"], "a", buffering=1)

    def emit(**kw) -> None:
        report.write(json.dumps({"t": time.time(), "pid": os.getpid(), **kw}) + "\n")

    from graftmem import FleetStore, GraftmemError, Memory
    from graftmem.core.engine import Engine, logits_sha256
    from graftmem.store import RetryPolicy

    store = FleetStore(cfg["url"], cache_dir=cfg["cache"], poll_interval=0.5, cache_bytes=cfg["cache_bytes"],
                       retry=RetryPolicy(retries=6, retry_timeout=20.0, max_backoff=2.0, connect_timeout=2.0))
    if cfg.get("announce_upload"):  # the victim: say when a block upload begins, so the test can kill it then
        real = store.bucket.put

        def put(key, data, **kw):
            if key.startswith("blocks/") or "/blocks/" in key:
                emit(event="uploading", key=key)
            return real(key, data, **kw)
        store.bucket.put = put  # type: ignore[method-assign]
    # one thread each: five processes share the test machine's cores
    eng = Engine(cfg["model"], {"n_threads": 1, "n_ctx": 2048, "probe": False})
    mem = Memory(engine=eng, store=store)
    emit(event="ready")
    for name, text in cfg["texts"]:
        try:
            b = mem.learn(text, name=name)
            emit(event="learned", id=b.id, name=name)
        except GraftmemError as exc:
            emit(event="error", op="learn", type=type(exc).__name__, msg=str(exc)[:300])
    rng = random.Random(cfg["seed"])
    # read until the test says stop (its stop file), bounded in time and count for safety
    stop = Path(cfg["stop_file"]) if cfg.get("stop_file") else None
    deadline = time.monotonic() + cfg["read_seconds"]
    asks = 0
    while time.monotonic() < deadline and asks < cfg["max_asks"] and not (stop and stop.exists()):
        try:
            blocks = [b for b in mem.get_all() if b.n_tokens < 1000]
        except GraftmemError as exc:
            emit(event="error", op="list", type=type(exc).__name__, msg=str(exc)[:300])
            time.sleep(0.3)
            continue
        if not blocks:
            time.sleep(0.3)
            continue
        b = rng.choice(blocks)
        emit(event="reading", id=b.id)
        try:
            got = mem.ask(b.id, QUERY, max_tokens=1).receipt.first_logits_sha256
        except GraftmemError as exc:
            emit(event="error", op="ask", id=b.id, type=type(exc).__name__, msg=str(exc)[:300])
            continue
        with eng.session():
            eng.prefill(list(b.tokens))
            eng.prefill(eng.tokenize(QUERY, add_special=False))
            fresh = logits_sha256(eng.logits())
        emit(event="graft", id=b.id, exact=got == fresh)
        asks += 1
    emit(event="done", asks=asks, counters=store.counters)
    mem.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
