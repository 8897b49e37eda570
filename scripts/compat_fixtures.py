"""Write a set of format-compatibility fixtures with an OLD graftmem, on this machine.

    python scripts/compat_fixtures.py --commit ae7fbb1 --out tests/data/compat-avx2

tests/test_compat.py checks that blocks and bundles written before the layered layout are read, and
graft byte-exactly, today. A block carries its engine fingerprint (CPU features included: another
CPU's kernels round differently), so a fixture set grafts only on a machine of the kind that wrote
it; elsewhere the test checks the refusal and the kept-apart import instead. This script adds a set
for the machine it runs on, written by the code of ``--commit`` (checked out into a temporary git
worktree and run in a child process, so nothing of today's code writes the fixtures): a root block,
a chained child, a bundle of both and ``old_blocks.json`` describing them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOT_TEXT = "Refunds: ask for the order number first."
CHILD_TEXT = " Then check the date."

_CHILD = r"""
import json, shutil, sys
from pathlib import Path
from graftmem import Memory
out, home, commit, root_text, child_text = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
config = {"n_ctx": 512}
with Memory("smollm2", home=home, config={**config, "probe": False}) as m:
    root = m.learn(root_text, name="root")
    child = m.learn(child_text, name="child", parent=root.id)
    m.export(out / "old.gmbundle", [root.id, child.id])
    for b in (root, child):
        shutil.copy(m.store.path_of(b.id), out / f"{b.id}.gmb")
    meta = {"root": root.id, "child": child.id, "root_text": root_text, "child_text": child_text,
            "config": config, "root_state_digest": root.state_digest,
            "child_full_state_digest": child.full_state_digest,
            "cpu_features": root.fingerprint.cpu_features,
            "written_by": f"graftmem at commit {commit}, run by scripts/compat_fixtures.py"}
    (out / "old_blocks.json").write_text(json.dumps(meta, indent=1) + "\n")
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", required=True, help="the old commit whose code writes the fixtures")
    ap.add_argument("--out", required=True, type=Path, help="a new directory under tests/data/")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        ap.error(f"{out} exists: pick a new directory (fixtures are never rewritten in place)")
    with tempfile.TemporaryDirectory(prefix="graftmem-compat-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), args.commit], cwd=ROOT, check=True)
        try:
            out.mkdir(parents=True)
            subprocess.run([sys.executable, "-c", _CHILD, str(out), str(Path(tmp) / "home"), args.commit,
                            ROOT_TEXT, CHILD_TEXT], cwd=tree, env={"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1",
                                                                 "PATH": "/usr/bin:/bin"}, check=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    print(f"wrote {sorted(p.name for p in out.iterdir())} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
