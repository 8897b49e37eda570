"""A seeded fuzz run over a store with a root and a delta block, and over its bundle: random bit flips,
truncations and junk directory entries (FIFO, dangling symlink, symlink out of the store, directory
named <id>.gmb, garbage files, temp files of reused pids, a junk index). Bounded to about a minute
here; ``python -m bench.fuzz`` is the long mode (>= 10,000 mutations, counts in docs/security.md).

0 silent acceptances: every block that reads back (or imports) is byte-identical to the reference,
whose state was re-derived (equal to a fresh prefill) at the start. 0 unusable stores: every mutated
store opens (no hang), lists, and takes a good write afterwards."""

from __future__ import annotations

from bench import fuzz


def test_fuzzed_stores_and_bundles_never_accept_silently_nor_break(smol, tmp_path):
    res = fuzz.run(smol, mutations=400, seed=20261201, seconds=60, workdir=tmp_path)
    assert res["silent_acceptances"] == 0, res["notes"]
    assert res["unusable_stores"] == 0, res["notes"]
    # the run did real work: every kind of mutation was tried, and both outcomes occurred
    n_kinds = len(fuzz.STORE_KINDS) + len(fuzz.BUNDLE_KINDS)
    assert res["mutations"] >= n_kinds, res
    assert set(res["per_kind"]) == set(fuzz.STORE_KINDS + fuzz.BUNDLE_KINDS)
    assert res["counts"].get("accepted_intact", 0) > 0
    assert sum(v for k, v in res["counts"].items() if k.startswith("refused:")) > 0
    assert res["counts"].get("quarantined_entries", 0) > 0
