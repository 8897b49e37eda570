"""Every shell block of every page, run as a user pastes it, for tests/test_docs.py.

A page's ```bash / ```sh / ```shell / ```console blocks are either run or carry, on the line right above
the fence, a visible, reasoned marker the test reads:

* ``<!-- not run: REASON -->``: it cannot run here (installs from an index, needs a GPU or a model
  hub, runs for hours, is the test suite itself, ...); the reason is shown to whoever reads the source;
* ``<!-- run by tests/test_x.py: how -->``: another test runs it as written (the fleet page's block
  needs a real SeaweedFS); that file must exist and name the page.

Every other block is run: the page's blocks in order, in ONE bash (a later block uses the files and the
variables of an earlier one, as in a terminal), in a scratch directory with its own ``GRAFTMEM_HOME``,
``HOME`` and caches, loopback only. Rules of the run, all visible here:

* ``graftmem`` on the PATH is a shim: each command runs ``graftmem.cli.main`` in the tests' warm snippet
  runner (tests/snippet_runner.py: a fresh ``__main__``, the command's argv, cwd and environment; only
  the loaded weights are shared), because a cold process per command would cost each one seconds of
  imports. ``graftmem serve`` and ``graftmem mcp`` (they run until stopped) exec the real CLI.
* A ``graftmem serve`` line is the terminal a user leaves running: it is started in the background and
  the run waits (bounded) for its ``/health`` before the next line; the page's port 8765 becomes a free
  one. Every process the run started is killed at its end (its own process group).
* A command may fail only where its line says so (a comment with ``exit N``, N its status); any other
  failure fails the test with the command's output.
* Where a page shows a block's output (a ```text block after it, in a paragraph that starts with
  "Output"), the block's stdout must print those lines in order; ``…`` stands for a part the page says
  varies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")
_RUN_BY = re.compile(r"<!-- run by (tests/[\w/]+\.py)(?:: (.+?))? -->\s*$")
#: what a command line in an unlabelled fence starts with: such a block must say it is shell
_COMMANDS = re.compile(r"^(\$ |graftmem |pip |python |bash |curl |export |cd |mkdir )")


@dataclass
class Block:
    page: str
    line: int          # 1-based line of the opening fence
    lang: str
    code: str
    start: int         # offsets of the whole fence in the page's text
    end: int
    not_run: Optional[str] = None   # the reason, when marked "not run"
    run_by: Optional[str] = None    # the test file, when marked "run by"

    @property
    def runs_here(self) -> bool:
        return self.not_run is None and self.run_by is None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def fences(page: str, text: Optional[str] = None) -> list[Block]:
    """Every fenced block of a page (any language), with the marker on the line above it."""
    text = (ROOT / page).read_text() if text is None else text
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        b = Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2), m.start(), m.end())
        if (nr := _NOT_RUN.search(before)) is not None:
            b.not_run = nr.group(1).strip()
        elif (rb := _RUN_BY.search(before)) is not None:
            b.run_by = rb.group(1)
        out.append(b)
    return out


def shell_blocks(page: str, text: Optional[str] = None) -> list[Block]:
    return [b for b in fences(page, text) if b.lang in SHELL_LANGS]


def problems(page: str, text: Optional[str] = None) -> list[str]:
    """What is wrong with a page's blocks as the docs test sees them: a marker with no reason, a "run by"
    that names a missing test or one that does not name the page, a shell block whose fence does not say
    it is shell (so it would be neither run nor marked)."""
    out = []
    for b in fences(page, text):
        if b.lang == "" and any(_COMMANDS.match(line) for line in b.code.splitlines()):
            out.append(f"{b.where}: a block of commands in a fence with no language: label it ```bash")
        if b.not_run is not None and len(b.not_run.split()) < 3:
            out.append(f"{b.where}: 'not run' needs a reason a reader understands, not {b.not_run!r}")
        if b.run_by is not None:
            test = ROOT / b.run_by
            if not test.is_file():
                out.append(f"{b.where}: 'run by {b.run_by}': no such test")
            elif page not in test.read_text():
                out.append(f"{b.where}: {b.run_by} does not name {page}: it cannot be the test that runs it")
    return out


def shown_after(page_text: str, end: int) -> Optional[str]:
    """The output a page shows for the block that ends at ``end``: the ```text (or bare ```) block that
    follows it when the prose between them starts a paragraph with "Output", else None."""
    after = page_text[end:]
    nxt = re.search(r"^```(text)?\n(.*?)^```", after, flags=re.S | re.M)
    if nxt is None or "```" in after[:nxt.start()]:
        return None
    if not re.search(r"\n\s*\nOutput", "\n\n" + after[:nxt.start()].strip()):
        return None
    return nxt.group(2)


def missing_lines(shown: str, printed: str) -> Optional[str]:
    """None when every shown line is a printed line, in order ("…" matches any run of characters);
    else the first shown line that is not printed."""
    lines = [line.rstrip() for line in printed.splitlines()]  # a table's padding is not what a page shows
    at = 0
    for want in (line.rstrip() for line in shown.splitlines()):
        pattern = re.compile(".*?".join(re.escape(part) for part in want.split("…")) + "$")
        while at < len(lines) and not pattern.match(lines[at]):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


# ------------------------------------------------------------------------------ the graftmem shim
_SHIM = '''#!{python}
"""graftmem, as the docs test runs it: the command in the warm snippet runner (tests/doc_shell.py)."""
import json, os, socket, sys
argv = sys.argv[1:]
if {{"serve", "mcp"}} & set(argv):  # runs until stopped: a real process of its own
    os.execv(sys.executable, [sys.executable, "-m", "graftmem", *argv])
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["GRAFTMEM_DOCS_BRIDGE"])
s.sendall(json.dumps({{"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}}).encode() + b"\\n")
ans = json.loads(s.makefile("rb").readline())
sys.stdout.write(ans["stdout"])
sys.stderr.write(ans["stderr"])
sys.exit(ans["rc"])
'''


class CliBridge:
    """The socket the shim talks to: one command at a time, each run by ``runner`` (a SnippetRunner) as
    a script that calls ``graftmem.cli.main`` with the command's argv."""

    def __init__(self, runner: Any, workdir: Path) -> None:
        self.runner, self.dir = runner, workdir
        self.bin = workdir / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        shim = self.bin / "graftmem"
        shim.write_text(_SHIM.format(python=sys.executable))
        shim.chmod(0o755)
        # a short path of its own: a unix socket's path is limited to 107 bytes, a pytest tmp_path is long
        self._sockdir = tempfile.mkdtemp(prefix="gm-docs-")
        self.path = os.path.join(self._sockdir, "cli.sock")
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.commands: list[list[str]] = []
        self.timings: list[tuple[list[str], float, int]] = []  # argv, seconds, status: where a slow run went
        self._n = 0
        self._thread = threading.Thread(target=self._serve, name="docs-cli-bridge", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    req = json.loads(conn.makefile("rb").readline())
                    ans = self._run(req)
                except Exception as exc:  # noqa: BLE001 - the command fails with why, the test sees it
                    ans = {"rc": 99, "stdout": "", "stderr": f"docs bridge: {exc!r}\n"}
                try:
                    conn.sendall(json.dumps(ans).encode() + b"\n")
                except OSError:
                    pass

    def _run(self, req: dict[str, Any]) -> dict[str, Any]:
        self._n += 1
        self.commands.append(req["argv"])
        script = self.dir / f"cli-{self._n}.py"
        script.write_text("import sys\nfrom graftmem.cli.main import main\n"
                          f"sys.argv = ['graftmem', *{req['argv']!r}]\nraise SystemExit(main(sys.argv[1:]))\n")
        t0 = time.monotonic()
        proc = self.runner.run(script, cwd=Path(req["cwd"]), env=req["env"], timeout=600)
        self.timings.append((req["argv"], round(time.monotonic() - t0, 2), proc.returncode))
        return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept() (close alone does not, on Linux)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(timeout=10)
        shutil.rmtree(self._sockdir, ignore_errors=True)


# ------------------------------------------------------------------------------------- one page's run
@dataclass
class PageRun:
    blocks: list[Block]
    rc: int
    stdout: dict[int, str] = field(default_factory=dict)   # per block index (in ``blocks``)
    stderr: str = ""
    failures: list[str] = field(default_factory=list)       # commands that failed where the page did not say so
    script: str = ""
    commands: list[tuple[list[str], float, int]] = field(default_factory=list)  # the shim's: argv, s, status


def _split_comment(line: str) -> tuple[str, str]:
    """``cmd  # comment`` -> (cmd, "# comment"), a ``#`` inside quotes left alone."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i:]
    return line.rstrip(), ""


_SERVE = re.compile(r"^(\w+=\S*\s+)*graftmem\b.*\sserve\b")


def script_for(blocks: list[Block], port: int) -> tuple[str, dict[int, tuple[int, str]]]:
    """The one bash script of a page's blocks, and for each of its lines the block and the page line it
    came from (so a failure is reported where the page has it)."""
    out = ["set -E -o pipefail", "trap 'echo \"__docs_fail $? $LINENO\" >&2' ERR",
           "docs_wait_health() { for _ in $(seq 1 1200); do "
           "curl -sf -o /dev/null \"http://127.0.0.1:$1/health\" && return 0; sleep 0.1; done; "
           "echo \"__docs_fail server on $1 not up\" >&2; return 1; }"]
    where: dict[int, tuple[int, str]] = {}
    serves = 0
    for i, b in enumerate(blocks):
        out.append(f"echo __docs_block {i}")
        for raw in b.code.replace("8765", str(port)).splitlines():
            line = raw
            cmd, comment = _split_comment(raw)
            if _SERVE.match(cmd) and not cmd.endswith("&"):  # the terminal left running: backgrounded
                serves += 1
                p = re.search(r"--port\s+(\d+)", cmd)
                line = (f"{cmd} > serve-{serves}.log 2>&1 &  {comment}\n"
                        f"docs_wait_health {p.group(1) if p else 8765} || cat serve-{serves}.log >&2")
            for part in line.split("\n"):  # one element per script line: bash's $LINENO is its index + 1
                out.append(part)
                where[len(out)] = (i, raw)
    return "\n".join(out) + "\necho __docs_block end\n", where


def _allowed(page_line: str, status: int) -> bool:
    return re.search(rf"#.*\bexit {status}\b", page_line) is not None


def run_page(page: str, blocks: list[Block], tmp: Path, runner: Any, *, timeout: float = 600) -> PageRun:
    """Run ``blocks`` (a page's runnable shell blocks, in order) in one bash in a scratch directory."""
    from graftmem.core.models import model_cache_dir
    from tests.seaweed import free_port

    work, home = tmp / "work", tmp / "home"
    for d in (work, home, tmp / "userhome", tmp / "cache"):
        d.mkdir(parents=True, exist_ok=True)
    bridge = CliBridge(runner, tmp / "bridge")
    script, where = script_for(blocks, free_port())
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("GRAFTMEM_", "AWS_", "PYTEST_")) and k not in ("HOME", "XDG_CACHE_HOME")}
    env = {**keep, "PATH": f"{bridge.bin}:{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "PYTHONPATH": str(ROOT), "GRAFTMEM_HOME": str(home), "HOME": str(tmp / "userhome"),
           "XDG_CACHE_HOME": str(tmp / "cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GRAFTMEM_DOCS_BRIDGE": bridge.path, "NO_COLOR": "1",
           # derived model files (Gemma's assembled GGUF, file hashes, probe verdicts), what a user has after
           # the first run: not the store, and rebuilding them per page would cost each page seconds
           "GRAFTMEM_MODEL_CACHE": str(model_cache_dir())}
    bash = shutil.which("bash") or "/bin/bash"
    proc = subprocess.Popen([bash, "-c", script], cwd=work, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n__docs_fail the page's blocks did not finish within {timeout:.0f} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # servers a block left running in the background
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
        bridge.close()
    run = PageRun(blocks, proc.returncode, stderr=err, script=script, commands=bridge.timings)
    current = None
    for line in out.splitlines():
        marker = re.search(r"__docs_block (\w+)$", line)
        if marker is not None:  # after output with no final newline (curl's JSON) the marker ends its line
            if marker.start() and current is not None:
                run.stdout[current] = run.stdout.get(current, "") + line[:marker.start()] + "\n"
            tag = marker.group(1)
            current = None if tag == "end" else int(tag)
            run.stdout.setdefault(current if current is not None else -1, "")
        elif current is not None:
            run.stdout[current] = run.stdout.get(current, "") + line + "\n"
    failed: set[tuple[int, int]] = set()
    for line in err.splitlines():
        m = re.match(r"__docs_fail (\d+) (\d+)$", line)
        if m:
            status, lineno = int(m.group(1)), int(m.group(2))
            failed.add((lineno, status))
            i, page_line = where.get(lineno, (-1, "?"))
            if not _allowed(page_line, status):
                run.failures.append(f"{blocks[i].where if i >= 0 else page} exit {status}: {page_line.strip()}")
        elif line.startswith("__docs_fail"):
            run.failures.append(line)
    finished = re.search(r"__docs_block end$", out, re.M) is not None
    # a line that says what it does here ("# exit 1 here") must do it: the page promised a refusal
    for lineno, (i, page_line) in where.items():
        promised = re.search(r"#.*\bexit (\d+) here\b", page_line)
        if promised and finished and (lineno, int(promised.group(1))) not in failed:
            run.failures.append(f"{blocks[i].where} promised exit {promised.group(1)}, did not: {page_line.strip()}")
    if not finished:
        run.failures.append(f"the run stopped before the end (bash exit {proc.returncode})")
    return run
