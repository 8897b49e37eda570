"""Helper run as ``python -m graftmem.memory.child``: graft a block in a brand-new process.

Reads a JSON spec on stdin (home, model path, engine config, block id, queries) and prints the
SHA-256 of the first-step logits for each query. Used by verification to prove that a block written
by one process grafts byte-exactly in another.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    spec = json.loads(sys.stdin.read())
    from ..core.blocks import EngineConfig
    from ..core.engine import Engine, logits_sha256
    from ..store.local import Store
    from .exactness import graft_logits

    config = EngineConfig(**{**spec["config"], "probe": False})
    with Engine(spec["model"], config) as engine:
        store = Store(spec["home"])
        try:
            shas = [logits_sha256(graft_logits(engine, store, spec["block"], engine.tokenize(q, add_special=False)))
                    for q in spec["queries"]]
        finally:
            store.close()
    sys.stdout.write(json.dumps({"sha256": shas}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
