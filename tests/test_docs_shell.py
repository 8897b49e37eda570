"""Every runnable shell block of every page, run as written (tests/doc_shell.py says how). Its own file
so that pytest-xdist runs it beside tests/test_docs.py (each page starts processes: ~1-2 min in all)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from . import doc_shell
from .snippet_runner import SnippetRunner
from .test_docs import SHELL_PAGES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def runner():
    """This worker's warm interpreter (tests/snippet_runner.py), as tests/test_docs.py has its own."""
    r = SnippetRunner()
    yield r
    r.close()


@pytest.mark.slow
@pytest.mark.parametrize("page", SHELL_PAGES)
def test_shell_blocks_run_as_written(page, tmp_path, runner):
    """The page's shell blocks, in order, in one bash in a scratch home (tests/doc_shell.py says how):
    no command fails where the page does not say so, and every output the page shows is printed."""
    import shutil

    blocks = [b for b in doc_shell.shell_blocks(page) if b.runs_here]
    if any("curl " in b.code for b in blocks) and shutil.which("curl") is None:
        if os.environ.get("CI"):  # a tool the page uses: skipped on a dev machine without it, never under CI
            pytest.fail("curl is missing (scripts/dev.sh's DEBIAN_NEEDS)")
        pytest.skip("curl is missing")
    run = doc_shell.run_page(page, blocks, tmp_path, runner)
    printed = "\n".join(f"--- {b.where}\n{run.stdout.get(i, '')}" for i, b in enumerate(blocks))
    assert not run.failures, f"{run.failures}\n{printed}\n--- stderr\n{run.stderr[-4000:]}"
    text = (ROOT / page).read_text()
    for i, b in enumerate(blocks):
        shown = doc_shell.shown_after(text, b.end)
        if shown is not None:
            want = doc_shell.missing_lines(shown, run.stdout.get(i, ""))
            assert want is None, f"{b.where}: the shown line {want!r} is not printed (in order):\n{printed}"
