"""Safe CPU kernels by default: llama.cpp's extra weight buffer types (CPU repack, AMX) are off unless
asked, the choice is part of the fingerprint, a block made with them is refused by an engine without
them, and a kernel that crashes is reported as an EngineError naming the setting, not as a bare
"Segmentation fault" (a real SIGSEGV, injected into the real probe child).
"""

from __future__ import annotations

import json

import pytest

from graftmem import ConfigError, Engine, EngineConfig, EngineError, IncompatibleBlock, Memory
from graftmem.core.engine import _weight_buffers

from .conftest import long_text


def test_default_config_and_engine_load_plain_weight_buffers(smol, gemma, monkeypatch):
    monkeypatch.delenv("GRAFTMEM_EXTRA_BUFTS", raising=False)
    assert EngineConfig().extra_bufts == "off"
    for eng in (smol, gemma):
        assert eng.config.extra_bufts == "off" and eng.extra_bufts is False
        # Gemma's Q4_K weights are what llama.cpp repacks (AVX2, ARM dot-product) when allowed to
        assert eng.fingerprint.weight_buffers == "CPU", eng.fingerprint.weight_buffers
        assert eng.fingerprint.n_gpu_layers == 0 and eng.fingerprint.backend == "cpu"


def test_extra_bufts_from_env_and_typos_refused(monkeypatch):
    monkeypatch.setenv("GRAFTMEM_EXTRA_BUFTS", "auto")
    assert EngineConfig().extra_bufts == "auto"
    assert EngineConfig(extra_bufts="off").extra_bufts == "off"  # an explicit config wins
    monkeypatch.setenv("GRAFTMEM_EXTRA_BUFTS", "yes")
    with pytest.raises(ConfigError, match="GRAFTMEM_EXTRA_BUFTS"):
        EngineConfig()
    monkeypatch.delenv("GRAFTMEM_EXTRA_BUFTS")
    with pytest.raises(ConfigError, match="extra_bufts"):
        EngineConfig.coerce({"extra_bufts": "maybe"})


def test_weight_buffers_read_from_the_load_log():
    log = ["load_tensors:   CPU_Mapped model buffer size =    95.34 MiB\n",
           "load_tensors:          AMX model buffer size =    80.00 MiB\n",
           "llama_context:        CPU  output buffer size =     0.19 MiB\n"]
    assert _weight_buffers(log) == "AMX+CPU"
    assert _weight_buffers(["load_tensors:   CPU_REPACK model buffer size =  1 MiB\n",
                            "load_tensors:   CPU_Mapped model buffer size =  2 MiB\n"]) == "CPU+CPU_REPACK"
    assert _weight_buffers([]) == "CPU"


def test_fingerprint_identity_keeps_legacy_ids_and_names_the_buffers(smol):
    fp = smol.fingerprint
    legacy = fp.model_copy(update={"weight_buffers": None})  # a manifest written before the field
    assert legacy.digest() == fp.digest() and not legacy.diff(fp)
    repacked = fp.model_copy(update={"weight_buffers": "CPU+CPU_REPACK"})
    assert repacked.digest() != fp.digest()
    assert repacked.diff(fp) == {"weight_buffers": ("CPU+CPU_REPACK", "CPU")}
    offloaded = fp.model_copy(update={"n_gpu_layers": 99, "backend": "cuda0"})
    assert set(offloaded.diff(fp)) == {"n_gpu_layers", "backend"}


@pytest.fixture(scope="module")
def gemma_repacked():
    """Gemma 3 (Q4_K weights: llama.cpp repacks them on AVX2 and on ARM with dot-product) with the extra
    buffer types on."""
    try:
        eng = Engine("gemma3-270m", EngineConfig(extra_bufts="on", n_ctx=2048))
    except EngineError as exc:
        # a CPU whose extra buffers crash (llama.cpp's AMX weight buffers on a Xeon with AMX): asked for
        # explicitly, the engine refuses with the setting to change; auto falls back (the tests below)
        assert "extra_bufts='off'" in str(exc) and "GRAFTMEM_EXTRA_BUFTS=off" in str(exc), exc
        pytest.skip(f"llama.cpp's extra weight buffers do not run on this CPU: {str(exc)[:200]}")
    with eng:
        if eng.weight_buffers == "CPU":
            pytest.skip("llama.cpp has no repack kernel for these weights on this CPU: nothing to tell apart")
        yield eng


def test_a_block_made_with_repacked_weights_is_refused_without_them(gemma_repacked, tmp_path):
    assert gemma_repacked.extra_bufts is True and gemma_repacked.fingerprint.weight_buffers != "CPU"
    home = tmp_path / "h"
    with Memory(engine=gemma_repacked, home=home) as m:
        blk = m.learn(long_text(80), name="repacked")
    with Engine("gemma3-270m", EngineConfig(n_ctx=2048)) as plain, Memory(engine=plain, home=home) as m:
        assert plain.fingerprint.weight_buffers == "CPU"
        assert plain.fingerprint.digest() != gemma_repacked.fingerprint.digest()
        with pytest.raises(IncompatibleBlock, match="weight_buffers") as exc:
            m.ask(blk.id, " and then", max_tokens=1)
        assert "weight_buffers" in exc.value.fields


def test_repacked_weights_graft_exactly_on_their_own(gemma_repacked):
    # the probe ran in the engine (graft == fresh at a length past the sliding window)
    assert gemma_repacked.exactness.exact, gemma_repacked.exactness.reason
    assert gemma_repacked.exactness.probe_tokens > gemma_repacked.n_swa


@pytest.fixture()
def fresh_verdicts(tmp_path, monkeypatch):
    """An empty verdict cache, so the probe child runs; returns the folder the verdicts land in."""
    monkeypatch.setenv("GRAFTMEM_MODEL_CACHE", str(tmp_path / "mcache"))
    return tmp_path / "mcache" / "kernel-probes"


def test_a_crashing_kernel_is_an_engine_error_naming_the_setting(fresh_verdicts, monkeypatch):
    monkeypatch.setenv("GRAFTMEM_TEST_CRASH_PROBE_CHILD", "1")
    with pytest.raises(EngineError) as exc:
        Engine("smollm2", EngineConfig(extra_bufts="on", n_ctx=512))
    msg = str(exc.value)
    assert "SIGSEGV" in msg and "extra_bufts='off'" in msg and "GRAFTMEM_EXTRA_BUFTS=off" in msg, msg
    verdicts = [json.loads(p.read_text()) for p in fresh_verdicts.glob("*.json")]
    assert len(verdicts) == 1 and verdicts[0]["ran"] is False and verdicts[0]["extra_bufts"] is True
    # the verdict is cached per build + CPU + kernels: without the fault, the same choice is still refused
    monkeypatch.delenv("GRAFTMEM_TEST_CRASH_PROBE_CHILD")
    with pytest.raises(EngineError, match="SIGSEGV"):
        Engine("smollm2", EngineConfig(extra_bufts="on", n_ctx=512))
    # ... and the safe default is probed on its own and loads
    with Engine("smollm2", EngineConfig(n_ctx=512)) as eng:
        assert eng.extra_bufts is False and eng.exactness.exact
    assert len(list(fresh_verdicts.glob("*.json"))) == 2


def test_auto_falls_back_to_plain_buffers_where_the_extra_ones_crash(fresh_verdicts, monkeypatch):
    monkeypatch.setenv("GRAFTMEM_TEST_CRASH_PROBE_CHILD", "on")  # only children with extra buffers crash
    with Engine("smollm2", EngineConfig(extra_bufts="auto", n_ctx=512)) as eng:
        assert eng.extra_bufts is False and eng.fingerprint.weight_buffers == "CPU" and eng.exactness.exact
    ran = sorted(json.loads(p.read_text())["ran"] for p in fresh_verdicts.glob("*.json"))
    assert ran == [False, True]  # the extra buffers crashed in their child, the plain ones ran in theirs


def test_auto_uses_extra_buffers_where_they_run_and_stay_exact_else_plain_ones(fresh_verdicts):
    """No fault injected: what this CPU really does. Where the extra buffers run (AVX2, AVX-512 without
    AMX, ARM), auto uses them if the child found them exact; where they crash (AMX), it falls back to
    the plain buffers, probed in a child of their own, and loads exact."""
    with Engine("gemma3-270m", EngineConfig(extra_bufts="auto", n_ctx=2048)) as eng:
        verdicts = [json.loads(p.read_text()) for p in fresh_verdicts.glob("*.json")]
        extra = next(v for v in verdicts if v["extra_bufts"])
        if extra["ran"]:
            assert len(verdicts) == 1
            assert eng.extra_bufts is (extra["exact"] is True)
            assert eng.fingerprint.weight_buffers == extra["weight_buffers"]
        else:  # the child with the extra buffers died (SIGSEGV on AMX): the plain ones were probed and used
            assert "llama.cpp died with" in extra["reason"], extra
            assert [v["ran"] for v in verdicts if not v["extra_bufts"]] == [True]
            assert eng.extra_bufts is False and eng.fingerprint.weight_buffers == "CPU" and eng.exactness.exact


def test_the_load_time_probe_runs_once_per_fingerprint_and_machine(fresh_verdicts):
    """The exactness probe's verdict is kept in the model cache under the fingerprint: a second load of
    the same configuration reads it (here: a planted verdict is what the engine reports), another
    configuration is probed on its own."""
    probes = fresh_verdicts.parent / "exactness-probes"
    with Engine("smollm2", EngineConfig(n_ctx=512)) as eng:
        assert eng.exactness.exact and eng.exactness.probe_tokens > 0
    [path] = probes.glob("*.json")
    assert json.loads(path.read_text())["reason"] == eng.exactness.reason
    path.write_text(json.dumps({"exact": False, "reason": "planted verdict", "probe_tokens": 1}))
    with Engine("smollm2", EngineConfig(n_ctx=512)) as again:
        assert (again.exactness.exact, again.exactness.reason) == (False, "planted verdict")
    with Engine("smollm2", EngineConfig(n_ctx=768)) as other:
        assert other.exactness.exact and other.exactness.reason != "planted verdict"
    assert len(list(probes.glob("*.json"))) == 2


def test_a_crash_while_loading_is_not_reported_as_a_crashing_kernel(fresh_verdicts, monkeypatch):
    """The probe child says how far it got: a crash before the first decode (as a CUDA build whose
    libggml-cuda.so exported a static libstdc++ did on an H200 host, in llama_model::print_info) names
    loading, not the kernels, and does not tell the user to turn the extra buffers off."""
    monkeypatch.setenv("GRAFTMEM_TEST_CRASH_PROBE_CHILD", "load")
    with pytest.raises(EngineError) as exc:
        Engine("smollm2", EngineConfig(n_ctx=512))
    msg = str(exc.value)
    assert "SIGSEGV while loading the model (before any decode)" in msg, msg
    assert "first decode" not in msg and "extra_bufts='off'" not in msg and "doctor" in msg, msg


def test_a_rebuilt_library_is_probed_again(monkeypatch):
    """The cached verdicts are keyed by the library files (name, size, content digest): a rebuild that
    fixes a crash is probed again instead of being refused from the cache (what happened on the H200
    host), while a reinstall of the same files keeps them."""
    from graftmem.core import backend as B
    from graftmem.core import kernels as K

    libs = B.library_identity()
    assert any(name.startswith("libllama") for name, _, _ in libs) and all(size > 0 for _, size, _ in libs), libs
    cfg = EngineConfig(n_ctx=512)
    before = K._kernel_key("0" * 64, cfg, False)
    monkeypatch.setattr(B, "_LIBS", None)  # computed again from the files: the same key
    assert K._kernel_key("0" * 64, cfg, False) == before
    monkeypatch.setattr(B, "_LIBS", [(n, s, "0" * 32 if n.startswith("libggml-cpu") else d) for n, s, d in libs])
    assert K._kernel_key("0" * 64, cfg, False) != before  # one library rebuilt: other bytes
