"""Public API surface and error behaviour."""

from __future__ import annotations

import pytest

import graftmem
from graftmem import (BlockNotFound, ClosedError, ConfigError, EngineConfig, Memory, ModelNotFound,
                      resolve_model)
from graftmem.core.identity import block_id_for


def test_all_is_sorted_and_importable():
    assert graftmem.__all__ == sorted(graftmem.__all__)
    for name in graftmem.__all__:
        assert hasattr(graftmem, name), name


def test_learn_ask_get_delete_stats(mem):
    text = "Codes: the refund ticket code is RF followed by the order digits."
    b = mem.learn(text, name="codes", kind="manual", metadata={"team": "support"})
    assert b.name == "codes" and b.metadata == {"team": "support"} and b.text == text
    assert b.tokens == mem.engine.tokenize(text)  # the stored ids are the text's own
    assert mem.engine.detokenize(b.tokens) == text
    assert b.n_tokens == len(b.tokens) and b.pos_start == 0 and b.pos_end == b.n_tokens
    assert b.id == block_id_for(mem.fingerprint, b.tokens)
    r = mem.ask(b.id, "\nOrder 42 gets ticket code", max_tokens=6)
    assert r.block.id == b.id and r.receipt.decode_tokens == len(r.tokens) <= 6
    assert r.text == mem.engine.detokenize(r.tokens)
    s = mem.stats()
    assert s.blocks == 1 and s.tokens == b.n_tokens and s.bytes_on_disk > b.state_size
    assert s.bytes_on_disk <= 1.05 * b.state_size + 8192
    mem.delete(b.id)
    assert mem.get_all() == []
    with pytest.raises(BlockNotFound):
        mem.ask(b.id, "x")


def test_bad_inputs_raise_clear_errors(mem, smol):
    with pytest.raises(ConfigError):
        mem.learn("")
    with pytest.raises(ConfigError, match="unknown_key|Extra inputs"):
        Memory(config={"unknown_key": 1})
    with pytest.raises(ConfigError):
        Memory(engine=smol, model="smollm2")


def test_text_longer_than_context_is_refused(smol, tmp_path):
    with Memory("smollm2", home=tmp_path, config=EngineConfig(n_ctx=128, probe=False)) as m:
        with pytest.raises(ConfigError, match="n_ctx"):
            m.learn("word " * 400)


def test_missing_model_names_the_install_command(tmp_path):
    with pytest.raises(ModelNotFound, match="unknown model"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFound, match="did you mean 'smollm2'"):  # a typo of a known name
        resolve_model("smolm2")


def test_models_resolve_from_installed_packages():
    name, path = resolve_model("smollm2")
    assert name == "smollm2" and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    name, path = resolve_model("gemma3-270m")
    assert path.is_file() and path.stat().st_size > 200_000_000


def test_closed_memory_refuses(smol, tmp_path):
    m = Memory(engine=smol, home=tmp_path)
    m.close()
    with pytest.raises(ClosedError):
        m.learn("x")
    assert not smol._closed  # a shared engine is not closed by the Memory that borrowed it


def test_uninstalled_model_package_gives_the_pip_command(monkeypatch):
    from graftmem.core import models as _models

    spec = _models.ModelSpec(name="tiny", package="tiny-gguf-pkg", module="tiny_gguf_pkg_not_installed",
                             filename="tiny.gguf")
    monkeypatch.setitem(_models.MODELS, "tiny", spec)
    with pytest.raises(ModelNotFound, match="pip install tiny-gguf-pkg"):
        resolve_model("tiny")


def test_default_threads_follow_cpu_affinity():
    """n_threads=None uses the cores this process may run on (a pinned process: one), not the host's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from graftmem.core.engine import usable_cores; print(usable_cores(), os.cpu_count())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stderr
    pinned, host = map(int, proc.stdout.split())
    assert pinned == 1 and host >= 1
