"""Long documents through one fixed window (graftmem.memory.pager): pages, passage routing, resumable builds,
one-page exact grafts, a context that never grows, and the needle bench at a small size."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graftmem import BlockNotFound, ConfigError, Memory
from graftmem.core.engine import logits_sha256
from graftmem.memory.pager import PAGE_KIND, plan_document, read_source

from .conftest import long_text

ROOT = Path(__file__).resolve().parents[1]

FACTS = [
    "The lighthouse of Brackwater was painted green by Orla Fenn in the spring.",
    "The copper mill at Dunmere grinds exactly 412 sacks of barley every week.",
    "The ferry across the Yarrow river is pulled by a grey mule named Pickwick.",
]


@pytest.fixture
def dmem(gemma, tmp_path, minilm):
    with Memory(engine=gemma, home=tmp_path / "dstore", embedder=minilm) as m:
        yield m


@pytest.fixture(scope="module")
def town(gemma, minilm, tmp_path_factory):
    """The document learned once by Gemma (window 256, overlap 32) into a home of its own, then closed:
    that home and the report of its build. The tests that need the document learned copy the home
    (`tmem`) instead of prefilling the same pages again."""
    home = tmp_path_factory.mktemp("town") / "dstore"
    with Memory(engine=gemma, home=home, embedder=minilm) as m:
        rep = m.learn_document(_document(), document="town", window=256, overlap=32, progress=False)
    return home, rep


@pytest.fixture
def tmem(town, gemma, tmp_path, minilm):
    """A Memory over a private copy of `town`'s home (free to change: a test's writes stay its own)."""
    home = tmp_path / "dstore"
    shutil.copytree(town[0], home)
    with Memory(engine=gemma, home=home, embedder=minilm) as m:
        yield m


def _document(n_words_between: int = 300) -> str:
    """Filler paragraphs with one distinctive fact in each third of the document."""
    parts = []
    for k, fact in enumerate(FACTS):
        filler = long_text(n_words_between, seed=k)
        half = len(filler) // 2
        cut = filler.index(". ", half) + 2
        parts.append(filler[:cut] + fact + " " + filler[cut:])
    return "\n\n".join(parts)


def test_plan_cuts_at_sentences_with_overlap(gemma):
    text = _document()
    plan = plan_document(gemma, text, window=256, overlap=32, document="d")
    assert len(plan.pages) >= 4
    prev = None
    for p in plan.pages:
        assert p.n_tokens <= 256
        assert p.tokens == gemma.tokenize(text[p.char_start:p.char_end])  # the page is a slice, BOS first
        assert p.text == text[p.char_start:p.char_end]
        assert p.char_start == 0 or text[p.char_start - 1] in " \n"  # starts at a sentence start
        assert p.passages and p.passages[0][0] == p.char_start
        if prev is not None:
            assert prev.char_start < p.char_start < prev.char_end  # overlapping, and moving forward
            assert prev.token_start < p.token_start
        prev = p
    assert plan.pages[-1].char_end == len(text.rstrip())
    # every character is on some page; offsets agree with tokenizing the whole prefix within a few tokens
    for fact in FACTS:
        pos = text.index(fact)
        assert plan.pages_holding(pos, pos + len(fact))
        whole = len(gemma.tokenize(text[:pos], add_special=False))
        assert abs(plan.token_offset(pos) - whole) <= len(plan.pages)
    # deterministic: the same inputs give the same pages (what makes a rerun skip stored pages)
    again = plan_document(gemma, text, window=256, overlap=32, document="d")
    assert [p.tokens for p in again.pages] == [p.tokens for p in plan.pages]


def test_plan_refuses_bad_windows(gemma):
    with pytest.raises(ConfigError, match="leaves no room"):
        plan_document(gemma, "Some text.", window=gemma.n_ctx)
    with pytest.raises(ConfigError, match="overlap"):
        plan_document(gemma, "Some text.", window=256, overlap=200)
    with pytest.raises(ConfigError, match="empty"):
        plan_document(gemma, "   ", window=256)


def test_read_source_path_text_iterable(tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text("First line.\n\nSecond.")
    assert read_source(f) == "First line.\n\nSecond."
    assert read_source(str(f)) == "First line.\n\nSecond."
    assert read_source("just a text, not a file") == "just a text, not a file"
    assert read_source(["One. ", "", " Two."]) == "One.\n\nTwo."
    with pytest.raises(ConfigError):
        read_source(["ok", 3])  # type: ignore[list-item]


def test_pages_indexed_and_routed(town, tmem):
    rep = town[1]  # the first build of the document, in the home tmem copied
    assert rep.complete and rep.pages_learned == rep.pages >= 4 and rep.pages_skipped == 0
    pages = tmem.get_all(kind=PAGE_KIND)
    assert len(pages) == rep.pages
    assert sorted(b.metadata["page"] for b in pages) == list(range(rep.pages))
    idx = tmem.pages
    assert len(idx) >= rep.pages  # several passages per page
    text = _document()
    for fact, task, want in [
        (FACTS[0], "Who painted the lighthouse of Brackwater green?", None),
        (FACTS[1], "How many sacks of barley does the copper mill at Dunmere grind each week?", "412"),
        (FACTS[2], "What is the name of the mule that pulls the Yarrow ferry?", None),
    ]:
        hits = idx.search(task, 3, fp_digest=tmem.fingerprint.digest())
        assert fact in hits[0].text
        # the filler around each fact is word salad that dilutes the passage's vector: routing is what
        # is tested here (the right passage ranks first), not the refusal threshold
        a = tmem.recall_document(task, document="town", max_tokens=4, min_score=0.0)
        block = tmem.get(a.page.block_id)
        assert fact in block.text  # the ONE grafted page holds the answer
        assert block.metadata["page"] == a.page.page and block.metadata["document"] == "town"
        assert a.page.char_start <= text.index(fact) < a.page.char_end
        assert a.page.token_start <= a.depth < a.page.token_start + a.page.n_tokens
        assert a.recall.receipt.tokens_restored == block.n_tokens
    # learning the same document again prefills nothing
    again = tmem.learn_document(_document(), document="town", window=256, overlap=32, progress=False)
    assert again.pages_learned == 0 and again.pages_skipped == rep.pages and again.tokens_prefilled == 0
    assert len(tmem.get_all(kind=PAGE_KIND)) == rep.pages
    # a page whose provenance is unverified (as if imported unchecked) is never reused: it is prefilled
    # again here and becomes this engine's own (the pager used to skip it by id)
    page0 = next(b for b in tmem.get_all(kind=PAGE_KIND) if b.metadata["page"] == 0)
    tmem.store.set_provenance(page0.id, "unverified")
    third = tmem.learn_document(_document(), document="town", window=256, overlap=32, progress=False)
    assert third.pages_learned == 1 and third.pages_skipped == rep.pages - 1
    assert tmem.get(page0.id).provenance == "local"


def test_same_document_under_two_engines(tmem, tiny_llama, minilm):
    """One text learned by Gemma (`town`) and then by a second engine (the tiny Llama 3.1: another
    fingerprint and tokenizer) in the same store (same document id, other pages and block ids): each
    engine routes to its own page, and the first engine's index is untouched."""
    text = _document()
    task = "How many sacks of barley does the copper mill at Dunmere grind each week?"
    before = tmem.recall_document(task, document="town", max_tokens=4, min_score=0.0)
    with Memory(engine=tiny_llama, home=tmem.store.home, embedder=minilm) as other:
        rep = other.learn_document(text, document="town", window=200, overlap=16, progress=False)
        assert rep.complete and rep.passages_embedded > 0  # its own pages get their own passages
        assert rep.pages_learned == rep.pages and rep.pages_skipped == 0  # none of Gemma's pages reused
        a = other.recall_document(task, document="town", max_tokens=4, min_score=0.0)
        assert FACTS[1] in other.get(a.page.block_id).text
        fp = other.get(a.page.block_id).fingerprint
        assert fp.digest() == tiny_llama.fingerprint.digest() != tmem.engine.fingerprint.digest()
        assert fp.model_name == tiny_llama.fingerprint.model_name != tmem.engine.fingerprint.model_name
    after = tmem.recall_document(task, document="town", max_tokens=4, min_score=0.0)
    assert after.page == before.page and FACTS[1] in tmem.get(after.page.block_id).text


def test_page_index_migrates_passages_keyed_by_page(tmp_path, minilm):
    """A page index written before passages were keyed by block (schema version 0) is rebuilt on open:
    same rows and rowids, the new key, version 1; a second open changes nothing."""
    from graftmem.memory.pager import PageIndex

    path = tmp_path / "pages" / "index.sqlite"
    path.parent.mkdir()
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE passages (
            rowid INTEGER PRIMARY KEY, block_id TEXT NOT NULL, document TEXT NOT NULL, page INTEGER NOT NULL,
            idx INTEGER NOT NULL, char_start INTEGER NOT NULL, char_end INTEGER NOT NULL,
            token_start INTEGER NOT NULL, text TEXT NOT NULL, embedder TEXT NOT NULL, vec BLOB NOT NULL,
            UNIQUE (document, page, idx, embedder));
        INSERT INTO passages VALUES (7, 'b1', 'doc', 0, 0, 0, 10, 0, 'first', 'e', x'00');
        INSERT INTO passages VALUES (9, 'b1', 'doc', 0, 1, 10, 20, 3, 'second', 'e', x'01');
    """)
    db.commit()
    db.close()
    PageIndex(tmp_path, minilm).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 1
    assert "UNIQUE (block_id, idx, embedder)" in db.execute(
        "SELECT sql FROM sqlite_master WHERE name='passages'").fetchone()[0]
    assert db.execute("SELECT rowid, text FROM passages ORDER BY rowid").fetchall() == [(7, "first"), (9, "second")]
    # the same (document, page, idx) under another page block is now a row of its own
    db.execute("INSERT INTO passages VALUES (10, 'b2', 'doc', 0, 0, 0, 12, 0, 'other plan', 'e', x'02')")
    db.commit()
    db.close()
    PageIndex(tmp_path, minilm).close()
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM passages").fetchone()[0] == 3


def test_recall_document_without_pages_is_a_clear_error(dmem):
    with pytest.raises(BlockNotFound, match="learn_document"):
        dmem.recall_document("anything at all?")


def test_page_graft_is_byte_exact(tmem):
    prompt = "\n\nQuestion: How many sacks does the mill grind?\nAnswer:"
    eng = tmem.engine
    for block in tmem.get_all(kind=PAGE_KIND)[:2]:
        graft = tmem.ask(block.id, prompt, max_tokens=1).receipt.first_logits_sha256
        with eng.lock:
            eng.reset()
            eng.prefill(list(block.tokens))  # the contract: prefill(page); prefill(question)
            eng.prefill(eng.tokenize(prompt, add_special=False))
            fresh = logits_sha256(eng.logits())
            eng.reset()
        assert graft == fresh


def test_context_never_grows(town, tmem, monkeypatch):
    eng = tmem.engine
    n_ctx = eng.n_ctx
    rep = town[1]
    seen = []
    real = type(eng).prefill

    def spy(self, tokens, progress=None):
        real(self, tokens, progress)
        seen.append(self.n_past)

    monkeypatch.setattr(type(eng), "prefill", spy)
    max_tokens = 6
    for task in ("Who painted the lighthouse of Brackwater green?", "What is the mule that pulls the ferry called?",
                 "How many sacks of barley does the copper mill grind?"):
        a = tmem.recall_document(task, max_tokens=max_tokens, min_score=0.0)
        r = a.recall.receipt
        assert max(seen) <= r.tokens_restored + r.tokens_prefilled + max_tokens
        assert r.tokens_restored <= 256
        seen.clear()
    assert eng.n_ctx == n_ctx and eng.fingerprint.n_ctx == n_ctx
    assert eng.n_past == 0  # nothing stays resident after a recall
    assert rep.pages >= 4


_BUILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from graftmem import Memory
    from tests.test_needle import _document
    with Memory({model!r}, home={home!r}, config={{"n_threads": 1}}) as m:
        index = m.pages  # the page index; its embedder loads on the first passages it embeds
        add_page = index.add_page

        def pausing(*args, **kw):  # page 0 is prefilled, its block written and committed, its passages not yet
            print("PAGE0", flush=True)
            sys.stdin.read()  # blocks until the parent kills this process (kill -9)
            return add_page(*args, **kw)

        index.add_page = pausing
        m.learn_document(_document(), document="town", window=256, overlap=32, progress=False)
    print("DONE")
""")


def test_resume_after_a_killed_build(tiny_llama, minilm, tmp_path):
    """kill -9 a build after its first page, rerun: every page present, none stored twice.

    Store and page-index plumbing, so on the tiny Llama 3.1 (the parent's engine is the fixture's, the
    child loads the same GGUF with the same configuration: one fingerprint). The child says when its
    first page's block (page 0) is stored and waits there, before that page's passages are indexed, to be
    killed (where a kill used to land while the child loaded MiniLM for them): on every run, whatever the
    speed of the model or of the machine. The rerun prefills none of page 0 and indexes its passages."""
    from tests.tiny import tiny_path

    home = tmp_path / "dstore"
    script = _BUILD.format(root=str(ROOT), home=str(home), model=str(tiny_path("llama31")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    opened = Memory(engine=tiny_llama, home=home, embedder=minilm)  # the home is open here while the child writes
    err = tmp_path / "child.stderr"  # a file, not a pipe: a child that logs a lot never blocks on it
    with open(err, "wb") as err_f:
        proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err_f)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 300)  # a deadline, not an ordering: a hung child fails
        line = proc.stdout.readline() if ready else b""  # the child stored page 0 (or exited: b"")
        alive = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
        opened.close()
    assert line.strip() == b"PAGE0" and alive, (line, err.read_text(errors="replace")[-2000:])
    killed_with = len(list((home / "blocks").glob("*/*.gmb")))
    assert killed_with >= 1
    # pages whose index row was committed before the kill; a file the kill left without its row is
    # adopted as unverified on the next open (nothing vouches for it) and prefilled again, not reused
    idx = sqlite3.connect(home / "index.sqlite")
    committed = idx.execute("SELECT count(*) FROM blocks WHERE kind = 'page'").fetchone()[0]
    idx.close()
    assert committed == killed_with == 1  # page 0's block written and committed, no more
    db = sqlite3.connect(home / "pages" / "index.sqlite")
    complete = db.execute("SELECT complete FROM documents").fetchall()
    assert complete in ([], [(0,)])  # the killed build did not claim to be done
    assert db.execute("SELECT COUNT(*) FROM passages").fetchone()[0] == 0  # killed before page 0's passages

    # `opened` opened the home before the child wrote; a new Memory reconciles with the files
    with Memory(engine=tiny_llama, home=home, embedder=minilm) as m2:
        rep = m2.learn_document(_document(), document="town", window=256, overlap=32, progress=False)
        assert rep.complete
        assert rep.pages_skipped >= committed and rep.pages_learned == rep.pages - rep.pages_skipped
        assert rep.pages_skipped <= killed_with
        assert rep.tokens_prefilled == sum(b.n_tokens for b in m2.get_all(kind=PAGE_KIND)
                                           if b.metadata["page"] != 0)  # page 0 reused, not prefilled
        blocks = m2.get_all(kind=PAGE_KIND)
        assert len(blocks) == rep.pages == len({b.id for b in blocks})
        assert sorted(b.metadata["page"] for b in blocks) == list(range(rep.pages))
        n_pass = db.execute("SELECT COUNT(*), COUNT(DISTINCT document || ':' || page || ':' || idx) FROM passages").fetchone()
        assert n_pass[0] == n_pass[1] > 0  # no passage twice
        assert db.execute("SELECT COUNT(DISTINCT page) FROM passages").fetchone()[0] == rep.pages
        assert db.execute("SELECT pages_done, complete FROM documents").fetchall() == [(rep.pages, 1)]
        a = m2.recall_document("How many sacks of barley does the copper mill at Dunmere grind?", max_tokens=3,
                               min_score=0.0)
        assert FACTS[1] in m2.get(a.page.block_id).text
    db.close()


@pytest.mark.slow
def test_needle_bench_small(tmp_path, monkeypatch):
    """bench/needle.py end to end at a small size: 7 needles over 1,500 tokens in 512-token pages (4 pages; a question after a full page runs past Gemma's 512-token sliding window), one
    restore timing per question and one thread (the worker is pinned to one core: a second thread
    would only wait on it). The bench's main() runs in this process (its build, then the question
    child: a new process, as in every run of the bench), so sentence_transformers is not imported
    twice more."""
    from bench import needle

    out = tmp_path / "needle.json"
    monkeypatch.chdir(ROOT)  # the child runs `python -m bench.needle` from the working directory
    monkeypatch.setattr(sys, "argv", ["bench/needle.py", "--tokens", "1500", "--window", "512", "--overlap", "32",
                                      "--reps", "1", "--threads", "1", "--store", str(tmp_path / "store"),
                                      "--out", str(out)])
    needle.main()  # asking failed: SystemExit with the child's stderr on this process's stderr
    d = json.loads(out.read_text())
    a = d["ask"]
    assert a["asked"] == 7 and a["found"] == 7
    assert all(q["routed_to_needle_page"] for q in a["questions"])
    assert all(q["tokens_restored"] <= 512 and q["n_past_peak"] <= a["n_ctx"] for q in a["questions"])
    assert a["negative_controls"] and not any(n["code_produced"] for n in a["negative_controls"])
    assert a["exactness"]["equal"]
    assert a["pages_stored"] == a["pages_in_document"]


def test_cli_learn_and_recall_document(tmp_path, capsys):
    """The CLI's learn-document and recall-document verbs (plumbing around the pager: any model does, so
    the tiny Llama 3.1 of tests/tiny.py, given to --model as a GGUF path)."""
    from graftmem.cli import main as cli_main

    from tests.tiny import tiny_path

    doc = tmp_path / "town.txt"
    doc.write_text(_document())
    base = ["--home", str(tmp_path / "cli"), "--model", str(tiny_path("llama31")),
            "--config", '{"n_ctx": 1024, "probe": false}']
    assert cli_main(base + ["learn-document", str(doc), "--document", "town", "--window", "256", "--overlap", "32"]) == 0
    out = capsys.readouterr().out
    assert "document town:" in out and "already stored" in out
    assert cli_main(base + ["--json", "recall-document", "How many sacks of barley does the copper mill at Dunmere grind?",
                            "--max-tokens", "3", "--min-score", "0"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["page"]["document"] == "town" and "412" in d["passage"]["text"]


def test_passage_routing_in_real_prose_needs_the_lexical_score(gemma, tmp_path, minilm):
    """Needles in real prose (the docstrings of installed stdlib modules; bench/routing_heldout.py's
    tuning set): the hybrid passage score routes every question to the page holding its answer; the
    cosine alone (lex_weight=0, the index as it was) sends "Who keeps the spare key to the archive
    room?" to shutil's archive functions. Routing only: pages are planned and indexed, not prefilled."""
    from graftmem.memory.pager import PageIndex

    from bench.routing_heldout import DOC_NEEDLES_TUNE, docstring_document, insert_needles

    text, needles = insert_needles(docstring_document(DOC_NEEDLES_TUNE["modules"]), DOC_NEEDLES_TUNE["needles"])
    plan = plan_document(gemma, text, window=1024, overlap=64, document="stdlib")
    assert len(plan.pages) >= 5
    hybrid = PageIndex(tmp_path, minilm)
    hybrid.start_document(plan, "fp")
    for page in plan.pages:
        hybrid.add_page(plan, page, f"block{page.page}", "fp", embed=True)
    dense = PageIndex(tmp_path, minilm, lex_weight=0.0)  # same SQLite rows and vectors, cosine only
    routed = {}
    for name, index in (("hybrid", hybrid), ("dense", dense)):
        routed[name] = [index.search(nd["question"], 1, fp_digest="fp")[0].page.page
                        in plan.pages_holding(nd["char_start"], nd["char_end"]) for nd in needles]
    assert all(routed["hybrid"]), routed
    assert routed["dense"][0] is False, routed  # the spare-key needle: diluted in its passage's vector
    hybrid.close()
    dense.close()
