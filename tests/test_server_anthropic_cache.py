"""Anthropic ``cache_control`` breakpoints on a real server, with the official ``anthropic`` package and
a real engine: a marked prefix is stored at its first sighting (``cache_creation_input_tokens``),
read by the next request and after a restart (``cache_read_input_tokens``), the three usage parts sum to
the prompt, streamed and not, and the answer read from the cache equals the cold one. Claude Code's
billing line (``cch=`` changes on every request) does not defeat the cache.

Every assertion is usage accounting or an equality of two computations (read from the cache == cold), which
holds on any model: the engine is the tiny random-weight Llama 3.1 of tests/tiny.py (`tiny_llama`: real
tokenizer and chat template), whose prefill costs ~1/100th of SmolLM2's."""

from __future__ import annotations

import anthropic

from graftmem.server import api_server
from graftmem.store.local import Store

from .conftest import long_text

KEY = "sk-anthropic-cache-key"
GREEDY = {"temperature": 0}
COLD = {"temperature": 0, "graftmem": {"cache": False}}
MARK = {"type": "ephemeral"}


def _client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)


def _total(c: anthropic.Anthropic, **kw) -> int:
    return c.messages.count_tokens(model="smollm2", **kw).input_tokens


def _parts(u) -> int:
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_a_breakpoint_is_stored_at_first_sight_read_next_and_after_a_restart(tiny_llama, tmp_path):
    system = [{"type": "text", "text": "You answer questions about the shop. " + long_text(260, seed=11),
               "cache_control": MARK}]
    ask = [{"role": "user", "content": "What is two plus two?"}]
    other = [{"role": "user", "content": "Name a colour."}]
    home = tmp_path / "home"
    with api_server(Store(home), [tiny_llama], api_key=KEY) as srv:
        c = _client(srv)
        first = c.messages.create(model="smollm2", max_tokens=8, system=system, messages=ask, extra_body=GREEDY)
        u = first.usage
        assert u.cache_creation_input_tokens > 0 and u.cache_read_input_tokens == 0
        assert _parts(u) == _total(c, system=system, messages=ask)
        created = u.cache_creation_input_tokens
        # the same prefix with another question: read, nothing new written
        cold = c.messages.create(model="smollm2", max_tokens=8, system=system, messages=other, extra_body=COLD)
        assert cold.usage.cache_read_input_tokens == 0 and cold.usage.cache_creation_input_tokens == 0
        second = c.messages.create(model="smollm2", max_tokens=8, system=system, messages=other, extra_body=GREEDY)
        assert second.usage.cache_read_input_tokens >= created
        assert second.usage.cache_creation_input_tokens == 0
        assert _parts(second.usage) == _total(c, system=system, messages=other)
        assert second.content[0].text == cold.content[0].text  # read from the cache, the same answer
    # a new server on the same store, nothing kept in RAM: the breakpoint's block was persisted
    with api_server(Store(home), [tiny_llama], api_key=KEY, warm=False) as srv:
        c = _client(srv)
        again = c.messages.create(model="smollm2", max_tokens=8, system=system, messages=other, extra_body=GREEDY)
        assert again.usage.cache_read_input_tokens >= created
        assert again.usage.cache_creation_input_tokens == 0
        receipt = again.model_extra["graftmem"]
        assert receipt["source"] == "store" and receipt["block_id"]
        assert again.content[0].text == cold.content[0].text


def test_a_streamed_breakpoint_reports_its_usage_in_message_start_and_message_delta(tiny_llama, tmp_path):
    system = "You are the help desk of a library. " + long_text(260, seed=12)
    turn = [{"role": "user", "content": [{"type": "text", "text": "When do you open?", "cache_control": MARK}]}]
    with api_server(Store(tmp_path / "home"), [tiny_llama], api_key=KEY) as srv:
        c = _client(srv)
        total = _total(c, system=system, messages=turn)
        events = list(c.messages.create(model="smollm2", max_tokens=6, system=system, messages=turn, stream=True,
                                        extra_body=GREEDY))
        start = next(e for e in events if e.type == "message_start").message.usage
        delta = next(e for e in events if e.type == "message_delta").usage
        # the breakpoint is on the user's message: system and question are written at first sight
        assert start.cache_creation_input_tokens > 0 and start.cache_read_input_tokens == 0
        assert start.input_tokens + start.cache_creation_input_tokens == total
        assert (delta.input_tokens, delta.cache_creation_input_tokens, delta.cache_read_input_tokens) == \
            (start.input_tokens, start.cache_creation_input_tokens, start.cache_read_input_tokens)
        # the next turn continues the conversation: everything up to the marked question is read
        answer = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        nxt = turn + [{"role": "assistant", "content": answer or "."}, {"role": "user", "content": "And Sunday?"}]
        with c.messages.stream(model="smollm2", max_tokens=6, system=system, messages=nxt, extra_body=GREEDY) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert final.usage.cache_read_input_tokens >= start.cache_creation_input_tokens
        assert final.usage.cache_creation_input_tokens == 0
        assert _parts(final.usage) == _total(c, system=system, messages=nxt)
        cold = c.messages.create(model="smollm2", max_tokens=6, system=system, messages=nxt, extra_body=COLD)
        assert text == cold.content[0].text


def _billing(cch: str) -> dict:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.14.8f1; cc_entrypoint=cli; cch={cch};"}


def test_claude_codes_billing_line_does_not_defeat_the_cache(tiny_llama, tmp_path):
    prompt = {"type": "text", "text": "You are Claude Code, a coding agent. " + long_text(260, seed=13),
              "cache_control": MARK}
    ask = [{"role": "user", "content": "List the files."}]
    with api_server(Store(tmp_path / "home"), [tiny_llama], api_key=KEY) as srv:
        c = _client(srv)
        # the line is not what the model sees: the prompt counts as without it
        assert _total(c, system=[_billing("1a2b3"), prompt], messages=ask) == _total(c, system=[prompt], messages=ask)
        first = c.messages.create(model="smollm2", max_tokens=4, system=[_billing("1a2b3"), prompt], messages=ask,
                                  extra_body=GREEDY)
        assert first.usage.cache_creation_input_tokens > 0
        # the next request differs only in cch=: the stored prefix is found
        second = c.messages.create(model="smollm2", max_tokens=4, system=[_billing("9f8e7"), prompt],
                                   messages=[{"role": "user", "content": "Show the diff."}], extra_body=GREEDY)
        assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
        assert second.usage.cache_creation_input_tokens == 0


def test_a_malformed_cache_control_is_a_400(tiny_llama, tmp_path):
    with api_server(Store(tmp_path / "home"), [tiny_llama], api_key=KEY) as srv:
        c = _client(srv)
        try:
            c.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "Hi", "cache_control": {"type": "forever"}}]}])
        except anthropic.BadRequestError as exc:
            assert "cache_control" in exc.body["error"]["message"]
        else:
            raise AssertionError("a cache_control of an unknown type was accepted")
