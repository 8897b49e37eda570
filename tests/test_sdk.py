"""The verbs agent developers know (mem0's): add(messages), search(limit=, filters=), get_all(user_id=),
history, reset; scoped memory; honest results (a refused recall is not an answer).

Scopes, filters, search, history and refusals are bookkeeping around the engine: they run on the tiny
random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`, real tokenizer and chat template), whose
prefills cost ~1/100th of SmolLM2's. `add` stays on SmolLM2: its point is that the block is the text
in SmolLM2's own ChatML, turn by turn, and that the hand-written format refuses malformed turns."""

from __future__ import annotations

import pytest

from graftmem import ConfigError, Memory
from graftmem.core.prompt import CHATML

from .tiny import tiny_path

TEA = [{"role": "user", "content": "I like green tea, no sugar."},
       {"role": "assistant", "content": "Noted: green tea, no sugar."}]


@pytest.fixture
def mem(tiny_llama, tmp_path, minilm):
    """The tiny Llama 3.1 and the session's MiniLM (loaded once), over a fresh store."""
    with Memory(engine=tiny_llama, home=tmp_path / "store", embedder=minilm) as m:
        yield m


@pytest.fixture
def smol_mem(smol, tmp_path, minilm):
    with Memory(engine=smol, home=tmp_path / "smol-store", embedder=minilm) as m:
        yield m


REFUNDS = ("Refunds: ask for the order number (NW-12345), check the purchase is under 30 days old, then "
           "answer REFUND APPROVED with ticket code RF-<order digits>.")


def test_add_takes_chat_messages_and_recall_continues_the_conversation(smol_mem):
    mem = smol_mem
    b = mem.add(TEA, user_id="alice")
    assert b.text == CHATML.render(TEA)  # the model's own template, turn by turn
    assert b.metadata["chat_format"] == "chatml" and b.name.startswith("I like green tea")
    r = mem.ask(b.id, CHATML.continuation("What do I drink?"), max_tokens=8)
    assert r.receipt.tokens_restored == b.n_tokens and r.receipt.exact


@pytest.mark.parametrize("bad", [[], [{"role": "user"}], [{"role": "pirate", "content": "arr"}], b"bytes"])
def test_add_refuses_malformed_messages(smol_mem, mem, bad):
    """On SmolLM2's hand-written ChatML and on a model's own Jinja template (the tiny Llama 3.1's: it
    rendered a role-less message as a KeyError and an unknown role as text, until the check came first)."""
    for m in (smol_mem, mem):
        with pytest.raises(ConfigError):
            m.add(bad)
        assert m.get_all() == []


def test_scopes_share_one_block_and_filter_get_all(mem):
    a = mem.learn(REFUNDS, name="refunds", user_id="alice")
    b = mem.learn(REFUNDS, name="refunds", user_id="bob", session_id="s1")
    assert a.id == b.id and len(mem.get_all()) == 1  # one prefill, two owners
    c = mem.learn("Shipping goes to extension 4410.", name="shipping", user_id="bob", metadata={"team": "ops"})
    assert {x.id for x in mem.get_all(user_id="alice")} == {a.id}
    assert {x.id for x in mem.get_all(user_id="bob")} == {a.id, c.id}
    assert {x.id for x in mem.get_all(user_id="bob", session_id="s1")} == {a.id}
    assert mem.get_all(user_id="carol") == []
    assert [x.id for x in mem.get_all(filters={"team": "ops"})] == [c.id]
    assert [s.user_id for s in mem.scopes.owners(a.id)] == ["alice", "bob"]


def test_search_limit_filters_and_scope(mem):
    refunds = mem.learn(REFUNDS, name="refunds", when_to_use="refund requests", user_id="alice",
                        metadata={"team": "support"})
    dates = mem.learn("Write every date as YYYY-MM-DD.", name="dates", when_to_use="date formats",
                      user_id="bob", metadata={"team": "docs"})
    task = "A customer wants their money back for order NW-20417."
    assert [h.block_id for h in mem.search(task, limit=2)][:1] == [refunds.id]
    assert len(mem.search(task, limit=1)) == 1
    assert [h.block_id for h in mem.search(task, user_id="bob")] == [dates.id]  # alice's block is not bob's
    assert [h.block_id for h in mem.search(task, filters={"team": "docs"})] == [dates.id]
    with pytest.raises(ConfigError, match="limit=0 is out of range"):
        mem.search(task, limit=0)
    with pytest.raises(ConfigError, match="filters"):
        mem.search(task, filters=["team"])  # type: ignore[arg-type]


def test_recall_in_a_scope_never_grafts_another_users_block(mem):
    mem.learn(REFUNDS, name="refunds", when_to_use="refund requests", chat=True, user_id="alice")
    r = mem.recall("A customer wants a refund for order NW-20417.", user_id="bob", max_tokens=4)
    assert not r.matched and r.block is None and r.text == "" and r.receipt.tokens_restored == 0
    ok = mem.recall("A customer wants a refund for order NW-20417.", user_id="alice", max_tokens=4)
    assert ok.matched and ok.block is not None and ok.receipt.tokens_restored == ok.block.n_tokens


def test_refused_recall_is_empty_and_says_why_naming_other_engines(mem, tmp_path):
    mem.learn(REFUNDS, name="refunds", when_to_use="refund requests", chat=True)
    r = mem.recall("What is the capital of Mongolia?", max_tokens=4)
    assert not r.matched and r.text == "" and r.tokens == [] and "below min_score" in r.reason
    # the same store opened with another n_ctx: its blocks are invisible, and the reason says why
    from graftmem import Engine

    with Engine(tiny_path("llama31"), {"n_ctx": 1024, "n_threads": 1, "probe": False}) as other, \
            Memory(engine=other, home=mem.store.home, embedder=mem.embedder) as m2:
        r2 = m2.recall("A customer wants a refund.", max_tokens=4)
        assert not r2.matched and "another engine configuration" in r2.reason and "n_ctx" in r2.reason


def test_history_and_reset(mem):
    b = mem.learn(REFUNDS, name="refunds", user_id="alice")
    mem.learn(REFUNDS, name="refunds", user_id="bob")
    mem.verify(b.id, samples=2, cross_process=False)
    other = mem.learn("Shipping goes to extension 4410.", name="shipping")
    events = [e.event for e in mem.history(b.id)]
    assert events == ["learned", "learned_again", "verified"]
    assert mem.history(b.id)[0].details["user_id"] == "alice"
    gone = mem.reset()
    assert sorted(gone) == sorted([b.id, other.id]) and mem.get_all() == []
    assert mem.get_all(user_id="alice") == []
    assert mem.history(b.id)[-1].event == "deleted"  # the log outlives the block
