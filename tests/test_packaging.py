"""The wheel a user installs: built from this tree, installed into a fresh venv with the documented
command, and the README quickstart run from there (its part that needs no router: learn, ask, verify).

pip resolves llama-cpp-python from its wheel cache (the first build, ~7 min, happened when the dev
environment was set up), so this costs about a minute. It needs the package registry, as any install does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _readme_quickstart_without_router() -> str:
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert block, "the README has a Python quickstart"
    code = block.group(1)
    cut = code.index("    # recall:")  # the router part needs the [router] extra (torch): not installed here
    return code[:cut]


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_the_quickstart(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("graftmem-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "graftmem/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names), names
    assert "graftmem/core/engine.py" in names and not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", GRAFTMEM_HOME=str(tmp_path / "home"))
    # the README's documented command, with the wheel in place of the index name
    inst = subprocess.run([str(py), "-m", "pip", "install", "-q", f"{wheel}[models]"], capture_output=True,
                          text=True, env=env, timeout=1200)
    assert inst.returncode == 0, inst.stderr[-3000:]

    script = tmp_path / "quickstart.py"
    script.write_text(_readme_quickstart_without_router())
    run = subprocess.run([str(py), str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "True 50 0.0" in run.stdout, run.stdout  # report.ok, 50/50 SHA-equal, max KL 0
    # the installed package is the wheel's, not this checkout's
    where = subprocess.run([str(py), "-c", "import graftmem; print(graftmem.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=120)
    assert str(venv) in where.stdout, where.stdout
