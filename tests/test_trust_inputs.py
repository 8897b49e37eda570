"""Validation at the boundary: every bad argument is a graftmem error raised before any work (nothing
prefilled, nothing written), and every bad CLI input is one ``error: ...`` line and exit 2."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from graftmem import ConfigError, GraftmemError, Memory
from graftmem.cli import main

from .conftest import long_text
from .test_bundle import QUERY

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def block_mem(smol, tmp_path_factory):
    with Memory(engine=smol, home=tmp_path_factory.mktemp("inputs")) as m:
        b = m.learn(long_text(20, seed=31), name="b")
        yield m, b


LEARN_BAD = [
    ({"text": "half a pair \ud800 of surrogates"}, "lone surrogate"),
    ({"text": b"bytes, not text"}, "must be a str"),
    ({"text": ""}, "must not be empty"),
    ({"text": "ok", "metadata": {"x": object()}}, "JSON-serialisable"),
    ({"text": "ok", "metadata": {"x": float("nan")}}, "JSON-serialisable"),
    ({"text": "ok", "metadata": {1: "int key"}}, "keys must be str"),
    ({"text": "ok", "metadata": "not a mapping"}, "must be a mapping"),
    ({"text": "ok", "name": 5}, "name must be a str"),
    ({"text": "ok", "parent": 1234}, "parent must be a str"),
    ({"text": "ok", "chat": "yes"}, "True or False"),
    ({"text": "ok", "when_to_use": "\udcff"}, "lone surrogate"),
]


@pytest.mark.parametrize("kw,match", LEARN_BAD, ids=[m for _, m in LEARN_BAD])
def test_learn_rejects_bad_arguments_before_any_prefill(block_mem, kw, match):
    m, _ = block_mem
    before = [b.id for b in m.get_all()]
    text = kw.pop("text")
    with pytest.raises(ConfigError, match=match):
        m.learn(text, **kw)
    assert [b.id for b in m.get_all()] == before


ASK_BAD = [
    ({"max_tokens": "5"}, "max_tokens must be an int"),
    ({"max_tokens": 0}, "out of range"),
    ({"max_tokens": -3}, "out of range"),
    ({"max_tokens": True}, "must be an int"),
    ({"query": "\ud800"}, "lone surrogate"),
    ({"query": b"q"}, "must be a str"),
    ({"query": ""}, "must not be empty"),
    ({"block_id": 123}, "must be a str"),
    ({"block_id": b"abcd"}, "must be a str"),
    ({"sampling": {"temperature": 1}}, "must be a Sampling"),
    ({"allow_unverified": 1}, "True or False"),
]


@pytest.mark.parametrize("kw,match", ASK_BAD, ids=[m + str(i) for i, (_, m) in enumerate(ASK_BAD)])
def test_ask_rejects_bad_arguments(block_mem, kw, match):
    m, b = block_mem
    args = {"block_id": b.id, "query": QUERY, **kw}
    with pytest.raises(ConfigError, match=match):
        m.ask(args.pop("block_id"), args.pop("query"), **args)


@pytest.mark.parametrize("call,match", [
    (lambda m, b: m.verify(b.id, samples=0), "samples=0 is out of range"),
    (lambda m, b: m.verify(b.id, samples="3"), "must be an int"),
    (lambda m, b: m.get(42), "must be a str"),
    (lambda m, b: m.delete(b.id, cascade="no"), "True or False"),
    (lambda m, b: m.recall("task", max_tokens=0), "out of range"),
    (lambda m, b: m.recall("task", min_score=2.0), "routing score"),
    (lambda m, b: m.recall("task", mode="fast"), "mode="),
    (lambda m, b: m.search("task", top_k=0), "out of range"),
    (lambda m, b: m.import_bundle("x.gmbundle", incompatible="maybe"), "incompatible="),
    (lambda m, b: m.import_bundle("x.gmbundle", rederive="yes"), "True or False"),
    (lambda m, b: m.pull("http://127.0.0.1:1", policy={"require_signature": True}), "TrustPolicy"),
    (lambda m, b: m.push("http://127.0.0.1:1", token=""), "must not be empty"),
    (lambda m, b: m.serve(port=99999), "port=99999 is out of range"),
    (lambda m, b: m.export(Path("x") / "y", block_ids="abcd"), "list of block ids"),
])
def test_other_verbs_reject_bad_arguments(block_mem, call, match):
    m, b = block_mem
    with pytest.raises(ConfigError, match=match):
        call(m, b)
    assert not m.router_loaded  # rejected before the router (torch, MiniLM) was even loaded


@pytest.mark.parametrize("config,match", [
    ({"n_ctx": 2**32 + 128}, "beyond what llama.cpp can address"),
    ([1, 2], "must be an EngineConfig or a mapping"),
    ({"n_ctxx": 512}, "invalid engine config"),
])
def test_engine_config_is_checked_before_loading(tmp_path, config, match):
    with pytest.raises(ConfigError, match=match):
        Memory("smollm2", home=tmp_path / "h", config=config)


def _cli(argv, capsys, stdin: bytes | None = None, monkeypatch=None) -> tuple[int, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    err = capsys.readouterr().err
    return rc, err


def test_cli_bad_inputs_are_one_error_line_and_exit_2(tmp_path, capsys, monkeypatch, block_mem):
    home = str(tmp_path / "h")
    cfg = '{"probe": false}'
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    cases = [
        (["--home", home, "--config", cfg, "learn", str(tmp_path / "latin1.txt")], None, "not UTF-8"),
        (["--home", home, "--config", cfg, "learn", str(tmp_path / "binary.bin")], None, "not UTF-8"),
        (["--home", home, "--config", cfg, "learn", "-"], b"\xff\xfe oops", "stdin is not UTF-8"),
        (["--home", home, "--config", "[1,2]", "learn", "-"], b"text", "must be a JSON object"),
        (["--home", home, "--config", "{not json", "learn", "-"], b"text", "--config is not JSON"),
        (["--home", home, "serve", "--port", "99999"], None, "not a TCP port"),
        (["--home", home, "--config", cfg, "verify", "abcd", "--samples", "0"], None, "give 1 or more"),
        (["--home", home, "--config", cfg, "ask", "abcd", "q", "--max-tokens", "0"], None, "give 1 or more"),
        (["--home", home, "--config", cfg, "learn", str(tmp_path / "missing.txt")], None, "no file"),
    ]
    for argv, stdin, match in cases:
        rc, err = _cli(argv, capsys, stdin, monkeypatch)
        assert rc == 2, (argv, rc, err)
        assert "Traceback" not in err and "error:" in err and match in err, (argv, err)
    assert not (tmp_path / "h" / "blocks").exists() or not list((tmp_path / "h" / "blocks").rglob("*.gmb"))


def test_cli_stdin_with_a_raw_ff_byte_in_a_real_process(tmp_path):
    """The real stdin of a real process (its own decoding), not a patched one."""
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAFTMEM_HOME": str(tmp_path / "h")}
    proc = subprocess.run([sys.executable, "-m", "graftmem", "--config", '{"probe": false}', "learn", "-"],
                          input=b"abc \xff def", capture_output=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert b"Traceback" not in proc.stderr and b"error:" in proc.stderr


def test_errors_are_graftmem_errors(block_mem):
    m, b = block_mem
    for call in (lambda: m.ask(b.id, QUERY, max_tokens="5"), lambda: m.learn("\ud800"),
                 lambda: m.verify(b.id, samples=0)):
        with pytest.raises(GraftmemError):
            call()
