"""recall: the prompt seam (block = chat prefix, task = continuation) and graft == text, byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graftmem import ConfigError, Memory
from graftmem.core.prompt import CHATML, GEMMA, split_ids
from graftmem.core.segments import detect_format
from graftmem.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]

MANUAL = ("Ticket codes. When asked to open a ticket, reply with only the ticket code: the letters TK, "
          "a dash, and the customer's number. Example: customer 4821 gets TK-4821.")

#: the same rule in fewer words, for the tests that compare the graft way with the text way per task: the
#: text way re-prefills the whole block for every task, and the seam they test is the block's end (its chat
#: turn's closing markers) and the task's start, whatever the manual says (19 tokens as a SmolLM2 chat
#: block instead of MANUAL's 54)
SHORT_MANUAL = "Ticket codes: reply TK- and the customer's number."

#: tasks whose edges are hard for a tokenizer seam: spaces, tabs, newlines, special-token text,
#: punctuation that would merge with a preceding "." and non-ASCII
TRICKY = [
    "Open a ticket for customer 7312.",
    " Open a ticket for customer 7312 (leading space).",
    "\n\nOpen a ticket for customer 7312, after two newlines.",
    "\t  Open a ticket for customer 7312 after a tab",
    "...open a ticket for customer 7312",
    "Open a ticket for customer 7312 <|im_end|>\n<|im_start|>assistant\nTK-",
    "Open a ticket for customer 7312 <start_of_turn>model\n<end_of_turn>",
    "Öffne ein Ticket für Kunde 7312 🙂",
    "Open a ticket for customer 7312\n",
]


@pytest.fixture
def cmem(smol, tmp_path, minilm):
    with Memory(engine=smol, home=tmp_path / "cstore", embedder=minilm) as m:
        yield m


@pytest.mark.parametrize("engine_name, fmt", [("smol", CHATML), ("gemma", GEMMA)])
def test_seam_tokenizes_like_the_whole_prompt(request, engine_name, fmt):
    eng = request.getfixturevalue(engine_name)
    assert detect_format(eng) is fmt
    for manual in (MANUAL, MANUAL + "\n", MANUAL + " ", "x"):
        prefix = fmt.prefix(manual)
        ptok = eng.tokenize(prefix)
        assert fmt.body(prefix) == manual
        for task in TRICKY + [" ", ""]:
            ids, clean = split_ids(eng, ptok, prefix, fmt.continuation(task))
            assert clean, (engine_name, manual, task)
            assert ptok + ids == eng.tokenize(prefix + fmt.continuation(task))


def test_split_ids_detects_a_merging_seam(smol):
    ptok = smol.tokenize("Manual.")
    assert split_ids(smol, ptok, "Manual.", " Next")[1]
    assert not split_ids(smol, ptok, "Manual.", "..")[1]  # "." + ".." tokenizes as one "..." piece


def test_graft_and_text_give_identical_answers(cmem):
    b = cmem.learn(SHORT_MANUAL, name="tickets", when_to_use="opening a support ticket", chat=True)
    assert b.text == CHATML.prefix(SHORT_MANUAL) and b.metadata["chat_format"] == "chatml"
    for task in TRICKY:
        g = cmem.recall(task, max_tokens=6, min_score=-1.0)
        t = cmem.recall(task, max_tokens=6, min_score=-1.0, mode="text")
        assert g.block.id == t.block.id == b.id
        assert g.receipt.first_logits_sha256 == t.receipt.first_logits_sha256, task
        assert g.tokens == t.tokens and g.text == t.text, task
        assert g.receipt.exact and t.receipt.exact
        cont = smol_ids = cmem.engine.tokenize(CHATML.continuation(task), add_special=False)
        assert g.receipt.tokens_restored == b.n_tokens and g.receipt.tokens_prefilled == len(cont)
        assert t.receipt.tokens_restored == 0 and t.receipt.tokens_prefilled == b.n_tokens + len(smol_ids)
        assert g.score == t.score and g.runner_up is None


def test_graft_and_text_identical_on_gemma(gemma, tmp_path, minilm):
    with Memory(engine=gemma, home=tmp_path / "g", embedder=minilm) as m:
        b = m.learn(SHORT_MANUAL, name="tickets", when_to_use="opening a support ticket", chat=True)
        assert b.text == GEMMA.prefix(SHORT_MANUAL)
        for task in (TRICKY[0], TRICKY[2], TRICKY[6]):
            g = m.recall(task, max_tokens=8, min_score=-1.0)
            t = m.recall(task, max_tokens=8, min_score=-1.0, mode="text")
            assert g.receipt.first_logits_sha256 == t.receipt.first_logits_sha256 and g.text == t.text


def test_recall_reports_score_runner_up_and_receipt(cmem):
    a = cmem.learn(MANUAL, name="tickets", when_to_use="opening a support ticket", chat=True)
    b = cmem.learn("Date format: always write dates as YYYY-MM-DD.", name="dates",
                   when_to_use="formatting a calendar date", chat=True)
    r = cmem.recall("Open a ticket for customer 7312.", max_tokens=10)
    assert r.block.id == a.id and r.runner_up == b.id
    assert 0.3 <= r.score <= 1.0 and r.runner_up_score < r.score
    hits = cmem.search("Open a ticket for customer 7312.", top_k=2)
    assert (hits[0].block_id, hits[1].block_id) == (a.id, b.id)
    assert r.score == pytest.approx(hits[0].score) and r.runner_up_score == pytest.approx(hits[1].score)
    assert r.receipt.block_id == a.id and r.receipt.decode_tokens == len(r.tokens) <= 10
    assert len(r.receipt.first_logits_sha256) == 64
    # the routing step is timed in the receipt (embedding + search), and so is a refused recall's
    assert r.receipt.route_ms is not None and 0 < r.receipt.route_ms < 60_000
    refused = cmem.recall("What is the capital of Mongolia?", max_tokens=2, min_score=0.99)
    assert refused.block is None and refused.receipt.route_ms is not None and refused.receipt.route_ms > 0


def test_raw_block_with_merging_seam_is_not_called_exact(cmem):
    raw = cmem.learn("Ticket codes are TK followed by the number.", name="raw",
                     when_to_use="ticket codes")
    assert "chat_format" not in raw.metadata and raw.text.startswith("Ticket")
    ok = cmem.recall(" Which code for customer 12?", max_tokens=3, min_score=-1.0)
    assert ok.block.id == raw.id and ok.receipt.exact
    bad = cmem.recall("..which ticket code?", max_tokens=3, min_score=-1.0)
    assert bad.block.id == raw.id and bad.receipt.exact is False


def test_chat_learn_names_and_errors(cmem):
    b = cmem.learn("Backups: run tar -czf backup.tar.gz DIR.", chat=True)
    assert b.name == "Backups: run tar -czf backup.tar.gz DIR."  # from the manual, not the template
    with pytest.raises(ConfigError):
        cmem.learn("x", when_to_use="   ")
    assert cmem.learn("Backups: run tar -czf backup.tar.gz DIR.").id != b.id  # raw text: another block


def test_learn_and_ask_never_load_the_router(tmp_path):
    script = textwrap.dedent("""
        import sys
        from graftmem import Memory, EngineConfig
        with Memory("smollm2", home=sys.argv[1], config=EngineConfig(probe=False)) as m:
            b = m.learn("Refunds need the order number.", when_to_use="refunds", chat=True)
            m.ask(b.id, "<|im_start|>user\\nhi<|im_end|>\\n", max_tokens=2)
            m.delete(b.id)
        heavy = [n for n in ("torch", "faiss", "sentence_transformers", "transformers") if n in sys.modules]
        print("HEAVY", heavy)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "s")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout


def test_cli_learn_search_recall_reindex(tmp_path, capsys):
    manual = tmp_path / "tickets.txt"
    manual.write_text(MANUAL)
    home = str(tmp_path / "cli")
    fast = ["--home", home, "--config", '{"probe": false}']  # each command loads the model; skip the probe
    assert cli_main([*fast, "learn", str(manual), "--chat", "--when-to-use", "opening a ticket"]) == 0
    assert cli_main([*fast, "--json", "search", "open a ticket for 7312"]) == 0
    out = capsys.readouterr().out
    assert '"name": "tickets"' in out and '"score"' in out
    assert cli_main([*fast, "recall", "Open a ticket for customer 7312.", "--max-tokens", "8"]) == 0
    assert "routed to 'tickets'" in capsys.readouterr().out
    assert cli_main([*fast, "recall", "What is the capital of Mongolia?"]) == 1
    assert "nothing grafted" in capsys.readouterr().out
    assert cli_main([*fast, "reindex"]) == 0
    assert "reindexed 1 blocks" in capsys.readouterr().out


def test_chained_block_graft_equals_text_way(cmem):
    from graftmem.memory.recall import answer_graft_way, answer_text_way

    root = cmem.learn("You are the support desk of Northwind. Answer in one line.\n", name="desk")
    child = cmem.learn("Tickets: reply with TK- and the customer's number.\n", name="tickets",
                       parent=root.id, when_to_use="opening a ticket")
    assert child.parent == root.id and child.pos_start == root.n_tokens
    for task in ("Customer 7312 needs a ticket. Code:", " leading space", "\nnewline first"):
        g = answer_graft_way(cmem.engine, cmem.store, child, task, max_tokens=6)
        t = answer_text_way(cmem.engine, cmem.store, child, task, max_tokens=6)
        assert g.receipt.first_logits_sha256 == t.receipt.first_logits_sha256 and g.tokens == t.tokens
        assert t.receipt.tokens_prefilled == root.n_tokens + child.n_tokens + g.receipt.tokens_prefilled
        assert g.receipt.exact == t.receipt.exact
