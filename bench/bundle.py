"""Bundle and HTTP throughput next to the plain operation on the same bytes.

Every graftmem path checks every byte (BLAKE3 of header/manifest and state, content id, announced
digests) and is durable (fsync before rename); the peers do neither check. So that the ratio
measures the checking and the format, not durability, each peer is given the same fsyncs:

* export  vs  copying the same block files into one directory (shutil.copyfile + fsync each)
* import  vs  copying the bundle file (shutil.copyfile + fsync)
* pull    vs  downloading the same block files from ``python -m http.server`` with httpx
              (streamed to disk + fsync); both servers run in their own process

The same numbers without any fsync are printed too. All files are in the page cache (just written):
this measures CPU and syscalls, not the disk. The three variants of each operation run back to back
in every round (the machine is shared); MB/s are medians over ``--repeat`` rounds and each ratio is
the median of the per-round ratios.

    python -m bench.bundle [--blocks 8] [--tokens 400] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import RESULTS, ROOT, summary, write_results
from graftmem import EngineConfig, Memory
from graftmem.share import export, import_bundle, pull
from graftmem.store import Store, fsync_path
from tests.conftest import long_text

TARGET = 0.70


def timed(fn, setup=None, teardown=None) -> float:
    arg = setup() if setup else None
    t0 = time.perf_counter()
    fn(arg) if setup else fn()
    dt = time.perf_counter() - t0
    if teardown:
        teardown(arg)
    return dt


def paired(nbytes: int, repeat: int, ours, plain, plain_no_fsync) -> dict[str, float]:
    """Run the three back to back, ``repeat`` times (each a (fn, setup, teardown) tuple), so that
    they see the same machine load (this machine is shared); MB/s are medians, and the ratio is the
    median of the per-round ratios, which is robust to load that changes between rounds."""
    t: dict[str, list[float]] = {"graftmem": [], "plain": [], "plain_no_fsync": []}
    for _ in range(repeat):
        for name, spec in (("graftmem", ours), ("plain", plain), ("plain_no_fsync", plain_no_fsync)):
            t[name].append(timed(*spec))
    out = {k: nbytes / 1e6 / summary(v)["median"] for k, v in t.items()}
    out["ratio"] = summary(p / o for o, p in zip(t["graftmem"], t["plain"]))["median"]
    out["ratio_no_fsync"] = summary(p / o for o, p in zip(t["graftmem"], t["plain_no_fsync"]))["median"]
    return out


def drop_store(s: Store) -> None:
    """Destination stores exist before the transfer (opening one is not timed) and go after it."""
    s.close()
    shutil.rmtree(s.home)


def spawn(cmd: list[str], marker: str, home: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "GRAFTMEM_HOME": home})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if marker not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400, help="about this many tokens per block")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "bundle.json"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="graftmem-bench-bundle-"))
    try:
        home_a = work / "a"
        t0 = time.perf_counter()
        with Memory("smollm2", home=home_a, config=EngineConfig(probe=False)) as mem:
            blocks = [mem.learn(long_text(int(args.tokens / 1.3), seed=100 + i), name=f"bench-{i}")
                      for i in range(args.blocks)]
            fingerprint = mem.fingerprint
        learn_s = time.perf_counter() - t0
        store = Store(home_a)
        files = [store.path_of(b.id) for b in blocks]
        nbytes = sum(p.stat().st_size for p in files)
        print(f"{len(blocks)} blocks, {sum(b.n_tokens for b in blocks)} tokens, {nbytes / 1e6:.1f} MB "
              f"of block files (learned in {learn_s:.1f} s)", flush=True)
        bundle = work / "bench.gmbundle"
        rows: dict[str, dict[str, float]] = {}
        counter = iter(range(10**6))

        # ------------------------------------------------------------------ export vs copy
        def do_export() -> None:
            bundle.unlink(missing_ok=True)
            export(store, bundle)

        def copy_files(sync: bool) -> None:
            d = work / f"copy-{next(counter)}"
            d.mkdir()
            for p in files:
                shutil.copyfile(p, d / p.name)
                if sync:
                    fsync_path(d / p.name)
            if sync:
                fsync_path(d)
            shutil.rmtree(d)

        rows["export"] = paired(nbytes, args.repeat, (do_export,), (lambda: copy_files(True),),
                                (lambda: copy_files(False),))
        do_export()
        bsize = bundle.stat().st_size

        # ------------------------------------------------------------------ import vs copy
        def do_import(s: Store) -> None:
            rep = import_bundle(s, bundle, fingerprint=fingerprint)
            assert len(rep.added) == len(blocks)

        def copy_bundle(sync: bool) -> None:
            dst = work / f"bundle-copy-{next(counter)}"
            shutil.copyfile(bundle, dst)
            if sync:
                fsync_path(dst)
            dst.unlink()

        new_store = (lambda: Store(work / f"dst-{next(counter)}"))
        rows["import"] = paired(bsize, args.repeat, (do_import, new_store, drop_store),
                                (lambda: copy_bundle(True),), (lambda: copy_bundle(False),))

        # ------------------------------------------------------------------ pull vs plain HTTP
        srv, line = spawn([sys.executable, "-m", "graftmem", "--home", str(home_a), "serve", "--port", "0"],
                          "serving", str(home_a))
        url = line.split(" at ")[1].split()[0]
        plain, pline = spawn([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
                              "--directory", str(home_a / "blocks")], "Serving HTTP", str(home_a))
        purl = f"http://127.0.0.1:{pline.split(' port ')[1].split()[0]}"
        try:
            def do_pull(s: Store) -> None:
                rep = pull(s, url, fingerprint=fingerprint)
                assert len(rep.added) == len(blocks)

            def http_download(sync: bool) -> None:
                d = work / f"dl-{next(counter)}"
                d.mkdir()
                with httpx.Client() as c:
                    for p in files:
                        dst = d / p.name
                        with c.stream("GET", f"{purl}/{p.parent.name}/{p.name}") as r, open(dst, "wb") as out:
                            r.raise_for_status()
                            for chunk in r.iter_raw():
                                out.write(chunk)
                            if sync:
                                out.flush()
                                os.fsync(out.fileno())
                if sync:
                    fsync_path(d)
                shutil.rmtree(d)

            rows["pull"] = paired(nbytes, args.repeat, (do_pull, new_store, drop_store),
                                  (lambda: http_download(True),), (lambda: http_download(False),))
        finally:
            for p in (srv, plain):
                p.terminate()
                p.wait(timeout=30)
        store.close()

        peers = {"export": "copy block files", "import": "copy bundle file", "pull": "http.server + httpx"}
        print(f"\n{'operation':<8} {'graftmem MB/s':>14} {'plain MB/s':>11} {'ratio':>6} {'target':>7}   "
              f"{'plain, no fsync':>15} {'ratio':>6}   peer")
        for op, r in rows.items():
            ok = "ok" if r["ratio"] >= TARGET else "MISS"
            print(f"{op:<8} {r['graftmem']:>14.0f} {r['plain']:>11.0f} {r['ratio']:>6.2f} {ok:>7}   "
                  f"{r['plain_no_fsync']:>15.0f} {r['ratio_no_fsync']:>6.2f}   {peers[op]}")
        result = {
            "blocks": len(blocks), "tokens": sum(b.n_tokens for b in blocks), "block_bytes": nbytes,
            "bundle_bytes": bsize, "repeat": args.repeat, "target_ratio": TARGET, "cpus": os.cpu_count(),
            "results": rows, "peers": peers,
            "note": "MB = 10^6 bytes; medians over rounds, each round runs graftmem and both peers "
                    "back to back; ratio = median of per-round ratios; files in page cache; 'plain' peers "
                    "fsync like graftmem, 'plain_no_fsync' do not",
        }
        out = write_results(args.out, result, args=args)
        print(f"\nwrote {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
