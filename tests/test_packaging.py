"""The install a newcomer runs: the README's documented command (from a clone: graftmem is on no package
index), run from a copy of this tree in a fresh venv, then the README quickstart from there (its part that
needs no router: learn, ask, verify) with ``python`` in a brand-new process: the suite's cold run of the
README quickstart (tests/test_docs.py runs the whole block in its warm snippet runner). The wheel that
command built from the tree is checked too, by the file list pip installed from it (its RECORD).

pip resolves llama-cpp-python from its wheel cache (the first build, ~7 min, happened when the dev
environment was set up), so this costs about a minute. It needs the package registry, as any install does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _readme_install_line() -> str:
    """The README's install command for the library itself (the line after the torch one)."""
    block = re.search(r"## Install as a library\n.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert block, "the README has an install block"
    lines = [ln.split("#")[0].strip() for ln in block.group(1).splitlines()]
    # a package name nobody can resolve is what a newcomer hit: the command installs this clone
    assert not any("graftmem[" in ln for ln in lines), lines
    line = next(ln for ln in lines if ln.startswith("pip install") and "torch" not in ln)
    m = re.fullmatch(r'pip install "\.\[([a-z,]+)\]"', line)
    assert m, f"the README's install line should install this clone: {line!r}"
    assert {"models", "router"} <= set(m.group(1).split(",")), line
    return line


def _copy_tree(dest: Path) -> Path:
    """The files a clone has (tracked, plus new files not ignored), without build outputs or the venv."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(src.read_bytes())
    return dest


def _readme_quickstart_without_router() -> str:
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert block, "the README has a Python quickstart"
    code = block.group(1)
    cut = code.index("    # recall:")  # the router part needs the [router] extra (torch): not installed here
    # 5 verify samples instead of 50: this test is about the install; the 50 run in tests/test_docs.py
    assert code.count("samples=50") == 1 and "# True 50 0.0" in code
    return code[:cut].replace("samples=50", "samples=5")


@pytest.mark.slow
def test_readme_install_from_a_clone_runs_the_quickstart_in_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # PIP_NO_COMPILE: no .pyc for the ~40 installed packages (5 s here; the first import writes them if needed)
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_COMPILE="1", GRAFTMEM_HOME=str(tmp_path / "home"))
    # the README's documented command, run in a clone (here a copy of the tree), with [models] only:
    # [router] needs torch, which the README installs first and which is too large for this test
    _readme_install_line()
    clone = _copy_tree(tmp_path / "clone")
    inst = subprocess.run([str(py), "-m", "pip", "install", "-q", ".[models]"], capture_output=True,
                          text=True, env=env, cwd=clone, timeout=1200)
    assert inst.returncode == 0, inst.stderr[-3000:]

    script = tmp_path / "quickstart.py"
    script.write_text(_readme_quickstart_without_router())
    run = subprocess.run([str(py), str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "True 5 0.0" in run.stdout, run.stdout  # report.ok, 5/5 SHA-equal, max KL 0
    # the installed package is the venv's copy, not this checkout's (nor an editable link to the clone)
    where = subprocess.run([str(py), "-c", _WHERE], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    info = json.loads(where.stdout)
    assert info["file"].startswith(str(venv)) and not info["editable"], info
    # what the wheel pip built held: the files its RECORD lists (pip adds only its own INSTALLER,
    # REQUESTED and direct_url.json; no .pyc: PIP_NO_COMPILE)
    names = info["record"]
    assert "graftmem/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names), names
    assert "graftmem/core/engine.py" in names and not any(n.startswith("tests/") for n in names)
    # the /ui page's files ship in the package (package-data): `serve --ui` fetches nothing at run time
    assert {f"graftmem/server/ui/static/{n}" for n in ("index.html", "ui.js", "ui.css")} <= set(names), names


#: the installed graftmem: where it imports from, whether pip installed it editable, its RECORD
_WHERE = """
import json
from importlib.metadata import distribution

import graftmem

dist = distribution("graftmem")
url = json.loads(dist.read_text("direct_url.json") or "{}")
print(json.dumps({"file": graftmem.__file__, "editable": bool(url.get("dir_info", {}).get("editable")),
                  "record": [str(f) for f in dist.files or []]}))
"""
