"""`Memory.serve(ServeConfig)` and `RemoteMemory`: one config object from the CLI to the server, and
`Memory`'s verbs against a real server on 127.0.0.1 giving `Memory`'s typed results and exceptions.

Configuration, transport and error mapping (and remote answer == local answer, two real computations)
hold on any model: the server's engine is the tiny random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`),
whose prefills cost ~1/100th of SmolLM2's. The pool test stays on SmolLM2's default-configured engine: an
engine given an explicit n_threads (as `tiny_llama` is) keeps it, and resizing the threads is its point."""

from __future__ import annotations

import dataclasses

import pytest

from graftmem import (AccessDenied, Block, BlockNotFound, BlockSummary, ClosedError, ConfigError, Memory, Recall,
                      RemoteMemory, SearchHit, ServeConfig, TransferError)
from graftmem.api import RemoteJSON
from graftmem.cli import main
from graftmem.cli.parser import build_parser
from graftmem.cli.serve import serve_config
from graftmem.server import Limits
from graftmem.core.engine import threads_per_engine

KEY = "remote-test-key-1"
TEXT = "Refunds take 14 days and need the receipt."


def test_serve_config_is_checked_frozen_and_names_the_field():
    with pytest.raises(ConfigError, match="port=70000") as err:
        ServeConfig(port=70000)
    assert err.value.param == "port"
    for bad in ({"engines": 0}, {"auto_storage": "zip"}, {"sightings": True}, {"responses_ttl": -1.0},
                {"api_key": "short"}, {"max_queue": -1}):
        with pytest.raises(ConfigError) as err:
            ServeConfig(**bad)
        assert err.value.param == next(iter(bad)), bad
    with pytest.raises(ConfigError, match="unknown server option.*max_queu\\b") as err:
        ServeConfig.of(max_queu=3)  # a misspelt option is not ignored
    assert err.value.param == "max_queu"
    cfg = ServeConfig(api=True, port=0, max_queue=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
    changed = cfg.replace(sightings=5)
    assert (changed.sightings, changed.max_queue, cfg.sightings) == (5, 3, 2)
    with pytest.raises(ConfigError):
        cfg.replace(min_prefix_tokens=0)


def test_serve_flags_become_one_config():
    args = build_parser().parse_args([
        "serve", "--port", "0", "--engines", "3", "--max-queue", "4", "--no-learn", "--max-auto-mb", "5",
        "--auto-storage", "delta", "--no-warm", "--responses-ttl", "60", "--shared-learned", "--no-rederive",
        "--min-prefix-tokens", "32", "--sightings", "3", "--allow-unverified"])
    cfg = serve_config(args, api_key=KEY, push_token="push-token")
    assert cfg == ServeConfig(port=0, api=True, api_key=KEY, push_token="push-token", rederive=False,
                              allow_unverified=True, engines=3, max_queue=4, learn=False, min_prefix_tokens=32,
                              sightings=3, max_auto_bytes=5 << 20, auto_storage="delta", warm=False,
                              shared_learned=True, responses_ttl=60.0)
    blocks_only = serve_config(build_parser().parse_args(["serve", "--blocks-only"]), api_key=None, push_token=None)
    assert blocks_only.api is False and blocks_only.port == 8765 and blocks_only.limits is None
    limited = serve_config(build_parser().parse_args([
        "serve", "--max-connections", "40", "--max-connections-per-client", "5", "--min-body-rate", "100",
        "--body-grace", "2", "--write-timeout", "3", "--max-embedding-inputs", "7", "--max-embedding-chars", "900"]),
        api_key=None, push_token=None)
    assert limited.limits == Limits(max_connections=40, max_connections_per_client=5, min_body_rate=100,
                                    body_grace=2.0, write_timeout=3.0, max_embedding_inputs=7,
                                    max_embedding_chars=900)
    bounded = serve_config(build_parser().parse_args([
        "serve", "--render-timeout", "2.5", "--max-messages", "64", "--max-schema-repeat", "40",
        "--max-enum-values", "9"]), api_key=None, push_token=None)
    assert bounded.limits is not None and bounded.limits.render_timeout == 2.5 and bounded.limits.max_messages == 64
    assert (bounded.limits.grammar.max_repeat, bounded.limits.grammar.max_enum_values) == (40, 9)
    assert bounded.limits.grammar.max_gbnf_depth == Limits().grammar.max_gbnf_depth  # the others stay the defaults
    with pytest.raises(ConfigError) as err:  # checked where the config is made, before any model loads
        serve_config(build_parser().parse_args(["serve", "--engines", "0"]), api_key=None, push_token=None)
    assert err.value.param == "engines"


def test_memory_serve_takes_the_config_and_its_overrides(smol, tmp_path):
    own, big = smol.n_threads, threads_per_engine(2) + 2
    smol.set_threads(big)  # more than each engine of a pool of 2 gets
    with Memory(engine=smol, home=tmp_path / "home") as mem:
        cfg = ServeConfig(api=True, min_prefix_tokens=16, warm=False, engines=2)
        srv = mem.serve(cfg, sightings=1)  # keywords override the config
        extra = srv.pool.engines[1]
        try:
            assert srv.config == cfg.replace(sightings=1) and srv.config.api_key is None
            assert srv.pool.engines[0] is smol and len(srv.pool.engines) == 2  # engines=2: one more opened
            assert (srv.cache.min_tokens, srv.cache.sightings) == (16, 1)
            assert smol.n_threads_batch == extra.n_threads_batch < big  # prefill sized for the pool
            assert smol.n_threads == extra.n_threads == big  # one-token calls: the Memory's engine's count
        finally:
            srv.close()
            threads_after = (smol.n_threads, smol.n_threads_batch)
            smol.set_threads(own)
        assert threads_after == (big, big)  # the Memory's engine outlives the server: its threads are given back
        with pytest.raises(ClosedError):  # the engine the server opened is closed with it; the Memory's is not
            extra.tokenize("x")
        assert smol.tokenize("x")
        with pytest.raises(ConfigError, match="unknown server option"):
            mem.serve(api=True, max_auto_mb=5)
        blocks = mem.serve(port=0)  # api=False: block sharing only, as before
        assert not hasattr(blocks, "pool")
        blocks.close()


@pytest.fixture
def served(tiny_llama, minilm, tmp_path):
    """A Memory on the shared engine and its server (REST, with a router and a key) started on 127.0.0.1."""
    with Memory(engine=tiny_llama, home=tmp_path / "home", embedder=minilm) as mem:
        srv = mem.serve(api=True, api_key=KEY, warm=False).start()
        try:
            yield mem, srv
        finally:
            srv.close()


def test_remote_memory_verbs_give_memorys_results(served):
    mem, srv = served
    with RemoteMemory(srv.url, api_key=KEY) as remote:
        block = remote.learn(TEXT, chat=True, name="refunds", when_to_use="questions about refunds")
        assert isinstance(block, Block) and block == mem.get(block.id).model_copy(update={"provenance": None,
                                                                                         "labels_trusted": None})
        assert remote.learn(TEXT, chat=True, name="refunds").id == block.id  # content-addressed, as Memory's
        listed = remote.ls()
        assert [type(s) for s in listed] == [BlockSummary] and listed[0].id == block.id
        assert (listed[0].model, listed[0].provenance, listed[0].n_tokens) == (
            block.fingerprint.model_name, "local", block.n_tokens)
        assert remote.get(block.id[:10]).id == block.id
        # the answer is Memory's, receipt included
        r = remote.ask(block.id, " How long do refunds take?", max_tokens=8)
        local = mem.ask(block.id, " How long do refunds take?", max_tokens=8)
        assert isinstance(r, Recall) and r.text == local.text and r.tokens == local.tokens
        assert r.receipt.tokens_restored == local.receipt.tokens_restored == block.n_tokens
        assert r.receipt.first_logits_sha256 == local.receipt.first_logits_sha256
        hits = remote.search("how long is a refund", top_k=3)
        assert [type(h) for h in hits] == [SearchHit] and hits[0].block_id == block.id
        assert [h.block_id for h in hits] == [h.block_id for h in mem.search("how long is a refund", top_k=3)]
        rec = remote.recall("How long do refunds take?", max_tokens=8)
        assert rec.block is not None and rec.block.id == block.id and rec.receipt.tokens_restored == block.n_tokens
        assert remote.delete(block.id) == [block.id]
        assert remote.ls() == []


def test_remote_memory_errors_are_memorys_exceptions(served):
    mem, srv = served
    block = mem.learn(TEXT, chat=True, name="refunds")
    with RemoteMemory(srv.url, api_key="not-the-key-123") as wrong:
        with pytest.raises(AccessDenied, match="401"):
            wrong.ls()
    with RemoteMemory(srv.url) as keyless:
        with pytest.raises(AccessDenied, match="401"):
            keyless.get(block.id)
    with RemoteMemory(srv.url, api_key=KEY) as remote:
        with pytest.raises(BlockNotFound, match="404"):
            remote.get("f" * 64)
        with pytest.raises(BlockNotFound):
            remote.ask("f" * 64, "q", max_tokens=2)
        with pytest.raises(ConfigError, match="400") as err:  # checked there as Memory checks it here
            remote.learn("   ")
        assert err.value.param == "text"
        with pytest.raises(ConfigError) as err:
            remote.search("refunds", top_k=0)
        assert err.value.param == "top_k"
    # the light client maps them the same way (one mapping)
    with pytest.raises(BlockNotFound):
        RemoteJSON(srv.url, api_key=KEY).get("f" * 64)
    with pytest.raises(AccessDenied):
        RemoteJSON(srv.url, api_key="not-the-key-123").ls()
    with pytest.raises(ConfigError):
        RemoteMemory("127.0.0.1:8765")  # not a URL


def test_remote_memory_to_a_closed_server_is_a_transfer_error(served):
    mem, srv = served
    url = srv.url
    srv.close()
    with RemoteMemory(url, api_key=KEY) as remote:
        with pytest.raises(TransferError, match="cannot reach"):
            remote.ls()
    with pytest.raises(TransferError, match="cannot reach"):
        RemoteJSON(url).ls()


def test_cli_ls_prints_a_remote_store_as_a_local_one(served, capsys, monkeypatch):
    mem, srv = served
    mem.learn(TEXT, chat=True, name="refunds", when_to_use="questions about refunds")
    mem.learn("The office opens at 9 am on weekdays.", name="hours")
    monkeypatch.setenv("GRAFTMEM_API_KEY", KEY)
    assert main(["ls", "--url", srv.url]) == 0
    remote = capsys.readouterr().out
    assert main(["ls", "--home", str(mem.store.home)]) == 0
    local = capsys.readouterr().out
    assert remote == local and "provenance" in remote and "refunds" in remote and "hours" in remote
    # a missing block through --url is the local error class (it used to be a TransferError)
    assert main(["ask", "f" * 64, "q", "--url", srv.url]) == 2
    assert "BlockNotFound" not in capsys.readouterr().err  # one line, no traceback
    with pytest.raises(BlockNotFound):
        RemoteJSON.from_env(srv.url).ask("f" * 64, "q")
