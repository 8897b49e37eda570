"""Answers parsed as llama.cpp parses them: held-out model outputs through graftmem's answer code and
through llama.cpp's own chat parser, compared (issue #40's must-show: >= 65 of 70 agree in every mode).

The reference is llama.cpp itself, not a reading of it: ``bench/chat_parse_harness.cpp`` drives
``common_chat_templates_init`` / ``common_chat_templates_apply`` / ``common_chat_parse`` of the llama.cpp
vendored in the pinned llama-cpp-python sdist (the sources graftmem's engine runs), built once into a
cache directory outside the repository (`build_harness`, like `bench.peer` builds llama-server: ``nice
-n 10``, ``-j2``, only the ``llama-common`` library and the harness, no libcurl, no OpenSSL).

The cases (``bench/data/chat_parity_heldout.json``) are answers written by hand as each family's model
writes them (reasoning, parallel calls, nested JSON, escaped quotes, a string holding the end marker, a
call after text, unclosed and empty think blocks), deliberately not llama.cpp's ``tests/test-chat.cpp``
cases, which the parser work ports: these check that work on outputs it never saw.

Each case is answered by graftmem in two modes: **whole** (the non-streamed answer) and **streamed** (the
answer fed in seeded random 1–3 character pieces), both through `graftmem_answer`, the one adapter
between this bench and graftmem's code: it does what the server does (``graftmem/server/openai.py``:
``_final`` for a whole answer, ``_sse`` for a stream), so repointing it at a new parser is one edit.
A mode agrees when content and reasoning (outer whitespace aside) and the tool calls (names, and
arguments as JSON values) equal llama.cpp's.

Each case also carries llama.cpp's answer, recorded by ``--record``: ``--recorded`` compares with those
(no build), and a live run reports any case where llama.cpp now answers otherwise. The harness's cold
build took 20 minutes on a shared 2-core machine (ggml, libllama, llama-common); later runs take seconds.

    python -m bench.chat_parity [--cases bench/data/chat_parity_heldout.json] [--seed 0] [--only ID,...]
                                [--recorded | --record] [--out bench/results/chat_parity.json]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import platformdirs

from graftmem.core import ChatTemplate
from graftmem.server import AnswerParser, answer_spec, request_tools, split_answer

from .harness import ROOT, write_results
from .peer import VERSION, PeerUnavailable, _run

CASES = ROOT / "bench" / "data" / "chat_parity_heldout.json"
HARNESS_SRC = ROOT / "bench" / "chat_parse_harness.cpp"
#: the user turn every case answers (its text does not matter to the parse; its presence renders the prompt)
USER = "What is the weather in Paris?"


# ------------------------------------------------------------------------------------------------ adapter
def graftmem_answer(template_source: str, text: str, tools: Optional[Sequence[Mapping[str, Any]]], streamed: bool,
                    chunks: Sequence[int] = (), *, control: Sequence[str] = (),
                    kwargs: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """graftmem's chat answer to a model output: ``{"content", "reasoning_content", "tool_calls": [{"name",
    "arguments"}]}``, as the server builds it for a model served with its own template ``template_source``,
    a request with ``tools`` (OpenAI's shape; None: none) and the default ``reasoning_format``: the tools
    in the model's call format (`request_tools`, what ``ChatPipeline.tool_spec`` calls), how the answer
    splits (`answer_spec`, what ``ChatPipeline.answer_spec`` calls with the prompt's last text), then the
    whole answer through `split_answer` (``OpenAIRoutes._final``) or the stream through one `AnswerParser`
    fed piece by piece (``OpenAIRoutes._sse``).

    ``text``: the output with every marker written out, as llama.cpp's parser reads it and as the server's
    answer text holds it (the engine writes the family's control-token markers, ``Job.specials``, out as
    text). ``control``: the markers that are control tokens in the model's vocabulary (kept for the record:
    the server no longer reads them apart). ``streamed``: fed in pieces of ``chunks`` characters (cycled;
    1-character pieces if they run out); else parsed whole. ``kwargs``: the request's
    ``chat_template_kwargs``.

    This is the one place that calls graftmem: point it at a new parser when the server uses one."""
    tpl = ChatTemplate(source=template_source)
    spec = request_tools({"tools": list(tools)} if tools else {}, tpl)
    prompt = tpl.render([{"role": "user", "content": USER}], add_generation_prompt=True,
                        tools=[dict(t) for t in tools] if tools and tpl.uses_tools else None, **dict(kwargs or {}))
    how = answer_spec(tpl, spec, reasoning=True, prompt_tail=prompt)
    if not streamed:
        answer = split_answer(text, how)
        return {"content": answer.content, "reasoning_content": answer.reasoning,
                "tool_calls": [_call(c) for c in answer.calls]}
    parser = AnswerParser(how)
    events = [e for piece in _pieces(text, chunks) for e in parser.feed(piece)] + parser.finish()
    return {"content": "".join(e.text for e in events if e.kind == "content") or None,
            "reasoning_content": "".join(e.text for e in events if e.kind == "reasoning") or None,
            "tool_calls": [_call(e.call) for e in events if e.kind == "call" and e.call is not None]}


def _call(entry: Mapping[str, Any]) -> dict[str, Any]:
    fn = entry.get("function") or {}
    return {"name": fn.get("name"), "arguments": fn.get("arguments")}


def _pieces(text: str, chunks: Sequence[int]) -> list[str]:
    out, i, k = [], 0, 0
    while i < len(text):
        n = max(1, int(chunks[k % len(chunks)])) if chunks else 1
        out.append(text[i:i + n])
        i, k = i + n, k + 1
    return out


# ------------------------------------------------------------------------------------------------ reference
def harness_root(version: str = VERSION) -> Path:
    return Path(platformdirs.user_cache_dir("graftmem")) / f"chat-parse-{version}"


_CMAKELISTS = """cmake_minimum_required(VERSION 3.14)
project(graftmem_chat_parse_harness CXX C)
set(LLAMA_BUILD_COMMON ON CACHE BOOL "" FORCE)
add_subdirectory(${LLAMA_SRC} llama.cpp)
add_executable(chat-parse-harness harness.cpp)
target_link_libraries(chat-parse-harness PRIVATE llama-common)
target_compile_features(chat-parse-harness PRIVATE cxx_std_17)
"""


def _tiny_models() -> ModuleType:
    """scripts/tiny_models.py (scripts/ is not a package): where the pinned sdist and its templates are."""
    name = "graftmem_tiny_models"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "tiny_models.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def harness_key() -> str:
    """The harness binary's name key: its source and its CMake project (a changed harness rebuilds)."""
    return hashlib.sha256(HARNESS_SRC.read_bytes() + _CMAKELISTS.encode()).hexdigest()[:12]


def harness_path(version: str = VERSION) -> Path:
    return harness_root(version) / "bin" / f"chat-parse-harness-{harness_key()}"


def build_harness(version: str = VERSION, jobs: int = 2) -> Path:
    """The harness binary, built once from the sdist's vendored llama.cpp (the cold build compiles ggml,
    libllama and llama-common: tens of minutes on a busy 2-core machine; later builds relink the harness)."""
    exe = harness_path(version)
    if exe.exists():
        return exe
    root = harness_root(version)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:  # one build per cache directory at a time (bench.peer's reason)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        log = root / "build.log"
        t0 = time.time()
        src = root / "src"
        if not src.exists():
            tm = _tiny_models()
            tm.sdist_dir()  # downloads the pinned sdist if absent
            tarball = tm.cache_root() / "sdist" / tm.SDIST_FILE
            prefix = tm.SDIST_FILE.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
            with tempfile.TemporaryDirectory(dir=root) as tmp, tarfile.open(tarball) as tf:
                members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
                tf.extractall(tmp, members=members, filter="data")
                shutil.move(str(Path(tmp) / prefix), src)
        project = root / "project"
        project.mkdir(exist_ok=True)
        (project / "CMakeLists.txt").write_text(_CMAKELISTS)
        shutil.copy2(HARNESS_SRC, project / "harness.cpp")
        bdir = root / "build"
        nice = ["nice", "-n", "10"]
        if not (bdir / "CMakeCache.txt").exists():
            _run(nice + ["cmake", "-S", str(project), "-B", str(bdir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                         f"-DLLAMA_SRC={src}", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
                         "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"], log)
        _run(nice + ["cmake", "--build", str(bdir), "--target", "chat-parse-harness", "-j", str(jobs)], log)
        exe.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(bdir / "chat-parse-harness", exe)
        (root / "build.json").write_text(json.dumps({"version": version, "build_s": round(time.time() - t0, 1),
                                                     "jobs": jobs, "exe": str(exe)}, indent=2))
        return exe


class Reference:
    """The harness as a process: one JSON request per line in, llama.cpp's parsed message per line out."""

    def __init__(self, exe: Path) -> None:
        self.proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, encoding="utf-8")

    def parse(self, request: Mapping[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request, ensure_ascii=False) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise PeerUnavailable(f"the chat parse harness exited ({self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Reference":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ comparison
def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def normalized(msg: Mapping[str, Any]) -> dict[str, Any]:
    """What must agree: content and reasoning without outer whitespace (None and "" alike), calls as
    (name, arguments as a JSON value) in order; call ids are each side's own."""
    return {"content": (msg.get("content") or "").strip(),
            "reasoning_content": (msg.get("reasoning_content") or "").strip(),
            "tool_calls": [{"name": c.get("name"), "arguments": _args(c.get("arguments"))}
                           for c in msg.get("tool_calls") or []]}


def diff(expected: Mapping[str, Any], got: Mapping[str, Any]) -> dict[str, Any]:
    return {k: {"llama.cpp": expected[k], "graftmem": got[k]} for k in expected if expected[k] != got[k]}


def load_cases(path: Path = CASES) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def template_source(name: str) -> str:
    return (_tiny_models().templates_dir() / f"{name}.jinja").read_text(encoding="utf-8")


def case_inputs(data: Mapping[str, Any], case: Mapping[str, Any]) -> tuple[str, Any, dict[str, Any], dict[str, Any]]:
    """A case's template source, tools, ``chat_template_kwargs`` and its request to the harness."""
    fam = data["families"][case["family"]]
    src = template_source(fam["template"])
    tools = data["tools"][case["tools"]] if case.get("tools") else None
    kwargs = dict(case.get("kwargs") or {})
    req: dict[str, Any] = {"template": src, "text": case["text"], "bos_token": fam.get("bos_token", ""),
                           "eos_token": fam.get("eos_token", ""),
                           "messages": [{"role": "user", "content": USER}], "chat_template_kwargs": kwargs}
    if tools:
        req["tools"] = tools
    if "enable_thinking" in kwargs:
        req["enable_thinking"] = bool(kwargs["enable_thinking"])
    return src, tools, kwargs, req


def run_cases(data: Mapping[str, Any], ref: Optional[Reference], *, seed: int = 0,
              only: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Every case (or those named by ``only``) through llama.cpp and through `graftmem_answer` in both modes.

    ``ref``: the running harness; None compares with the answers recorded in the cases file (``llama_cpp``,
    written by ``--record``), so the bench also runs where the harness is not built. With a harness, a
    live answer that differs from the recorded one is reported (``recorded_differs``)."""
    rows = []
    for case in data["cases"]:
        if only and case["id"] not in only:
            continue
        fam = data["families"][case["family"]]
        src, tools, kwargs, req = case_inputs(data, case)
        row: dict[str, Any] = {"id": case["id"], "family": case["family"], "note": case.get("note", ""), "modes": {}}
        if ref is not None:
            ref_msg = ref.parse(req)
            row["format"] = ref_msg.get("format")
            if ref_msg.get("error"):
                row["reference_error"] = ref_msg["error"]
                row["agree"] = False
                rows.append(row)
                continue
            expected = normalized(ref_msg)
            if "llama_cpp" in case and case["llama_cpp"] != expected:
                row["recorded_differs"] = diff(case["llama_cpp"], expected)
        else:
            expected = case["llama_cpp"]
        row["llama.cpp"] = expected
        rng = random.Random(f"{seed}:{case['id']}")
        chunks = [rng.randint(1, 3) for _ in range(len(case["text"]) + 1)]
        for mode, streamed in (("whole", False), ("streamed", True)):
            try:
                got = normalized(graftmem_answer(src, case["text"], tools, streamed, chunks,
                                                 control=fam.get("control", ()), kwargs=kwargs))
                d = diff(expected, got)
            except Exception as exc:  # noqa: BLE001 - a crash is a disagreement, reported as such
                d = {"error": f"{type(exc).__name__}: {exc}"}
            row["modes"][mode] = {"agree": not d, **({"diff": d} if d else {})}
        row["agree"] = all(m["agree"] for m in row["modes"].values())
        rows.append(row)
    return rows


def record(data: dict[str, Any], ref: Reference, path: Path) -> int:
    """Store llama.cpp's answer to every case in the cases file (``llama_cpp``); the count recorded."""
    n = 0
    for case in data["cases"]:
        msg = ref.parse(case_inputs(data, case)[3])
        if msg.get("error"):
            raise PeerUnavailable(f"llama.cpp does not parse case {case['id']}: {msg['error']}")
        case["llama_cpp"] = normalized(msg)
        case["llama_cpp_format"] = msg.get("format")
        n += 1
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return n


def tally(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    fams: dict[str, Counter] = {}
    for r in rows:
        c = fams.setdefault(r["family"], Counter())
        c["cases"] += 1
        c["agree"] += bool(r["agree"])
    modes = Counter()
    for r in rows:
        for m, v in r.get("modes", {}).items():
            modes[m] += bool(v["agree"])
    return {"agree_every_mode": sum(bool(r["agree"]) for r in rows), "cases": len(rows),
            "agree_by_mode": dict(modes), "reference_errors": sum(1 for r in rows if "reference_error" in r),
            "by_family": {f: dict(c) for f, c in fams.items()}}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=str(CASES))
    ap.add_argument("--seed", type=int, default=0, help="seeds the 1-3 character pieces of the streamed mode")
    ap.add_argument("--only", default="", help="comma-separated case ids")
    ap.add_argument("--jobs", type=int, default=2, help="build parallelism of the harness (built once)")
    ap.add_argument("--recorded", action="store_true",
                    help="compare with the llama.cpp answers recorded in the cases file (no harness build)")
    ap.add_argument("--record", action="store_true", help="store llama.cpp's answers in the cases file, then run")
    ap.add_argument("--out", default="bench/results/chat_parity.json")
    args = ap.parse_args(argv)
    path = Path(args.cases)
    data = load_cases(path)
    only = [s for s in args.only.split(",") if s] or None
    exe = None if args.recorded else build_harness(jobs=args.jobs)
    if exe is None:
        rows = run_cases(data, None, seed=args.seed, only=only)
    else:
        with Reference(exe) as ref:
            if args.record:
                print(f"recorded llama.cpp's answers to {record(data, ref, path)} cases in {path}")
            rows = run_cases(data, ref, seed=args.seed, only=only)
    t = tally(rows)
    for r in rows:
        modes = " ".join(f"{m}={'agree' if v['agree'] else 'DIFFER'}" for m, v in r["modes"].items())
        print(f"{r['id']:<20} {modes or 'reference error: ' + r.get('reference_error', '')}")
        for m, v in r["modes"].items():
            if not v["agree"]:
                print(f"    {m}: {json.dumps(v['diff'], ensure_ascii=False)}")
        if "recorded_differs" in r:
            print(f"    llama.cpp now differs from the recorded answer: {json.dumps(r['recorded_differs'], ensure_ascii=False)}")
    print(f"\n{t['agree_every_mode']} of {t['cases']} agree with llama.cpp in every mode "
          f"(whole {t['agree_by_mode'].get('whole', 0)}, streamed {t['agree_by_mode'].get('streamed', 0)})")
    for fam, c in t["by_family"].items():
        print(f"  {fam:<16} {c['agree']}/{c['cases']}")
    try:
        cases_file = str(path.resolve().relative_to(ROOT))
    except ValueError:
        cases_file = str(path)
    write_results(args.out, {"cases_file": cases_file, "seed": args.seed,
                             "reference": "recorded" if exe is None else {"harness": exe.name, "llama_cpp_python": VERSION},
                             "summary": t, "rows": rows}, args=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
