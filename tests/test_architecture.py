"""The layering rules of docs/architecture.md, checked on the source (no import is executed).

Every ``import``/``from ... import`` in the package is read with :mod:`ast`, those inside functions
and under ``if TYPE_CHECKING:`` included, because a type-only import is still a dependency a reader
has to follow. The rules:

* imports go downward only: core <- store <- memory <- share <- server <- api <- cli / facade;
* no cycle between modules, whatever the layers;
* ``llama_cpp`` is imported by ``graftmem.core.backend`` alone;
* the CLI, the examples and the benches use the public API only: ``graftmem`` and the layer packages'
  documented names, never a private module or an underscored name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "graftmem"
LAYERS = ["core", "store", "memory", "share", "server", "api"]
TOP = len(LAYERS)  # graftmem/__init__.py, __main__.py, cli/


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return TOP


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(absolute module imported, line) for every import in the file, at any depth."""
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or target in ("graftmem",) or target.endswith((".core", ".store", ".memory", ".share", ".server", ".api")):
                # "from . import x" / "from ..core import engine": the names may be submodules
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    out.append((sub if (ROOT / (sub.replace('.', '/') + '.py')).exists()
                                or (ROOT / sub.replace('.', '/')).is_dir() else target, node.lineno))
            else:
                out.append((target, node.lineno))
    return out


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def internal_graph() -> dict[str, set[str]]:
    mods = package_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for target, _ in imports_of(p):
            if target.startswith("graftmem"):
                # resolve to the deepest known module
                t = target
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    return graph


def test_imports_go_downward_only():
    bad = []
    for m, p in package_modules().items():
        for target, line in imports_of(p):
            if not target.startswith("graftmem"):
                continue
            if layer_of(target) > layer_of(m):
                bad.append(f"{p.relative_to(ROOT)}:{line} ({LAYERS[layer_of(m)] if layer_of(m) < TOP else 'top'}) "
                           f"imports {target} ({LAYERS[layer_of(target)] if layer_of(target) < TOP else 'top'})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = internal_graph()
    # a layer package's __init__ re-exports its modules; an edge from a module to its own package's
    # __init__ would be a cycle through the facade, which is exactly what we forbid
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_llama_cpp_is_imported_in_one_module():
    users = sorted({module_name(p) for p in PKG.rglob("*.py")
                    for target, _ in imports_of(p) if target.split(".")[0] == "llama_cpp"})
    assert users == ["graftmem.core.backend"]


#: the modules whose names are public: the facade, the CLI and each layer package's documented exports
PUBLIC_MODULES = {"graftmem", "graftmem.cli", *(f"graftmem.{layer}" for layer in LAYERS)}


def _private_uses(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("graftmem"):
            if node.module not in PUBLIC_MODULES:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} (a private module)")
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                    for a in node.names if a.name.startswith("_") and a.name != "__version__"]
        elif isinstance(node, ast.Import):
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}" for a in node.names
                    if a.name.startswith("graftmem") and a.name not in PUBLIC_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level and (path.parent == PKG or (path.parent.parent == PKG and node.level >= 2)):
            mod = node.module or ""
            if mod.startswith("_") or any(a.name.startswith("_") and a.name != "__version__" for a in node.names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} from .{mod}")
    return bad


@pytest.mark.parametrize("where", ["graftmem/cli", "bench", "examples"])
def test_cli_examples_and_benches_use_the_public_api(where: str):
    target = ROOT / where
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    assert files
    bad = [b for f in files for b in _private_uses(f)]
    assert not bad, "private names used:\n" + "\n".join(bad)


def test_the_cli_imports_only_the_facade():
    """graftmem/cli/ may import ``graftmem`` (or its layer packages' documented names) and its own
    modules, never another module."""
    mods = [t for f in sorted((PKG / "cli").glob("*.py")) for t, _ in imports_of(f)
            if t.startswith("graftmem") and not t.startswith("graftmem.cli.")]
    assert mods and all(m.count(".") <= 1 for m in mods), mods


def test_layer_checker_sees_upward_and_type_only_imports(tmp_path):
    """The checker itself: an upward import under TYPE_CHECKING and inside a function is found."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..api.memory import Memory\n"
           "def f():\n    from ..server import blocks\n")
    fake = PKG / "core" / "_arch_probe_tmp.py"
    fake.write_text(src)
    try:
        found = [t for t, _ in imports_of(fake)]
        assert "graftmem.api.memory" in found and "graftmem.server.blocks" in found
        assert all(layer_of(t) > layer_of("graftmem.core._arch_probe_tmp") for t in found if t.startswith("graftmem"))
    finally:
        fake.unlink()


def test_async_memory_offers_every_memory_verb_with_the_same_signature():
    import inspect

    from graftmem import AsyncMemory, Memory

    verbs = [n for n, f in inspect.getmembers(Memory, inspect.isfunction) if not n.startswith("_")]
    assert {"learn", "recall", "search", "ask", "learn_document", "recall_document", "export",
            "import_bundle", "pull", "push", "rederive", "verify"} <= set(verbs)
    for name in verbs:
        if name == "close":
            assert inspect.iscoroutinefunction(AsyncMemory.aclose)
            continue
        amethod = getattr(AsyncMemory, name, None)
        assert amethod is not None, f"AsyncMemory lacks {name}"
        # a stream starts at once and is read with ``async for``: not a coroutine, the same arguments
        assert inspect.iscoroutinefunction(amethod) == (not name.endswith("_stream")), name
        assert inspect.signature(amethod) == inspect.signature(getattr(Memory, name)), name
        assert amethod.__doc__ == getattr(Memory, name).__doc__, name


#: The functions that graft a block or answer from one. The doors (the server's routes, its prefix cache
#: and warm start, the facade ``Memory``) reach them only through `graftmem.memory.verbs.MemoryVerbs`,
#: which checks the arguments, asks consent before any graft and stamps the receipt's provenance: the
#: server's prefix cache once grafted a forged ``unverified`` block into every chat by calling them
#: directly (issue 24).
GRAFT_FUNCTIONS = {
    "graftmem.memory.answer": {"ask", "graft", "answer"},
    "graftmem.memory.recall": {"recall", "answer_graft_way", "answer_text_way"},
    "graftmem.memory.learn": {"learn", "prefill_and_store"},
    "graftmem.memory.pager": {"recall_document"},
    "graftmem.memory.pager.document": {"recall_document"},
    "graftmem.memory": {"ask", "graft", "answer_graft_way", "answer_text_way", "prefill_and_store",
                        "answer", "recall", "learn", "recall_document"},
    "graftmem.memory.exactness": {"verify_block", "graft_logits", "graft_in_new_process"},
    "graftmem.store.chain": {"load_state"},
    "graftmem.store": {"load_state"},
}
#: a door may not restore state into an engine itself either
ENGINE_GRAFT_CALLS = {"restore"}
DOORS = sorted([*(PKG / "server").rglob("*.py"), PKG / "api" / "memory.py"])  # server/ui/ too


def graft_reaches(path: Path) -> list[str]:
    """Where ``path`` imports a graft/answer function (or its module) or calls an engine's ``restore``."""
    mod = module_name(path)
    here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for a in node.names:
                if a.name in GRAFT_FUNCTIONS.get(base, ()) or f"{base}.{a.name}" in GRAFT_FUNCTIONS:
                    bad.append(f"{where} from {base} import {a.name}")
        elif isinstance(node, ast.Import):
            bad += [f"{where} import {a.name}" for a in node.names if a.name in GRAFT_FUNCTIONS
                    and a.name not in ("graftmem.memory", "graftmem.store")]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ENGINE_GRAFT_CALLS:
            bad.append(f"{where} .{node.func.attr}(...)")
    return bad


def test_doors_graft_and_answer_only_through_the_verbs():
    assert any(p.name == "prefix.py" for p in DOORS) and PKG / "api" / "memory.py" in DOORS
    bad = [b for p in DOORS for b in graft_reaches(p)]
    assert not bad, "a door reaches a graft/answer function without graftmem.memory.verbs:\n" + "\n".join(bad)


def test_graft_checker_sees_each_way_in(tmp_path):
    """The checker itself: a direct import of the graft, of its module, and an engine restore are found."""
    src = ("from ..memory.answer import graft\nfrom ..memory import answer\nimport graftmem.memory.recall\n"
           "from ..memory.recall import search\ndef f(e, v):\n    e.restore(v, 3)\n")
    fake = PKG / "server" / "_graft_probe_tmp.py"
    fake.write_text(src)
    try:
        found = graft_reaches(fake)
        assert len(found) == 4 and not any("search" in f for f in found), found
    finally:
        fake.unlink()
