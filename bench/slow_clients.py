"""Slow clients against the connection cap: how many normal requests a server answers while sockets trickle
request bodies and refuse to read their answers (issue 37).

The attack, on loopback only, against ``graftmem serve`` with its default limits in a process with 256 file
descriptors (the red team's; the default cap is then 64 connections):

- ``--slow-body`` sockets each send a chat request's headers with ``Content-Length: 100000``, then one byte
  of the body per second;
- ``--slow-read`` sockets each ask for a stored block's bytes (about 5 MB) with a 4 KB receive window and
  never read.

A persistent attacker: a socket the server closes is opened again at the next tick (once a second), so
the attack keeps its count for the whole ``--attack-s``. Meanwhile a normal client asks ``GET /v1/models``
once a second on a fresh connection (5 s timeout) and counts its answers. The attackers connect from
``--attacker`` (127.0.0.1 by default: the same address as the normal client, so a per-address limit does
not separate them; 127.0.0.2 is another address). ``--baseline DIR`` runs the same against the server from
another checkout (e.g. the commit before the change) in the same run.

    python -m bench.slow_clients [--attack-s 40] [--baseline /work/main] [--attacker 127.0.0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from bench.peer import free_port, stop

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

#: the text of the block the slow readers download: about 5 MB of SmolLM2 state
TEXT = " ".join(f"Rule {i}: refunds over {i * 7} dollars need the order number and a manager." for i in range(12))


def _fds() -> None:  # in the server's process: the red team's descriptor limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def start_server(root: Path, work: Path, tag: str) -> tuple[subprocess.Popen, str, Any]:
    port = free_port()
    log = open(work / f"server-{tag}.log", "wb")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root), "GRAFTMEM_HOME": str(work / f"home-{tag}")}
    proc = subprocess.Popen([sys.executable, "-m", "graftmem", "serve", "--port", str(port), "--no-warm"],
                            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_fds)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server from {root} exited: {(work / f'server-{tag}.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(proc, 10)
            raise SystemExit(f"the server from {root} did not start in 300 s")
        time.sleep(0.5)


def _alive(s: socket.socket) -> bool:
    """Whether the server still holds this connection (TCP state ESTABLISHED)."""
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == 1
    except OSError:
        return False


class Attack:
    """The attack's sockets and the thread that trickles their bytes and reopens the closed ones."""

    def __init__(self, url: str, block_id: str, slow_body: int, slow_read: int, source: str) -> None:
        host, port = url[len("http://"):].split(":")
        self.addr, self.block_id, self.source = (host, int(port)), block_id, source
        self.kinds = ["body"] * slow_body + ["read"] * slow_read
        self.socks: list[Optional[socket.socket]] = [None] * len(self.kinds)
        self.opened = 0  #: connections the attack opened in all (reopens included)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, kind: str) -> Optional[socket.socket]:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if kind == "read":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(2)
            s.bind((self.source, 0))
            s.connect(self.addr)
            if kind == "body":
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100000\r\n\r\n{")
            else:
                s.sendall(f"GET /v1/blocks/{self.block_id} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            s.setblocking(False)
            self.opened += 1
            return s
        except OSError:
            s.close()
            return None

    def _run(self) -> None:
        while not self.stop.is_set():
            for i, kind in enumerate(self.kinds):
                s = self.socks[i]
                if s is not None and _alive(s) and kind == "body":
                    try:
                        s.send(b" ")  # one byte a second, far under its Content-Length
                    except OSError:
                        pass
                if s is None or not _alive(s):
                    if s is not None:
                        s.close()
                    self.socks[i] = self._open(kind)
            self.stop.wait(1.0)

    def held(self) -> int:
        return sum(1 for s in self.socks if s is not None and _alive(s))

    def __enter__(self) -> "Attack":
        for i, kind in enumerate(self.kinds):
            self.socks[i] = self._open(kind)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            if s is not None:
                s.close()


def run(root: Path, work: Path, tag: str, args: argparse.Namespace) -> dict[str, Any]:
    proc, url, log = start_server(root, work, tag)
    try:
        r = httpx.post(url + "/v1/memory/learn", json={"text": TEXT}, timeout=300)
        r.raise_for_status()
        block_id = r.json()["block"]["id"]
        size = len(httpx.get(f"{url}/v1/blocks/{block_id}", timeout=60).content)
        ok = fail = 0
        held: list[int] = []
        errors: dict[str, int] = {}
        with Attack(url, block_id, args.slow_body, args.slow_read, args.attacker) as attack:
            time.sleep(2.0)  # the attack settles (sockets stalled) before the first normal request
            end = time.monotonic() + args.attack_s
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    with httpx.Client(timeout=5) as c:
                        if c.get(url + "/v1/models").status_code == 200:
                            ok += 1
                        else:
                            fail += 1
                except httpx.HTTPError as exc:
                    fail += 1
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                held.append(attack.held())
                time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
            opened = attack.opened
        return {"root": str(root), "tag": tag, "ok": ok, "failed": fail, "errors": errors,
                "attack_sockets_held_median": sorted(held)[len(held) // 2] if held else 0,
                "attack_connections_opened": opened, "block_bytes": size}
    finally:
        stop(proc, 20)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attack-s", type=float, default=40.0, help="seconds the attack lasts (normal requests: one a second)")
    ap.add_argument("--slow-body", type=int, default=50)
    ap.add_argument("--slow-read", type=int, default=50)
    ap.add_argument("--attacker", default="127.0.0.1", help="the attack's source address (127.0.0.x)")
    ap.add_argument("--baseline", type=Path, help="another checkout to measure in the same run (before)")
    ap.add_argument("--out", type=Path, default=RESULTS / "slow_clients.json")
    args = ap.parse_args()
    if not args.attacker.startswith("127."):
        raise SystemExit("--attacker must be a loopback address (127.x.x.x)")
    work = Path(tempfile.mkdtemp(prefix="graftmem-bench-slow-"))
    rows = []
    if args.baseline is not None:
        rows.append(run(args.baseline.resolve(), work, "before", args))
    rows.append(run(ROOT, work, "after", args))
    print(f"\n{args.slow_body} slow-body + {args.slow_read} slow-reader sockets from {args.attacker}, "
          f"{args.attack_s:.0f} s, server with 256 fds and default limits")
    print(f"{'server':<8} {'normal ok':>10} {'failed':>7} {'attack held (median)':>21} {'attack opened':>14}  errors")
    for r in rows:
        print(f"{r['tag']:<8} {r['ok']:>10} {r['failed']:>7} {r['attack_sockets_held_median']:>21} "
              f"{r['attack_connections_opened']:>14}  {r['errors']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {"attack_s": args.attack_s, "slow_body": args.slow_body, "slow_read": args.slow_read,
            "attacker": args.attacker, "rows": rows}
    prev = json.loads(args.out.read_text()) if args.out.exists() else []
    runs = prev if isinstance(prev, list) else [prev]
    args.out.write_text(json.dumps(runs + [data], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
