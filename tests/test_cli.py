"""The CLI mirrors the API: real engine, one-line errors with non-zero exits. The entry point runs as a real
subprocess where the process is the point (errors, doctor, the README's demo); the commands' own behaviour
runs through graftmem.cli.main in this process, as ``python -m graftmem`` calls it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest



def run(home, *args, input=None):
    env = {**os.environ, "GRAFTMEM_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "graftmem", *args], capture_output=True, text=True,
                          env=env, input=input, timeout=600)


def _in_process(capsys):
    """``graftmem ARGS`` as ``python -m graftmem`` runs it (graftmem.cli.main), in this process: (exit code,
    stdout, stderr). For the tests of what the commands do; the entry point itself, a new process, is what
    test_errors_are_one_line_with_nonzero_exit, the doctor and the demo run."""
    from graftmem.cli import main

    def call(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return call


def test_learn_ls_show_ask_verify_delete(tmp_path, capsys, monkeypatch):
    home = tmp_path / "h"
    monkeypatch.setenv("GRAFTMEM_HOME", str(home))  # the home from the environment, as a shell gives it
    run = _in_process(capsys)
    manual = tmp_path / "refunds.txt"
    manual.write_text("Refunds: ask for the order number, then check the date, then approve.")
    code, out, err = run("--json", "learn", str(manual))
    assert code == 0, err
    bid = json.loads(out)["id"]
    code, out, err = run("ls")
    assert code == 0 and bid[:12] in out and "refunds" in out
    code, out, err = run("show", bid[:8])
    assert code == 0 and bid in out
    code, out, err = run("--json", "ask", bid[:8], "\nFirst, ask for the", "--max-tokens", "3")
    assert code == 0, err
    assert json.loads(out)["receipt"]["block_id"] == bid
    code, out, err = run("verify", bid[:8], "--samples", "3")  # its new-process check still starts a child
    assert code == 0, out + err
    assert "SHA-equal 3/3" in out and "OK" in out
    code, out, err = run("ls")
    assert "yes" in out  # the verification record shows in the listing
    code, out, err = run("delete", bid[:8])
    assert code == 0
    assert "(no blocks)" in run("ls")[1]
    assert list(home.glob("blocks/*/*.gmb")) == []  # the home of GRAFTMEM_HOME is the one written and emptied


def test_errors_are_one_line_with_nonzero_exit(tmp_path):
    r = run(tmp_path / "h", "show", "abcd1234")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: no block") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "; fix: list the store (`graftmem ls`)" in r.stderr
    r = run(tmp_path / "h", "--model", "no-such-model", "ask", "abcd", "q")
    assert r.returncode == 2 and "unknown model" in r.stderr and "Traceback" not in r.stderr


def test_verify_exits_nonzero_on_corruption(tmp_path, capsys, monkeypatch):
    home = tmp_path / "h"
    monkeypatch.setenv("GRAFTMEM_HOME", str(home))
    run = _in_process(capsys)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Corrupt me later: a manual with a few words.")))
    code, out, err = run("--json", "learn", "-")
    assert code == 0, err
    bid = json.loads(out)["id"]
    path = next(home.glob(f"blocks/*/{bid}.gmb"))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, err = run("verify", bid, "--samples", "2")
    assert code == 2 and "state digest mismatch" in err
    # the plain line says what to do, as --json's "fix" does (one line still)
    assert "; fix: delete the block (`graftmem delete ID`)" in err and len(err.strip().splitlines()) == 1, err
    # doctor looks at headers by default (the damage is in the state bytes) and finds it with --check-bytes
    code, out, err = run("doctor")
    assert code == 0 and "\nhealth       ok (headers, manifests, trailers; --check-bytes" in out, out
    code, out, err = run("doctor", "--check-bytes")
    assert code == 1 and f"health       1 unreadable: {bid[:12]}: " in out and "state digest mismatch" in out, out


def test_doctor_reports_fingerprint_and_exactness(tmp_path):
    r = run(tmp_path / "h", "--json", "doctor")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["exactness"]["exact"] is True
    assert rep["fingerprint"]["model_name"] == "smollm2" and len(rep["fingerprint_digest"]) == 64
    # what llama.cpp sees and which weight buffers the engine uses (a user on an odd CPU reads this)
    assert "CPU :" in rep["system"]["system_info"] and rep["system"]["devices"], rep["system"]
    assert rep["weights"] == {"extra_bufts": "off", "extra_bufts_used": False, "weight_buffers": "CPU"}
    human = run(tmp_path / "h", "doctor")
    assert human.returncode == 0, human.stderr
    first = human.stdout.splitlines()[:3]  # printed before the model loads
    assert first[0].startswith("llama.cpp    llama-cpp-python") and first[2].startswith("cpu          CPU :"), first
    assert "weights      CPU buffers (extra_bufts=off" in human.stdout, human.stdout


def test_demo_learns_recalls_and_verifies(tmp_path):
    """The README's first command ends in this demo: route to the right manual, graft it, the text
    way gives the identical answer, and verify passes (exit 0)."""
    proc = run(tmp_path / "home", "--home", str(tmp_path / "demo"), "demo", "--samples", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("system: llama.cpp ") and "CPU :" in out.splitlines()[0], out
    assert "weights in CPU buffers (extra_bufts=off)" in out, out
    assert "route:  -> refund-manual" in out, out
    assert "answer: 'REFUND APPROVED. Ticket code: RF-20417.'" in out, out  # what the manual says
    assert "answer and logits identical: yes" in out, out
    assert "verify: SHA-256 equal 4/4" in out and "OK: the graft is byte-exact" in out, out


def test_global_flags_after_the_subcommand_defaults_in_help_and_human_stats(tmp_path, capsys):
    from graftmem.cli import main

    home = str(tmp_path / "h")
    manual = tmp_path / "refunds.txt"
    manual.write_text("Refunds: ask for the order number, then check the date, then approve.")
    cfg = '{"probe": false}'
    assert main(["learn", str(manual), "--home", home, "--config", cfg, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["already_stored"] is False
    assert main(["--home", home, "--config", cfg, "learn", str(manual)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("already stored " + first["id"][:12]) and "nothing prefilled" in out
    assert main(["ls", "--json", "--home", home]) == 0  # --json after the subcommand (was: an error)
    assert json.loads(capsys.readouterr().out)[0]["id"] == first["id"]
    assert main(["stats", "--home", home]) == 0
    stats = capsys.readouterr().out
    assert "KiB" in stats and "per token" in stats and "blocks   1 (manual 1)" in stats
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    assert "(default: 64)" in capsys.readouterr().out


@pytest.mark.parametrize("config, why", [('{"n_ctxx": 4096}', "unknown field 'n_ctxx'"),
                                         ("[1, 2]", "must be a JSON object"), ("{oops", "is not JSON")])
def test_config_mistakes_are_one_clear_line(tmp_path, capsys, config, why):
    from graftmem.cli import main

    assert main(["--home", str(tmp_path / "h"), "--config", config, "search", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and why in err and "pydantic" not in err and "http" not in err


def _chat_manual(tmp_path, capsys, text: str) -> tuple[str, str, str]:
    """Learn ``text`` as a chat block through the CLI; (home, config, block id) for the next commands."""
    from graftmem.cli import main

    home = str(tmp_path / "h")
    cfg = '{"probe": false}'
    manual = tmp_path / "refunds.txt"
    manual.write_text(text)
    assert main(["--home", home, "--config", cfg, "--json", "learn", str(manual), "--chat"]) == 0
    return home, cfg, json.loads(capsys.readouterr().out)["id"]


def test_ask_a_chat_block_answers_as_the_next_turn_and_empty_answers_fail(tmp_path, capsys):
    from graftmem.cli import main

    home, cfg, bid = _chat_manual(tmp_path, capsys, "Refunds: ask for the order number (NW-12345) first.")
    assert main(["--home", home, "--config", cfg, "--json", "ask", bid, "What do you ask first?",
                 "--max-tokens", "8"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["receipt"]["decode_tokens"] > 0 and r["text"].strip()
    # as given (--raw), the question follows the end of the turn and SmolLM2 ends at once: the CLI
    # used to print an empty answer and exit 0; now it says so and exits 1
    code = main(["--home", home, "--config", cfg, "--json", "ask", bid, "What do you ask first?", "--raw",
                 "--max-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 1 and json.loads(captured.out)["tokens"] == [] and "0 tokens" in captured.err


def test_ask_streams_and_stops_like_the_api(tmp_path, capsys):
    """``--stream`` prints the same answer as a plain ask, as it is decoded; ``--stop`` cuts it where
    the plain answer has that string."""
    from graftmem.cli import main

    home, cfg, bid = _chat_manual(
        tmp_path, capsys, "Refunds: ask for the order number (NW-12345) first, then check the 30-day window.")
    q = ["ask", bid, "A customer wants a refund. What do you do?", "--max-tokens", "24"]
    assert main(["--home", home, "--config", cfg, "--json", *q]) == 0
    full = json.loads(capsys.readouterr().out)["text"]
    assert main(["--home", home, "--config", cfg, *q, "--stream"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(full + "\n\n-- block "), (out, full)
    word = " " + full.split()[3]
    assert main(["--home", home, "--config", cfg, "--json", *q, "--stop", word, "--stop", "zzz-never"]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["text"] == full[:full.find(word)] and cut["finish_reason"] == "stop"


def test_version_and_did_you_mean(capsys):
    """``--version`` prints the package's version; a mistyped command or option names the nearest one, in
    one line and exit 2 (argparse printed its usage and a bare 'invalid choice')."""
    from graftmem import __version__
    from graftmem.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"graftmem {__version__}"
    assert main(["lern", "notes.txt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "did you mean 'learn'?" in err and len(err.strip().splitlines()) == 1
    assert main(["ls", "--knd", "x"]) == 2
    assert "did you mean '--kind'?" in capsys.readouterr().err
    # a right option on the wrong command is named as such (it suggested the very option it refused)
    assert main(["ls", "--api-key", "k"]) == 2
    err = capsys.readouterr().err
    assert "--api-key is an option of serve, pull only" in err and "$GRAFTMEM_API_KEY" in err and "did you mean" not in err, err
    assert main(["zzzzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err  # nothing near: the list of commands instead


def test_json_errors_are_one_object_with_stable_keys(tmp_path, capsys):
    """Under ``--json`` every error, wherever it comes from (the command line, the store, bad input), is
    one JSON object on stdout with the same keys, and the exit code is the plain one's."""
    from graftmem.cli import main

    home = str(tmp_path / "h")
    cases = [(["--json", "lern"], "UsageError", "did you mean 'learn'"),
             (["--home", home, "show", "abcd1234", "--json"], "BlockNotFound", "no block"),
             (["--home", home, "--json", "--config", "{oops", "search", "x"], "ConfigError", "is not JSON"),
             (["--home", home, "--json", "learn", str(tmp_path / "missing.txt")], "ConfigError",
              "no file"),
             (["--home", home, "--json", "--config", '{"n_ctxx": 512}', "ls"], "ConfigError", "unknown field 'n_ctxx'")]
    for argv, kind, words in cases:
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert err == "", (argv, err)
        err_obj = json.loads(out)  # one object, nothing else on stdout
        assert set(err_obj) == {"error"} and set(err_obj["error"]) == {"type", "message", "fix", "exit_code"}
        assert err_obj["error"]["type"] == kind and words in err_obj["error"]["message"], (argv, err_obj)
        assert err_obj["error"]["exit_code"] == 2
    assert json.loads(main(["--json", "lern"]) and capsys.readouterr().out)["error"]["fix"].startswith("run `graftmem --help`")


def test_scope_flags_list_and_forget_by_scope(tmp_path, capsys):
    """--user-id on learn records the scope; ls / show / search by scope see only its blocks; delete by scope
    deletes what only that scope learned and leaves a block another scope also learned to it. ls shows the
    settings a block grafts under."""
    from graftmem.cli import main

    home, cfg = str(tmp_path / "h"), '{"probe": false}'

    def cli(*args: str) -> tuple[int, str, str]:
        code = main(["--home", home, "--config", cfg, *args])
        out, err = capsys.readouterr()
        return code, out, err

    for name, text in (("tea", "Alice likes green tea in the morning."), ("both", "The office opens at nine.")):
        (tmp_path / f"{name}.txt").write_text(text)
    ids = {}
    for user, name in (("alice", "tea"), ("alice", "both"), ("bob", "both")):
        code, out, err = cli("--json", "learn", str(tmp_path / f"{name}.txt"), "--user-id", user)
        assert code == 0, err
        ids[name] = json.loads(out)["id"]
    code, out, _ = cli("--json", "ls", "--user-id", "alice")
    assert sorted(b["id"] for b in json.loads(out)) == sorted(ids.values())
    code, out, _ = cli("ls", "--user-id", "bob")
    assert ids["both"][:12] in out and ids["tea"][:12] not in out and "n_ctx=" in out and "settings" in out
    assert cli("show", ids["tea"], "--user-id", "bob")[0] == 2  # not bob's: not found, as through the server
    assert cli("ls", "--user-id", "carol")[1].strip() == "(no blocks in this scope)"
    code, out, err = cli("--json", "delete", "--user-id", "alice")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["deleted_all"] == [ids["tea"]] and rep["kept"] == [ids["both"]]
    assert json.loads(cli("--json", "ls", "--user-id", "alice")[1]) == []
    assert [b["id"] for b in json.loads(cli("--json", "ls", "--user-id", "bob")[1])] == [ids["both"]]
    assert [b["id"] for b in json.loads(cli("--json", "ls")[1])] == [ids["both"]]
    code, out, err = cli("delete")
    assert code == 2 and "give a block id, or a scope" in err


def test_learn_quiet_prints_only_the_id(tmp_path, capsys, monkeypatch):
    """``ID=$(graftmem learn f.txt -q)``: the pages' shell blocks keep the new block's id this way (the ids
    differ from machine to machine: a block id hashes the engine fingerprint), learned or already stored."""
    monkeypatch.setenv("GRAFTMEM_HOME", str(tmp_path / "h"))
    run = _in_process(capsys)
    manual = tmp_path / "refunds.txt"
    manual.write_text("Refunds: ask for the order number first.")
    for _ in range(2):  # the second time it is already stored: the same one line
        code, out, err = run("learn", str(manual), "-q")
        assert code == 0, err
        (bid,) = out.splitlines()
        assert run("show", bid)[1].startswith(f"id           {bid}\n")


def test_ls_does_not_call_an_unverified_import_verified(tmp_path, capsys, monkeypatch):
    """A verify record travels inside the block; after an import without re-derivation nothing here
    vouches for the state, so ``ls`` shows "-" beside "unverified" (it showed "yes")."""
    run = _in_process(capsys)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Refunds: ask for the order number first.")))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    code, out, err = run("--home", a, "--json", "learn", "-")
    assert code == 0, err
    bid = json.loads(out)["id"]
    assert run("--home", a, "verify", bid, "--samples", "2")[0] == 0
    assert run("--home", a, "export", str(tmp_path / "x.gmbundle"), bid)[0] == 0
    assert run("--home", b, "import", str(tmp_path / "x.gmbundle"), "--no-rederive")[0] == 0
    code, out, _ = run("--home", b, "ls")
    row = next(line for line in out.splitlines() if line.startswith(bid[:12])).split()
    assert row[8] == "unverified" and row[7] == "-", row   # settings take two words: n_ctx=... kv=...
    code, out, _ = run("--home", a, "ls")
    row = next(line for line in out.splitlines() if line.startswith(bid[:12])).split()
    assert row[7] == "yes" and row[8] == "local", row      # at the source: verified here
