"""Fuzz the store and the bundle reader: random byte flips, truncations and junk directory entries
over a store with a root block and a chained (delta) block, counting silent acceptances and unusable
stores. Both counts must be 0.

A round copies a pristine store (or bundle), applies ONE random mutation, then opens the store the
way an application would and uses it:

* **store mutations** (flip bytes / truncate a block file, junk entries under ``blocks/``: a FIFO, a
  dangling symlink, a symlink to a file outside the store, a directory named ``<id>.gmb``, a garbage
  file named ``<id>.gmb``, stale and unparseable temp files, with or without deleting the index so that
  every file is re-read): ``Store()`` must open (never hang: a FIFO is the classic trap), ``list`` must
  work, every listed block is loaded through :func:`graftmem.store.load_state` (every digest checked) and
  a known-good block must still be writable and readable (the store is usable);
* **bundle mutations** (flip bytes / truncate the exported bundle): imported into an empty store with
  no re-derivation (``check=None``: the digests alone, the weakest policy), all or nothing.

A block that is *accepted* (loaded without error, or imported) must be byte-identical to the
reference: its full state digest equals the state a fresh prefill of its tokens gives (checked once
at the start by re-deriving every reference block), and its manifest (text, tokens, positions, name,
parent) equals the original. Anything else is a **silent acceptance**. A store that raises on open or
list, hangs, or refuses a good write after the mutation is an **unusable store**.

    python -m bench.fuzz [--mutations 10000] [--seed 1] [--minutes 30] [--out bench/results/fuzz.json]

Writes bench/results/fuzz.json. The engine runs only for the reference (a few prefills); the rounds
are file and hash work, one process, so the run is cheap per mutation on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from bench.harness import RESULTS, engine, write_results
from graftmem import GraftmemError, Memory
from graftmem.core import state_digest
from graftmem.share import import_bundle
from graftmem.store import Store, load_state
from tests.conftest import no_hang  # the same guard the store tests use

ROOT_TEXT = ("Refunds: always ask for the order number first, then check the purchase date. Orders older "
             "than thirty days are refused politely.")
CHILD_TEXT = " Exchanges follow the same rule, and gift cards are never refunded."
STORE_KINDS = ("flip", "flip-index-lost", "truncate", "truncate-index-lost", "fifo", "dangling-symlink",
               "symlink-outside", "dir-named-block", "garbage-block", "temp-files", "index-garbage")
BUNDLE_KINDS = ("bundle-flip", "bundle-truncate")
ROUND_TIMEOUT_S = 20


class Reference:
    """The pristine store (a root + a delta child) and what every accepted block must equal."""

    def __init__(self, workdir: Path, engine: Any) -> None:
        self.home = workdir / "pristine"
        with Memory(engine=engine, home=self.home) as m:
            root = m.learn(ROOT_TEXT, name="refunds")
            child = m.learn(CHILD_TEXT, name="exchanges", parent=root.id)
            for b in (root, child):  # the reference is itself proved: state == fresh prefill
                rep = m.rederive(b.id)
                if not rep.ok:
                    raise SystemExit(f"reference block {b.short_id} does not re-derive; cannot fuzz")
            self.bundle = workdir / "pristine.gmbundle"
            m.export(self.bundle)
            self.blocks = {b.id: m.get(b.id) for b in (root, child)}
            self.full_digest = {root.id: root.state_digest, child.id: child.full_state_digest}
            self.files = {bid: m.store.path_of(bid) for bid in self.blocks}
        self.good_state = self._state(self.home, root.id)

    @staticmethod
    def _state(home: Path, bid: str) -> bytes:
        s = Store(home)
        try:
            return bytes(s.read_state(bid, lambda n: memoryview(bytearray(n)))[1])
        finally:
            s.close()

    def same_manifest(self, b: Any) -> bool:
        ref = self.blocks.get(b.id)
        return ref is not None and all(getattr(b, f) == getattr(ref, f) for f in
                                       ("text", "tokens", "pos_start", "name", "parent", "kind", "n_tokens"))


def _flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    n = rng.choice((1, 1, 1, 2, 8))
    for _ in range(n):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"{n} bit(s)"


def _truncate(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    cut = rng.choice((0, rng.randrange(64), rng.randrange(size), size - rng.randrange(1, 33)))
    os.truncate(path, max(0, cut))
    return f"at {cut} of {size}"


def _slot(path: Path, elsewhere: Path, rng: random.Random) -> Path:
    """``path`` on heads, else ``elsewhere`` (one coin flip), emptied for a hostile entry."""
    target = path if rng.random() < 0.5 else elsewhere
    target.parent.mkdir(exist_ok=True)
    target.unlink(missing_ok=True)
    return target


def mutate_store(ref: Reference, home: Path, kind: str, rng: random.Random, outside: Path) -> str:
    bid = rng.choice(sorted(ref.blocks))
    path = home / ref.files[bid].relative_to(ref.home)
    other = "%064x" % rng.getrandbits(256)
    odir = home / "blocks" / other[:2]
    if kind.startswith("flip"):
        what = _flip(path, rng)
    elif kind.startswith("truncate"):
        what = _truncate(path, rng)
    elif kind == "fifo":
        target = _slot(path, odir / f"{other}.gmb", rng)
        os.mkfifo(target)
        what = str(target.name[:8])
    elif kind == "dangling-symlink":
        target = _slot(path, odir / f"{other}.gmb", rng)
        target.symlink_to(outside / "does-not-exist")
        what = str(target.name[:8])
    elif kind == "symlink-outside":
        victim = outside / "victim.gmb"
        shutil.copyfile(path, victim)  # a valid block file outside the store, linked in
        target = _slot(odir / f"{other}.gmb", path, rng)  # the coin as before: heads is the new path
        target.symlink_to(victim)
        what = str(target.name[:8])
    elif kind == "dir-named-block":
        target = _slot(path, odir / f"{other}.gmb", rng)
        target.mkdir()
        (target / "x").write_bytes(b"junk")
        what = str(target.name[:8])
    elif kind == "garbage-block":
        odir.mkdir(exist_ok=True)
        (odir / f"{other}.gmb").write_bytes(rng.randbytes(rng.randrange(1, 9000)))
        what = "random bytes"
    elif kind == "temp-files":
        d = path.parent
        (d / f".{bid}.1.2.tmp").write_bytes(b"x")               # pid 1: alive (reused pid), old
        os.utime(d / f".{bid}.1.2.tmp", (1, 1))
        (d / ".garbage.tmp").write_bytes(b"x")                  # unparseable name, old
        os.utime(d / ".garbage.tmp", (1, 1))
        (d / f".{bid}.{os.getpid()}.9.tmp").mkdir()             # a directory named like a temp file
        os.utime(d / f".{bid}.{os.getpid()}.9.tmp", (1, 1))
        what = "3 temp entries"
    elif kind == "index-garbage":
        idx = home / "index.sqlite"
        for p in home.glob("index.sqlite*"):
            p.unlink()
        idx.write_bytes(rng.randbytes(4096))
        what = "index replaced by junk"
    else:
        raise ValueError(kind)
    if kind.endswith("index-lost"):
        for p in home.glob("index.sqlite*"):
            p.unlink()
    return what


def check_store(ref: Reference, home: Path, counts: Counter, notes: list[str], label: str) -> None:
    """Open and use the mutated store; count accepted, refused, silent acceptances, unusable stores."""
    try:
        store = Store(home, lock_timeout=5)
    except GraftmemError as exc:
        if "index" in str(exc) and "index-garbage" in label:
            # a junk index is named plainly; removing it is the documented fix: then it must open
            for p in home.glob("index.sqlite*"):
                p.unlink()
            counts["index_refused_plainly"] += 1
            try:
                store = Store(home, lock_timeout=5)
            except Exception as exc2:  # noqa: BLE001
                counts["unusable_store"] += 1
                notes.append(f"{label}: store does not open even without its index: {exc2!r}")
                return
        else:
            counts["unusable_store"] += 1
            notes.append(f"{label}: Store() raised {exc!r}")
            return
    except Exception as exc:  # noqa: BLE001 - any other exception is a crash
        counts["unusable_store"] += 1
        notes.append(f"{label}: Store() crashed: {exc!r}")
        return
    try:
        try:
            blocks = store.list()
        except Exception as exc:  # noqa: BLE001
            counts["unusable_store"] += 1
            notes.append(f"{label}: list() raised {exc!r}")
            return
        for b in blocks:
            try:
                got, view = load_state(store, b.id, lambda n: memoryview(bytearray(n)))
            except GraftmemError as exc:
                counts[f"refused:{type(exc).__name__}"] += 1
                continue
            except Exception as exc:  # noqa: BLE001
                counts["crash_on_read"] += 1
                notes.append(f"{label}: reading {b.short_id} crashed: {exc!r}")
                continue
            digest = state_digest(view)
            if b.id not in ref.full_digest:
                # a block the mutation invented (e.g. a valid file linked in under another name) can
                # only be accepted if it is not a symlink and its content address holds: count it
                counts["accepted_foreign_id"] += 1
                notes.append(f"{label}: accepted unknown block {b.id[:12]}")
                counts["silent_acceptance"] += 1
            elif digest != ref.full_digest[b.id] or not ref.same_manifest(got):
                counts["silent_acceptance"] += 1
                notes.append(f"{label}: block {b.short_id} accepted with other bytes or labels")
            else:
                counts["accepted_intact"] += 1
        # usable: a known-good block can still be written and read back
        try:
            root = ref.blocks[next(iter(ref.blocks))]
            if root.parent is None and not store.contains(root.id):
                store.put(root, ref.good_state)
            _, view = store.read_state(root.id, lambda n: memoryview(bytearray(n)))
            if state_digest(view) != root.state_digest:
                raise RuntimeError("read back other bytes")
        except GraftmemError as exc:
            if store.contains(root.id) and "not what" not in str(exc):
                # the damaged copy is indexed; deleting it is the documented way out, then it must work
                try:
                    store.delete(root.id, cascade=True)
                    store.put(root, ref.good_state)
                    counts["recovered_by_delete"] += 1
                except Exception as exc2:  # noqa: BLE001
                    counts["unusable_store"] += 1
                    notes.append(f"{label}: cannot write a good block after delete: {exc2!r}")
            else:
                counts["unusable_store"] += 1
                notes.append(f"{label}: cannot write a good block: {exc!r}")
        except Exception as exc:  # noqa: BLE001
            counts["unusable_store"] += 1
            notes.append(f"{label}: writing a good block crashed: {exc!r}")
        counts["quarantined_entries"] += sum(1 for _ in (home / "quarantine").glob("*")) \
            if (home / "quarantine").is_dir() else 0
    finally:
        store.close()


def check_bundle(ref: Reference, bundle: Path, home: Path, fingerprint: Any, counts: Counter,
                 notes: list[str], label: str) -> None:
    store = Store(home, lock_timeout=5)
    try:
        try:
            rep = import_bundle(store, bundle, fingerprint=fingerprint, check=None)
        except GraftmemError as exc:
            counts[f"refused:{type(exc).__name__}"] += 1
            if store.list():
                counts["silent_acceptance"] += 1
                notes.append(f"{label}: a refused bundle left blocks behind")
            return
        except Exception as exc:  # noqa: BLE001
            counts["crash_on_import"] += 1
            notes.append(f"{label}: import crashed: {exc!r}")
            return
        for bid in rep.added:
            b, view = load_state(store, bid, lambda n: memoryview(bytearray(n)))
            if bid not in ref.full_digest or state_digest(view) != ref.full_digest[bid] or not ref.same_manifest(b):
                counts["silent_acceptance"] += 1
                notes.append(f"{label}: bundle block {bid[:12]} accepted with other bytes or labels")
            elif b.provenance != "unverified":
                counts["silent_acceptance"] += 1
                notes.append(f"{label}: an unchecked import landed as {b.provenance}")
            else:
                counts["accepted_intact"] += 1
    finally:
        store.close()


def run(engine: Any, *, mutations: int, seed: int, seconds: float, workdir: Optional[Path] = None,
        log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """``mutations`` rounds (or until ``seconds`` pass), seeded; returns the counts."""
    rng = random.Random(seed)
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="graftmem-fuzz-")) if own else workdir
    assert work is not None
    counts: Counter = Counter()
    notes: list[str] = []
    per_kind: Counter = Counter()
    t0 = time.perf_counter()
    try:
        ref = Reference(work, engine)
        outside = work / "outside"
        outside.mkdir()
        kinds = STORE_KINDS + BUNDLE_KINDS
        done = 0
        while done < mutations and time.perf_counter() - t0 < seconds:
            kind = kinds[done % len(kinds)]  # every kind in turn; the mutation itself is random
            round_dir = work / "round"
            shutil.rmtree(round_dir, ignore_errors=True)
            round_dir.mkdir()
            label = f"#{done} {kind}"
            try:
                with no_hang(ROUND_TIMEOUT_S):
                    if kind in BUNDLE_KINDS:
                        b = round_dir / "b.gmbundle"
                        shutil.copyfile(ref.bundle, b)
                        what = _flip(b, rng) if kind == "bundle-flip" else _truncate(b, rng)
                        check_bundle(ref, b, round_dir / "home", engine.fingerprint, counts, notes,
                                     f"{label} {what}")
                    else:
                        home = round_dir / "home"
                        shutil.copytree(ref.home, home, symlinks=True,
                                        ignore=shutil.ignore_patterns("lock", ".staging", "router", "pages"))
                        what = mutate_store(ref, home, kind, rng, outside)
                        check_store(ref, home, counts, notes, f"{label} {what}")
            except TimeoutError as exc:
                counts["unusable_store"] += 1
                notes.append(f"{label}: {exc}")
            per_kind[kind] += 1
            done += 1
            if done % 500 == 0:
                log(f"{done} mutations, {time.perf_counter() - t0:.0f} s, silent "
                    f"{counts['silent_acceptance']}, unusable {counts['unusable_store']}")
        return {"seed": seed, "mutations": done, "seconds": round(time.perf_counter() - t0, 1),
                "silent_acceptances": counts["silent_acceptance"], "unusable_stores": counts["unusable_store"],
                "counts": dict(sorted(counts.items())), "per_kind": dict(sorted(per_kind.items())),
                "notes": notes[:50]}
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutations", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=30.0, help="stop after this long even if not done")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=str(RESULTS / "fuzz.json"))
    args = ap.parse_args()
    with engine(args.model, n_ctx=512, probe=False) as eng:
        res = run(eng, mutations=args.mutations, seed=args.seed, seconds=args.minutes * 60,
                  log=lambda s: print(s, flush=True))
    res["model"] = args.model
    print(f"\n{'class':<34}{'count':>10}")
    for k, v in res["counts"].items():
        print(f"{k:<34}{v:>10}")
    print(f"\nmutations {res['mutations']} in {res['seconds']} s: {res['silent_acceptances']} silent "
          f"acceptances, {res['unusable_stores']} unusable stores")
    for n in res["notes"][:20]:
        print("  ", n)
    out = write_results(args.out, res, args=args)
    print(f"wrote {out}")
    if res["silent_acceptances"] or res["unusable_stores"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
