"""One messages-to-segments rule (`graftmem.core.segments`) for the SDK and the server: a chat block the
SDK learns from a system prompt is, byte for byte and id for id, the first segment the server cuts from a
conversation that opens with it, and the SDK's recall prompt after it is the rest of the server's prompt,
on every tiny family (real tokenizers and templates, scripts/tiny_models.py) and on the hand-written
formats (SmolLM2's ChatML, Gemma 3's)."""

from __future__ import annotations

import pytest

from graftmem import Memory
from graftmem.core.engine import Engine
from graftmem.core.prompt import split_ids
from graftmem.core.segments import detect_format, request_template, tokenize_segments
from graftmem.memory import continuation_for
from graftmem.server.chat import render_segments, template_segments

from .tiny import tiny_path

#: Qwen 3.5 is left out on purpose: its template refuses a system message alone, so its chat blocks use
#: the hand-written ChatML cut while its requests use its template (docs/models.md says so).
FAMILIES = ("llama31", "phi35", "gemma4", "qwen25", "qwen3", "command-r")
SYSTEM = "You are the support agent of a shop. Answer in one line. " * 6
CASES = [(SYSTEM, "How do I refund order 42?"),
         ("Be brief.", "Hi"),
         ("Rules:\n1. Refunds within 30 days.\n2. Quote the ticket.", "Can I return it after 40 days?")]


def _sdk_and_server_agree(e: Engine, home) -> None:
    fmt = detect_format(e)
    assert fmt is not None
    tpl = request_template(e)
    with Memory(engine=e, home=home) as mem:
        for system, task in CASES:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": task}]
            if tpl is not None:
                texts, _, literal = template_segments(e, tpl, msgs)
            else:
                texts, literal = render_segments(fmt, msgs, engine=e), None
            ids = tokenize_segments(e, texts, literal=literal)
            block = mem.learn(system, chat=True)  # the SDK's chat block of this system prompt
            cont = continuation_for(block, task)  # and its recall prompt for the task
            assert block.text == texts[0], (getattr(e, "family", ""), system[:20])
            assert list(block.tokens) == ids[0]
            assert block.text + cont == "".join(texts)
            rest, exact = split_ids(e, block.tokens, block.text, cont)
            assert exact and [t for s in ids[1:] for t in s] == rest


@pytest.mark.parametrize("family", FAMILIES)
def test_sdk_chat_blocks_are_the_servers_first_segment(family, tmp_path):
    """A system prompt that ends with a space (``"... one line. " * 6``): Llama 3.x's template trims each
    message, and the SDK's block used to keep the space (a text the template never renders), so the
    server's first segment of the same conversation was another block."""
    with Engine(tiny_path(family), {"n_threads": 1}) as e:
        e.family = family  # type: ignore[attr-defined]
        _sdk_and_server_agree(e, tmp_path / "home")


def test_hand_written_formats_cut_alike(smol, tmp_path):
    """SmolLM2: ChatML stands in for its template (`renders_as_template`) on both paths."""
    assert request_template(smol) is None
    _sdk_and_server_agree(smol, tmp_path / "home")
