"""docs/models.md's compatibility table is what scripts/models_table.py computes now: a change to the
template layer or the tool-call parsers that changes a row must regenerate the docs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_models_table_is_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "models_table.py")], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = (ROOT / "docs" / "models.md").read_text()
    assert proc.stdout.strip() in doc, "docs/models.md is stale: run python scripts/models_table.py --write"
    # the claims the issue asks the table to show, for the families that matter most
    rows = {line.split(" | ")[0].lstrip("| "): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert len(rows) == 70 + 2  # the 70 templates, the header and its rule
    for name, fam in [("meta-llama-Llama-3.1-8B-Instruct", "llama3"), ("Qwen-Qwen2.5-7B-Instruct", "hermes"),
                      ("Qwen3-Coder", "qwen-xml"), ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
                      ("openai-gpt-oss-120b", "harmony"), ("google-gemma-4-31B-it", "gemma4")]:
        assert f"{fam}: parsed" in rows[name], rows[name]
    assert "pinned per day" in rows["openai-gpt-oss-120b"]
