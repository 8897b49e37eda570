"""Stop strings and streamed answers (``Memory.ask_stream`` / ``recall_stream``, ``AsyncMemory``).

The streamed answer must be the same computation as the plain one: the same text (pieces joined),
the same tokens and the same first-step logits hash; a stop string cuts the text exactly where the
unstopped answer has it; closing a stream early cancels the decode and leaves the engine usable.

All of it compares two real computations (or checks arguments), whatever the model writes: it runs on
the tiny random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`, real tokenizer), whose prefill and
decode cost ~1/100th of SmolLM2's.
"""

from __future__ import annotations

import asyncio

import pytest

from graftmem import AnswerStream, AsyncMemory, ConfigError, Memory
from graftmem.core.decoding import AnswerText

from .conftest import long_text

QUERY = "\nQuestion: what did the people in the story do? Answer in a few sentences.\nAnswer:"


@pytest.fixture
def mem(tiny_llama, tmp_path) -> Memory:
    """A Memory over the tiny Llama 3.1 and a fresh store (conftest's `tiny_mem`, under this file's name)."""
    with Memory(engine=tiny_llama, home=tmp_path / "store") as m:
        yield m


@pytest.fixture
def block(mem):
    return mem.learn(long_text(150, seed=31), name="story")


def test_stop_string_cuts_the_answer_where_the_unstopped_answer_has_it(mem, block):
    full = mem.ask(block.id, QUERY, max_tokens=40)
    words = full.text.split()
    assert len(words) >= 6, full.text
    stop = " " + words[4]  # a word in the middle, with its leading space: may span tokens
    at = full.text.find(stop)
    assert at > 0
    cut = mem.ask(block.id, QUERY, max_tokens=40, stop=[stop, "never-generated-zzz"])
    assert cut.text == full.text[:at]
    assert cut.finish_reason == "stop" and len(cut.tokens) < len(full.tokens)
    assert cut.receipt.first_logits_sha256 == full.receipt.first_logits_sha256
    assert mem.ask(block.id, QUERY, max_tokens=40, stop="never-generated-zzz").text == full.text


def test_bad_stop_strings_are_refused(mem, block):
    for bad in ([""], 5, ["ok", 3], ["x"] * 17):
        with pytest.raises(ConfigError, match="stop"):
            mem.ask(block.id, QUERY, stop=bad)


def test_ask_stream_yields_the_same_answer_in_pieces(mem, block):
    plain = mem.ask(block.id, QUERY, max_tokens=24)
    with mem.ask_stream(block.id, QUERY, max_tokens=24) as s:
        assert isinstance(s, AnswerStream)
        pieces = list(s)
    assert len(pieces) > 3 and all(pieces)
    assert "".join(pieces) == s.result.text == plain.text
    assert s.result.tokens == plain.tokens
    assert s.result.receipt.first_logits_sha256 == plain.receipt.first_logits_sha256


def test_closing_a_stream_cancels_the_decode_and_frees_the_engine(mem, block):
    plain = mem.ask(block.id, QUERY, max_tokens=48)
    s = mem.ask_stream(block.id, QUERY, max_tokens=48)
    first = next(s)
    s.close()
    r = s.result
    assert r.finish_reason == "cancelled" and first and len(r.tokens) < len(plain.tokens)
    again = mem.ask(block.id, QUERY, max_tokens=48)  # the engine is free and clean
    assert again.text == plain.text


def test_stream_errors_are_raised_at_call_or_in_the_iteration(mem, block):
    with pytest.raises(ConfigError):
        mem.ask_stream(block.id, "", max_tokens=4)  # checked before anything runs
    with pytest.raises(ConfigError):
        mem.ask_stream(block.id, QUERY, max_tokens=0)


def test_recall_stream_and_no_match(tmp_path, tiny_llama, minilm):
    with Memory(engine=tiny_llama, home=tmp_path / "r", embedder=minilm) as m:
        m.learn("Ticket codes: TK- followed by the customer number.", name="tickets",
                when_to_use="opening a support ticket", chat=True)
        plain = m.recall("Open a ticket for customer 7312.", max_tokens=12)
        with m.recall_stream("Open a ticket for customer 7312.", max_tokens=12) as s:
            text = "".join(s)
        assert plain.matched and text == plain.text == s.result.text
        assert s.result.block.id == plain.block.id
        with m.recall_stream("What is the capital of Mongolia?", max_tokens=12, min_score=0.99) as s:
            assert list(s) == []
        assert s.result.matched is False and s.result.reason


def test_async_ask_stream(tiny_llama, tmp_path):
    async def go() -> tuple[str, str]:
        async with AsyncMemory(engine=tiny_llama, home=tmp_path / "a") as am:
            b = await am.learn(long_text(80, seed=3), name="a")
            plain = await am.ask(b.id, QUERY, max_tokens=16)
            pieces = [p async for p in am.ask_stream(b.id, QUERY, max_tokens=16)]
            return "".join(pieces), plain.text

    streamed, plain = asyncio.run(go())
    assert streamed == plain and streamed


def test_answer_text_joins_bytes_and_holds_back_a_possible_stop():
    # "é" is two UTF-8 bytes split over two tokens; the stop string "END" spans three tokens
    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9 E", 4: b"N", 5: b"D!", 6: b" more"}
    t = AnswerText(pieces.__getitem__, ["END"])
    out = []
    for tok in (1, 2, 3, 4, 5, 6):
        stopped = t.add(tok)
        out.append(t.delta())
        if stopped:
            break
    assert tok == 5 and t.text == "café "
    assert "\ufffd" not in "".join(out) and "".join(out) + t.delta(final=True) == "café "
    plain = AnswerText(pieces.__getitem__)
    for tok in (1, 2, 3):
        plain.add(tok)
    assert plain.delta() == "café E" and plain.delta() == ""
