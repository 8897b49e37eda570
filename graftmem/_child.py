"""Helper run as ``python -m graftmem._child``: graft a block in a brand-new process.

Reads a JSON spec on stdin (home, model path, engine config, block id, queries) and prints the
SHA-256 of the first-step logits for each query. Used by verification to prove that a block written
by one process grafts byte-exactly in another.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    spec = json.loads(sys.stdin.read())
    from ._blocks import EngineConfig
    from ._engine import logits_sha256
    from ._memory import Memory
    from ._verify import graft_logits

    config = EngineConfig(**{**spec["config"], "probe": False})
    with Memory(spec["model"], home=spec["home"], config=config) as mem:
        shas = []
        for q in spec["queries"]:
            toks = mem.engine.tokenize(q, add_special=False)
            shas.append(logits_sha256(graft_logits(mem, spec["block"], toks)))
    sys.stdout.write(json.dumps({"sha256": shas}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
