"""The CLI mirrors the API: real subprocesses, real engine, one-line errors with non-zero exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys



def run(home, *args, input=None):
    env = {**os.environ, "GRAFTMEM_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "graftmem", *args], capture_output=True, text=True,
                          env=env, input=input, timeout=600)


def test_learn_ls_show_ask_verify_delete(tmp_path):
    home = tmp_path / "h"
    manual = tmp_path / "refunds.txt"
    manual.write_text("Refunds: ask for the order number, then check the date, then approve.")
    r = run(home, "--json", "learn", str(manual))
    assert r.returncode == 0, r.stderr
    bid = json.loads(r.stdout)["id"]
    r = run(home, "ls")
    assert r.returncode == 0 and bid[:12] in r.stdout and "refunds" in r.stdout
    r = run(home, "show", bid[:8])
    assert r.returncode == 0 and bid in r.stdout
    r = run(home, "--json", "ask", bid[:8], "\nFirst, ask for the", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["receipt"]["block_id"] == bid
    r = run(home, "verify", bid[:8], "--samples", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SHA-equal 3/3" in r.stdout and "OK" in r.stdout
    r = run(home, "ls")
    assert "yes" in r.stdout  # the verification record shows in the listing
    r = run(home, "delete", bid[:8])
    assert r.returncode == 0
    assert "(no blocks)" in run(home, "ls").stdout


def test_errors_are_one_line_with_nonzero_exit(tmp_path):
    r = run(tmp_path / "h", "show", "abcd1234")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: no block") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run(tmp_path / "h", "--model", "no-such-model", "ask", "abcd", "q")
    assert r.returncode == 2 and "unknown model" in r.stderr and "Traceback" not in r.stderr


def test_verify_exits_nonzero_on_corruption(tmp_path):
    home = tmp_path / "h"
    r = run(home, "--json", "learn", "-", input="Corrupt me later: a manual with a few words.")
    bid = json.loads(r.stdout)["id"]
    path = next(home.glob(f"blocks/*/{bid}.gmb"))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    r = run(home, "verify", bid, "--samples", "2")
    assert r.returncode == 2 and "state digest mismatch" in r.stderr


def test_doctor_reports_fingerprint_and_exactness(tmp_path):
    r = run(tmp_path / "h", "--json", "doctor")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["exactness"]["exact"] is True
    assert rep["fingerprint"]["model_name"] == "smollm2" and len(rep["fingerprint_digest"]) == 64


def test_demo_learns_recalls_and_verifies(tmp_path):
    """The README's first command ends in this demo: route to the right manual, graft it, the text
    way gives the identical answer, and verify passes (exit 0)."""
    proc = run(tmp_path / "home", "--home", str(tmp_path / "demo"), "demo", "--samples", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "route:  -> refund-manual" in out, out
    assert "answer and logits identical: yes" in out, out
    assert "verify: SHA-256 equal 4/4" in out and "OK: the graft is byte-exact" in out, out
