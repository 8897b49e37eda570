"""HTTP sharing over a real loopback server: `graftmem serve` in another process, pull / push with
httpx, Range and resume, and every refusal leaving the receiving store as it was.

Everything here is transport and refusal (byte-identical files, digests, fingerprints, tokens, signatures,
re-derivation), which holds on any model: the stores are built on the tiny random-weight Llama 3.1 of
tests/tiny.py (`tiny_llama`, a real llama.cpp engine), whose prefills cost ~1/100th of SmolLM2's; the
graft-equals-recorded checks still compare two real first-step logits hashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from graftmem import (AccessDenied, BlockCorrupted, BundleRejected, IncompatibleBlock, Memory,
                      TransferError, UntrustedBundle)
from graftmem.share.manifest import listing
from graftmem.server.blocks import BlockRoutes, BlockServer
from graftmem.share.client import SIGNATURE_HEADER
from graftmem.share.trust import SigningKey, TrustPolicy

from .conftest import long_text
from .test_bundle import QUERY, REPO, forge, make_forged, make_source, other_model, state_of
from .tiny import tiny_path

TOKEN = "push-token-for-tests"


@pytest.fixture(scope="module")
def source(tiny_llama, tmp_path_factory):
    """test_bundle's store A (two learned blocks, a graft's receipt, a bundle) on the tiny Llama 3.1."""
    yield from make_source(tiny_llama, tmp_path_factory.mktemp("source"))


@pytest.fixture
def forged(tiny_llama, tmp_path):
    yield from make_forged(tiny_llama, tmp_path)


@pytest.fixture
def mem(tiny_llama, tmp_path) -> Memory:
    """The receiving store B, on the same tiny engine as `source`."""
    with Memory(engine=tiny_llama, home=tmp_path / "store") as m:
        yield m


@pytest.fixture
def served(source):
    """Store A served read-only from this process (a real socket on 127.0.0.1)."""
    with BlockServer(source["mem"].store) as srv:
        yield srv


def test_round_trip_through_serve_in_another_process(source, mem):
    """`graftmem serve` runs in its own interpreter on store A; pull into B; graft on B gives the
    first-step logits SHA-256 recorded on A, and the block files are byte-identical."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "graftmem", "--home", str(source["mem"].store.home), "serve", "--port", "0",
         "--blocks-only"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "serving" in line, (proc.stderr.read()  # type: ignore[union-attr]
                                   if proc.poll() is not None else line)
        url = line.split(" at ")[1].split()[0]
        rep = mem.pull(url)
        assert sorted(rep.added) == sorted([source["b1"].id, source["b2"].id])
        r = mem.ask(source["b1"].id, QUERY, max_tokens=1)
        assert r.receipt.first_logits_sha256 == source["receipt"].first_logits_sha256
        for bid in rep.added:
            assert mem.store.path_of(bid).read_bytes() == source["mem"].store.path_of(bid).read_bytes()
        again = mem.pull(url)
        assert again.added == [] and sorted(again.present) == sorted(rep.added) and again.bytes == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_range_requests(source, served):
    bid = source["b1"].id
    whole = source["mem"].store.path_of(bid).read_bytes()
    url = f"{served.url}/v1/blocks/{bid}"
    with httpx.Client() as c:
        full = c.get(url)
        assert full.status_code == 200 and full.content == whole and full.headers["accept-ranges"] == "bytes"
        etag = full.headers["etag"]
        r = c.get(url, headers={"Range": "bytes=100-199"})
        assert r.status_code == 206 and r.content == whole[100:200]
        assert r.headers["content-range"] == f"bytes 100-199/{len(whole)}"
        assert c.get(url, headers={"Range": "bytes=4096-"}).content == whole[4096:]
        assert c.get(url, headers={"Range": "bytes=-32"}).content == whole[-32:]
        assert c.get(url, headers={"Range": "bytes=10-", "If-Range": etag}).status_code == 206
        stale = c.get(url, headers={"Range": "bytes=10-", "If-Range": '"not-the-etag"'})
        assert stale.status_code == 200 and stale.content == whole
        assert c.get(url, headers={"Range": f"bytes={len(whole)}-"}).status_code == 416
        head = c.head(url)
        assert head.status_code == 200 and int(head.headers["content-length"]) == len(whole)
        assert c.get(f"{url}/manifest").json()["id"] == bid
        listing = c.get(f"{served.url}/v1/blocks").json()
        assert {e["id"] for e in listing["blocks"]} == {source["b1"].id, source["b2"].id}


@pytest.mark.parametrize("path", ["/v1/blocks/../../../etc/passwd", "/v1/blocks/%2e%2e%2fetc%2fpasswd",
                                  "/v1/blocks/" + "A" * 64, "/v1/blocks/" + "0" * 64, "/etc/passwd"])
def test_server_serves_only_block_ids(served, path):
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(served.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request("GET", path)  # sent as is, no client-side normalisation
        r = conn.getresponse()
        assert r.status == 404, r.read()[:200]
    finally:
        conn.close()


class _CutRoutes(BlockRoutes):
    """A server that drops the connection after ``cut`` bytes of a block body (a flaky network)."""

    cut = 32 * 1024  # a third of the tiny Llama 3.1's block b1 (~180 tokens of 512 B)
    ranges: list[str] = []

    async def file_chunks(self, request, f, start, count):  # type: ignore[override]
        type(self).ranges.append(request.headers.get("range") or "")
        sent = 0
        async for chunk in super().file_chunks(request, f, start, min(count, self.cut)):
            sent += len(chunk)
            yield chunk
        raise ConnectionAbortedError(f"test: connection cut after {sent} bytes")


class _RecordingRoutes(BlockRoutes):
    ranges: list[str] = []

    async def file_chunks(self, request, f, start, count):  # type: ignore[override]
        type(self).ranges.append(request.headers.get("range") or "")
        async for chunk in super().file_chunks(request, f, start, count):
            yield chunk


def test_interrupted_download_is_refused_then_resumed(source, mem):
    before = state_of(mem)
    bid = source["b1"].id
    with BlockServer(source["mem"].store, routes=_CutRoutes) as flaky:
        with pytest.raises(TransferError, match="was cut after .* pull again to resume"):
            mem.pull(flaky.url, [bid])
    assert state_of(mem)[1] == before[1] == []  # nothing entered the store
    parts = list((mem.store.home / ".incoming").glob(f"{bid}.*.part"))
    assert len(parts) == 1 and 0 < parts[0].stat().st_size < source["mem"].store.path_of(bid).stat().st_size
    have = parts[0].stat().st_size
    _RecordingRoutes.ranges = []
    with BlockServer(source["mem"].store, routes=_RecordingRoutes) as good:
        rep = mem.pull(good.url, [bid])
    assert rep.added == [bid]
    assert _RecordingRoutes.ranges == [f"bytes={have}-"], "the download did not resume"
    assert mem.ask(bid, QUERY, max_tokens=1).receipt.first_logits_sha256 == \
        source["receipt"].first_logits_sha256
    assert not list((mem.store.home / ".incoming").glob("*.part"))


def test_damaged_partial_download_is_discarded_not_trusted(source, mem):
    """Bytes already on disk from an earlier pull are re-hashed: a damaged partial is thrown away."""
    bid = source["b1"].id
    with BlockServer(source["mem"].store, routes=_CutRoutes) as flaky:
        with pytest.raises(TransferError):
            mem.pull(flaky.url, [bid])
    part = next((mem.store.home / ".incoming").glob(f"{bid}.*.part"))
    raw = bytearray(part.read_bytes())
    raw[8] ^= 0xFF  # the magic: refused on the first 64 bytes
    part.write_bytes(bytes(raw))
    with BlockServer(source["mem"].store) as good:
        assert mem.pull(good.url, [bid]).added == [bid]


def test_corrupt_block_on_the_server_is_refused(source, tiny_llama, tmp_path, mem):
    with Memory(engine=tiny_llama, home=tmp_path / "bad-server") as bad:
        bad.import_bundle(source["bundle"])
        p = bad.store.path_of(source["b2"].id)
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        p.write_bytes(bytes(raw))
        before = state_of(mem)
        with BlockServer(bad.store) as srv:
            with pytest.raises(BlockCorrupted, match="state digest mismatch"):
                mem.pull(srv.url)
        assert state_of(mem)[1] == before[1] == []  # b1 arrived intact but nothing was adopted
        assert not list((mem.store.home / ".incoming").glob(f"{source['b2'].id}*"))


def test_pull_from_another_model_is_refused(source, tiny_llama, tmp_path, mem):
    with Memory(engine=tiny_llama, home=tmp_path / "other") as o:
        o.import_bundle(source["bundle"])
        fid = forge(o.store, source["b1"].id, fingerprint=other_model(source["b1"].fingerprint))
        with BlockServer(o.store) as srv:
            with pytest.raises(IncompatibleBlock, match="model_sha256"):
                mem.pull(srv.url)
            assert mem.get_all() == []
            rep = mem.pull(srv.url, incompatible="skip")
            assert rep.skipped == [fid] and sorted(rep.added) == sorted([source["b1"].id, source["b2"].id])


def test_push_needs_the_token(source, tiny_llama, tmp_path):
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub, hub.serve(push_token=TOKEN) as srv:
        before = state_of(hub)
        with pytest.raises(AccessDenied, match="no token|wrong token"):
            source["mem"].push(srv.url, token="not-the-token")
        # a raw upload without any token never reaches the import
        r = httpx.post(f"{srv.url}/v1/bundles", content=source["bundle"].read_bytes())
        assert r.status_code == 401 and r.json()["error"] == "AccessDenied"
        assert state_of(hub) == before
        rep = source["mem"].push(srv.url, [source["b1"].id], token=TOKEN)
        assert rep.added == [source["b1"].id]
        assert hub.ask(source["b1"].id, QUERY, max_tokens=1).receipt.first_logits_sha256 == \
            source["receipt"].first_logits_sha256


def test_push_is_off_without_a_token(source, served):
    with pytest.raises(AccessDenied, match="does not accept pushes"):
        source["mem"].push(served.url, token=TOKEN)


def test_pushed_bundle_is_checked_like_a_file(source, tiny_llama, tmp_path):
    raw = bytearray(source["bundle"].read_bytes())
    raw[len(raw) // 2] ^= 0x01
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub, hub.serve(push_token=TOKEN) as srv:
        before = state_of(hub)
        r = httpx.post(f"{srv.url}/v1/bundles", content=bytes(raw),
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 422 and r.json()["error"] == "BlockCorrupted"
        r = httpx.post(f"{srv.url}/v1/bundles", content=bytes(raw[: len(raw) // 3]),
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 422 and r.json()["error"] == "BundleRejected"
        assert state_of(hub) == before


def test_signatures_over_http(source, tiny_llama, tmp_path, mem):
    key, stranger = SigningKey.generate(), SigningKey.generate()
    strict = TrustPolicy(require_signature=True).trust(key.public_key)
    with BlockServer(source["mem"].store) as unsigned:
        with pytest.raises(UntrustedBundle, match="not signed"):
            mem.pull(unsigned.url, policy=strict)
    with BlockServer(source["mem"].store, sign_key=stranger) as other:
        with pytest.raises(UntrustedBundle, match="does not list"):
            mem.pull(other.url, policy=strict)
    assert mem.get_all() == []
    with BlockServer(source["mem"].store, sign_key=key) as signed:
        assert SIGNATURE_HEADER.lower() in httpx.get(f"{signed.url}/v1/blocks").headers
        rep = mem.pull(signed.url, policy=strict)
        assert rep.signer == key.public_key.key_id and rep.signer_trusted and len(rep.added) == 2
    # the hub requires signed pushes: unsigned refused, signed by a trusted key accepted
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub:
        strict.save(hub.store.home)
        with hub.serve(push_token=TOKEN) as srv:
            with pytest.raises(UntrustedBundle, match="not signed"):
                source["mem"].push(srv.url, token=TOKEN)
            assert hub.get_all() == []
            assert len(source["mem"].push(srv.url, token=TOKEN, sign_key=key).added) == 2


def test_cli_pull_and_push(source, tiny_llama, tmp_path, capsys):
    from graftmem.cli import main

    cfg = ["--model", str(tiny_path("llama31")), "--config", '{"probe": false, "n_threads": 1}']
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub, hub.serve(push_token=TOKEN) as srv:
        assert main(["--home", str(source["mem"].store.home), "push", srv.url, source["b2"].id[:8],
                     "--token", TOKEN]) == 0
        assert [b.id for b in hub.get_all()] == [source["b2"].id]
        assert "1 added" in capsys.readouterr().out
        home_c = str(tmp_path / "c")
        assert main(["--home", home_c, *cfg, "--json", "pull", srv.url]) == 0
        pulled = json.loads(capsys.readouterr().out)
        assert pulled["added"] == [source["b2"].id]
        assert main(["--home", home_c, "ls"]) == 0
        assert source["b2"].id[:12] in capsys.readouterr().out
        assert main(["--home", home_c, *cfg, "pull", srv.url + "/nope"]) == 2


def test_pull_with_rederive_refuses_a_forged_state(forged, mem):
    f, aid = forged
    with BlockServer(f.store) as srv:
        before = state_of(mem)
        with pytest.raises(BlockCorrupted, match="not what its"):
            mem.pull(srv.url, rederive=True)
        assert state_of(mem)[1] == before[1] == []
        with pytest.raises(BlockCorrupted, match="not what its"):  # the default re-derives too
            mem.pull(srv.url)
        assert mem.pull(srv.url, rederive=False).added == [aid]  # opted out: digests cannot tell
        assert mem.get(aid).provenance == "unverified"


class _HostileListing(BlockRoutes):
    """A server whose listing tries to make the client write outside its store."""

    def listing_body(self, blocks):  # type: ignore[override]
        man = json.loads(listing(self.store, blocks).model_dump_json())
        man["blocks"][0]["manifest_digest"] = "blake3:../../../../../../tmp/graftmem-evil-part"
        return json.dumps(man).encode()


def test_hostile_listing_is_refused(source, mem):
    with BlockServer(source["mem"].store, routes=_HostileListing) as srv:
        with pytest.raises(BundleRejected, match="does not parse"):
            mem.pull(srv.url)
    assert not list(Path("/tmp").glob("graftmem-evil-part*"))
    assert mem.get_all() == []


def test_two_pulls_of_one_block_do_not_interleave(source, mem, served):
    """A pull that finds the block's part file locked by another pull refuses instead of mixing bytes."""
    import fcntl

    from graftmem.share.client import fetch_listing

    with httpx.Client() as c:
        man, _, _ = fetch_listing(c, served.url, TrustPolicy())
    e = next(x for x in man.blocks if x.id == source["b1"].id)
    incoming = mem.store.home / ".incoming"
    incoming.mkdir()
    part = incoming / f"{e.id}.{e.etag[:16]}.part"
    with open(part, "ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TransferError, match="another pull"):
            mem.pull(served.url, [e.id])
    assert mem.pull(served.url, [e.id]).added == [e.id]


def test_hub_that_rederives_refuses_a_forged_push(forged, tiny_llama, tmp_path):
    f, aid = forged
    with Memory(engine=tiny_llama, home=tmp_path / "hub") as hub, hub.serve(push_token=TOKEN, rederive=True) as srv:
        with pytest.raises(BlockCorrupted, match="not what its"):
            f.push(srv.url, token=TOKEN)
        assert hub.get_all() == []


def test_cli_serve_with_a_push_token_accepts_pushes(source, tiny_llama, tmp_path):
    hub = tmp_path / "hub"
    proc = subprocess.Popen(
        [sys.executable, "-m", "graftmem", "--home", str(hub), "--model", str(tiny_path("llama31")),
         "--config", '{"probe": false, "n_threads": 1}', "serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "GRAFTMEM_PUSH_TOKEN": TOKEN})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "pushes on" in line, (proc.stderr.read()  # type: ignore[union-attr]
                                     if proc.poll() is not None else line)
        url = line.split(" at ")[1].split()[0]
        with pytest.raises(AccessDenied):
            source["mem"].push(url, token="wrong-token-x")
        rep = source["mem"].push(url, token=TOKEN)
        assert sorted(rep.added) == sorted([source["b1"].id, source["b2"].id])
        assert httpx.get(f"{url}/v1/info").json()["blocks"] == 2
        assert "OpenAI API at" in line  # the CLI serves the OpenAI-compatible API on the same socket
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == tiny_llama.fingerprint.model_name
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_pulling_a_chained_block_brings_its_parent(tiny_llama, mem, tmp_path):
    with Memory(engine=tiny_llama, home=tmp_path / "chain") as c:
        root = c.learn(long_text(60, seed=11), name="root")
        child = c.learn(" " + long_text(40, seed=12), name="child", parent=root.id)
        with c.serve() as srv:
            rep = mem.pull(srv.url, [child.id[:10]])
        assert sorted(rep.added) == sorted([root.id, child.id])
        assert mem.get(child.id).parent == root.id
