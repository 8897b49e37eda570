"""Tool calls per family, parsed from canned answers taken from the templates' own rendering of an
assistant's tool call (what the family was tuned to write), and reasoning split off; no engine."""

from __future__ import annotations

import json

import pytest

from graftmem.core import toolcalls as tc
from graftmem.core.template import ChatTemplate

from .tiny import template_path

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city"},  # Command R+ needs descriptions
        "days": {"type": "integer", "description": "How many days"}}}}}]
ARGS = {"city": "Paris", "days": 3}
#: Mistral's templates refuse any id but 9 letters and digits
CALL = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
ENDS = ("<|eot_id|>", "<|im_end|>", "</s>", "<|end|>", "<turn|>", "<｜end▁of▁sentence｜>", "<|endoftext|>",
        "<end_of_turn>", "<|return|>", "<|tool_response>", "<|END_OF_TURN_TOKEN|>", "<|message_sep|>",
        "<end_of_sentence>", "<|role_end|>", "</assistant>", "[e~[", "<|eot|>", "<|eom_id|>")
CASES = [("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("Qwen-Qwen3-0.6B", "hermes"),
         ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes"),
         ("Qwen3-Coder", "qwen-xml"), ("Qwen3.5-4B", "qwen-xml"),
         ("meta-llama-Llama-3.1-8B-Instruct", "llama3"), ("meta-llama-Llama-3.3-70B-Instruct", "llama3"),
         ("Mistral-Small-3.2-24B-Instruct-2506", "mistral"), ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
         ("openai-gpt-oss-120b", "harmony"), ("deepseek-ai-DeepSeek-V3.1", "deepseek"),
         ("google-gemma-4-31B-it", "gemma4"),
         ("GLM-4.6", "glm"), ("inclusionai-ling-3.0-flash", "glm"), ("tencent-Hy3", "glm"),
         ("MiniMax-M2", "invoke-xml"), ("deepseek-ai-DeepSeek-V3.2", "invoke-xml"), ("muse-glimmer", "invoke-xml"),
         ("Kimi-K2-Instruct", "kimi"), ("upstage-Solar-Open-100B", "solar"), ("openbmb-MiniCPM5-1B", "minicpm"),
         ("Cohere2MoE", "cohere"), ("CohereForAI-c4ai-command-r-plus-tool_use", "command-r"),
         ("Apertus-8B-Instruct", "apertus"), ("NVIDIA-Nemotron-Nano-v2", "nemotron"),
         ("unsloth-Apriel-1.5", "tool-calls-json"), ("MiniMax-M1", "tool-calls-json"),
         ("GigaChat3-10B-A1.8B", "gigachat"), ("GigaChat3.1-10B-A1.8B", "gigachat31"),
         ("meetkai-functionary-medium-v3.1", "qwen-xml")]


def canned_call(name: str) -> tuple[ChatTemplate, str]:
    """The text a model of this family writes for a call: the template's render of an assistant turn
    with ``tool_calls``, minus the prompt before it and the end-of-turn markers after it."""
    tpl = ChatTemplate(template_path(name).read_text(), name=name, bos_token="<s>", eos_token="</s>")
    user = [{"role": "user", "content": "Weather in Paris?"}]
    head = tpl.render(user, add_generation_prompt=True, tools=TOOLS)
    full = tpl.render(user + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], tools=TOOLS)
    k = next((i for i, (a, b) in enumerate(zip(head, full)) if a != b), min(len(head), len(full)))
    while k and full[k - 1] not in "\n>]":  # a marker split by the comparison ("<think>" vs "<tool_call>")
        k -= 1
    out, changed = full[k:], True
    while changed:
        out, changed = out.rstrip(), False
        for e in ENDS:
            if out.endswith(e):
                out, changed = out[:-len(e)], True
    return tpl, out


@pytest.mark.parametrize("name,family", CASES)
def test_call_rendered_by_the_template_parses_back(name, family):
    tpl, out = canned_call(name)
    fmt = tc.tool_format(tpl.source)
    assert fmt.name == family
    p = tc.parse(out, fmt, ["get_weather"])
    assert [c["function"]["name"] for c in p.calls] == ["get_weather"], out
    assert json.loads(p.calls[0]["function"]["arguments"]) == ARGS
    # the call left the content (what remains are the template's own end markers, if any)
    assert "Paris" not in (p.content or "")
    # a tool the request did not offer: the text stays text
    assert tc.parse(out, fmt, ["other"]).calls == []


def test_mistral_ids_are_nine_alphanumerics():
    _, out = canned_call("mistralai-Mistral-Nemo-Instruct-2407")
    cid = tc.parse(out, tc.FORMATS["mistral"]).calls[0]["id"]
    assert len(cid) == 9 and cid.isalnum()
    assert tc.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tc.FORMATS["hermes"]).calls[0]["id"].startswith("call_")


def test_reasoning_is_split_off():
    from graftmem.core.answers import AnswerSpec, split_answer

    think = ("<think>", "</think>")
    p = split_answer("<think>sum the digits</think>\n\nIt is 4.", AnswerSpec(think=think))
    assert (p.reasoning, p.content) == ("sum the digits", "It is 4.")
    # the template opened the think block: the answer starts inside it
    assert split_answer("first 2, then 2\n</think>\nFour.", AnswerSpec(think=think, think_open=True)).reasoning == \
        "first 2, then 2"
    assert split_answer("<think>x</think>y", AnswerSpec(think=think, reasoning=False)).content == "<think>x</think>y"
    h = tc.parse("<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>Four.",
                 tc.FORMATS["harmony"])
    assert (h.reasoning, h.content, h.calls) == ("think hard", "Four.", [])


def test_malformed_calls_stay_text():
    for fam, text in [("hermes", "<tool_call>{not json}</tool_call>"), ("llama3", '{"name": "get_weather", "parameters"'),
                      ("mistral", "[TOOL_CALLS][{oops"), ("gemma4", "<|tool_call>call:get_weather{city:")]:
        p = tc.parse(text, tc.FORMATS[fam], ["get_weather"])
        assert p.calls == [] and p.content == text.strip(), fam
    # plain prose that happens to start with a brace is not a Llama call
    assert tc.parse('{"a": 1} is JSON', tc.FORMATS["llama3"]).calls == []


def _streamed(spec, pieces) -> tuple[str, str, list]:
    from graftmem.core.answers import AnswerParser

    p = AnswerParser(spec)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    return ("".join(e.text for e in events if e.kind == "reasoning"), "".join(e.text for e in events if e.kind == "content"),
            [e.call for e in events if e.kind == "call"])


def test_stream_holds_back_by_family():
    """Hermes streams prose and holds from <tool_call>; Llama 3 holds an answer that opens with a brace
    and streams one that does not; Mistral streams the text before its [TOOL_CALLS] (Devstral's text
    before a call was lost from the stream)."""
    from graftmem.core.answers import AnswerParser, AnswerSpec

    s = AnswerParser(AnswerSpec(tc.FORMATS["hermes"], frozenset({"f"})))
    assert [e.text for p in ("Sure. ", "<tool", "_call>{") for e in s.feed(p)] == ["Sure."]
    s = AnswerParser(AnswerSpec(tc.FORMATS["llama3"], frozenset({"f"})))
    assert s.feed(" ") + s.feed('{"name"') == []
    assert _streamed(AnswerSpec(tc.FORMATS["llama3"], frozenset({"f"})), ["", "It is", " 4."])[1] == "It is 4."
    spec = AnswerSpec(tc.FORMATS["mistral"], frozenset({"f"}))
    s = AnswerParser(spec)
    assert [e.text for e in s.feed("It is 4.[TOOL_")] == ["It is 4."]
    _, content, calls = _streamed(spec, ["Let me look.", "[TOOL_CALLS]f[ARGS]", '{"a": 1}'])
    assert content == "Let me look." and calls[0]["function"]["name"] == "f"


@pytest.mark.parametrize("pieces", [["<think>add", " 2 and 2</think>", "\n\nFour."],
                                    ["<th", "ink>add 2 and 2</th", "ink>\n", "\nFour."],
                                    ["<think>add 2 and 2</think>\n\nFour."]])
def test_think_stream_matches_the_whole_split(pieces):
    """Reasoning streamed piece by piece equals the whole-answer split, wherever the tags are cut."""
    from graftmem.core.answers import AnswerSpec, split_answer

    spec = AnswerSpec(think=("<think>", "</think>"))
    assert _streamed(spec, pieces)[:2] == ("add 2 and 2", "Four.")
    whole = split_answer("".join(pieces), spec)
    assert (whole.reasoning, whole.content) == ("add 2 and 2", "Four.")
    inside = AnswerSpec(think=("<think>", "</think>"), think_open=True)
    assert _streamed(inside, ["first 2", "</think>", "Four."])[:2] == ("first 2", "Four.")
    assert _streamed(AnswerSpec(think=("<think>", "</think>")), ["It is", " 4."])[:2] == ("", "It is 4.")


@pytest.mark.parametrize("text,spec_kw,expect", [
    # an unclosed think block is reasoning in both modes (it was content when sent whole)
    ("still thinking", {"think_open": True}, ("still thinking", None)),
    ("<think>still thinking", {}, ("still thinking", None)),
    # an empty thought leaves no </think> behind
    ("<think></think>Four.", {}, (None, "Four.")),
    ("</think>Four.", {"think_open": True}, (None, "Four.")),
])
def test_reasoning_edges_agree_streamed_and_whole(text, spec_kw, expect):
    from graftmem.core.answers import AnswerSpec, split_answer

    spec = AnswerSpec(think=("<think>", "</think>"), **spec_kw)
    whole = split_answer(text, spec)
    assert (whole.reasoning, whole.content) == expect
    for n in (1, 2, 3):
        r, c, _ = _streamed(spec, [text[i:i + n] for i in range(0, len(text), n)])
        assert (r or None, c or None) == expect


def test_issue_40_families():
    """The cases issue #40 found wrong: Mistral [THINK], Command R7B's thinking, DeepSeek V3.1 / R1 calls in
    their own syntax, a DeepSeek JSON block without a newline before its fence, a Hermes string argument
    holding </tool_call>, a Qwen3-Coder call without its opening tag, GPT-OSS without tools."""
    from graftmem.core.answers import answer_spec, split_answer

    def src(name: str) -> str:
        return template_path(name).read_text()

    a = split_answer("[THINK]hmm[/THINK]Yes.", answer_spec(src("mistralai-Ministral-3-14B-Reasoning-2512")))
    assert (a.reasoning, a.content) == ("hmm", "Yes.")
    a = split_answer("<|START_THINKING|>hmm<|END_THINKING|><|START_RESPONSE|>Yes.<|END_RESPONSE|>",
                     answer_spec(src("CohereForAI-c4ai-command-r7b-12-2024-tool_use")))
    assert (a.reasoning, a.content) == ("hmm", "Yes.")
    v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert split_answer(v31, answer_spec(src("deepseek-ai-DeepSeek-V3.1"), names=["f"])).calls[0]["function"] == \
        {"name": "f", "arguments": '{"a": 1}'}
    r1 = ("</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}```"
          "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    a = split_answer(r1, answer_spec(src("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"), names=["f"],
                                     prompt_tail="<｜Assistant｜><think>\n"))
    assert [c["function"]["name"] for c in a.calls] == ["f"] and a.content is None and a.reasoning is None
    h = '<tool_call>{"name": "f", "arguments": {"s": "a </tool_call> b"}}</tool_call>'
    assert json.loads(split_answer(h, answer_spec(None, names=["f"])).calls[0]["function"]["arguments"]) == \
        {"s": "a </tool_call> b"}
    q = "I'll look.\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    spec = answer_spec(src("Qwen3-Coder"), names=["f"])
    for pieces in ([q], [q[i:i + 2] for i in range(0, len(q), 2)]):
        r, c, calls = _streamed(spec, pieces)
        assert c == "I'll look." and [x["function"]["name"] for x in calls] == ["f"]
    g = "<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>Four."
    a = split_answer(g, answer_spec(src("openai-gpt-oss-120b")))
    assert (a.reasoning, a.content, a.calls) == ("think hard", "Four.", [])


def test_tiny_builder_reads_a_vocab_as_gguf_reader_does():
    """scripts/tiny_models.py's fast GGUF key-value reader gives gguf-py's values (Phi-3's vocab:
    strings, string arrays, float and int arrays, bools)."""
    import gguf
    import numpy as np

    from .tiny import tiny_models

    path = tiny_models().vocab_path("phi-3")
    ours = tiny_models().read_kv(path)
    ref = gguf.GGUFReader(str(path))
    assert set(ours) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, (vtype, _, value) in ours.items():
        expect = ref.fields[key].contents()
        assert vtype == ref.fields[key].types[0]
        assert (np.asarray(value).tolist() if hasattr(value, "tolist") else value) == expect, key


def _call_text(fmt: tc.ToolCallFormat, value: str, name: str = "f") -> str:
    """A call of ``name`` whose one argument ``x`` is ``value`` (JSON text; Gemma 4's own syntax for
    gemma4), in ``fmt``'s call syntax as its forced-call grammar writes it (`tc.call_grammar`'s tables)."""
    if fmt.name in tc._JSON_CALLS:
        opener, closer, key_name, key_args, listed, _ = tc._JSON_CALLS[fmt.name]
        args = f'{{"x": {value}}}'
        obj = f'{{"{name}": {args}}}' if not key_name else f'{{"{key_name}": "{name}", "{key_args}": {args}}}'
        return opener + (f"[{obj}]" if listed else obj) + closer
    if fmt.name in tc._NAMED_CALLS:
        opener, before, between, after, closer = tc._NAMED_CALLS[fmt.name]
        return opener + before + name + between + f'{{"x": {value}}}' + after + closer
    if fmt.name in tc._XML_CALLS:
        head, after_name, k_head, k_after, k_tail, tail = tc._XML_CALLS[fmt.name]
        return head + name + after_name + k_head + "x" + k_after + value + k_tail + tail
    if fmt.name == "firefunction":
        return f'functools[{{"name": "{name}", "arguments": {{"x": {value}}}}}]'
    if fmt.name == "minimax3":
        m = tc._M3
        return f'{m}<tool_call>\n{m}<invoke name="{name}">{m}<x>{value}{m}</x>{m}</invoke>\n{m}</tool_call>'
    if fmt.name == "pythonic":
        return f"<|tool_call_start|>[{name}(x={value})]<|tool_call_end|>"
    assert fmt.name == "gemma4", f"no call syntax known for {fmt.name}: add it here"
    return f"<|tool_call>call:{name}{{x:{value}}}<tool_call|>"


DEEP = 100_000


@pytest.mark.parametrize("family", sorted(tc.FORMATS))
def test_deeply_nested_json_in_a_call_never_raises(family):
    """A call whose argument nests 100,000 lists deep (a model's answer, or a hostile client's earlier
    assistant message) raised RecursionError out of every family's parser: now the nesting is text (no
    call; in the XML families, whose values fall back to text, the value is that text), through the
    whole-answer parser, the server's `parse_calls` and the stream's hold-back, and what comes out encodes."""
    from graftmem.core import jsontext
    from graftmem.core.answers import AnswerParser, AnswerSpec, split_answer

    fmt = tc.FORMATS[family]
    shallow = tc.parse(_call_text(fmt, "[[1]]"), fmt, ["f"])
    assert len(shallow.calls) == 1, (family, shallow)  # the text is a call in this family's syntax
    spec = AnswerSpec(fmt, frozenset({"f"}))
    deep = _call_text(fmt, "[" * DEEP + "]" * DEEP)
    for text in (deep, deep[:len(deep) // 2], "Sure.\n" + deep):  # whole, cut off mid-answer, after prose
        parsed = tc.parse(text, fmt, ["f"])
        whole = split_answer(text, spec)
        content, calls = whole.content, whole.calls
        stream = AnswerParser(spec)
        for i in range(0, len(text), 4096):
            stream.feed(text[i:i + 4096])
        stream.finish()
        ids = lambda a: (a.content, a.reasoning, [c["function"] for c in a.calls])  # noqa: E731
        assert ids(stream.answer) == ids(whole)  # streamed or not, the same answer
        for call in parsed.calls + calls:  # arguments decoded no deeper than the bound, so they encode again
            assert jsontext.json_depth(call["function"]["arguments"]) <= jsontext.MAX_DEPTH
            json.dumps(jsontext.loads(call["function"]["arguments"]))
        if family not in tc._XML_CALLS and family not in ("minimax3", "pythonic"):  # values that fall back to text
            shown = text
            for m in sorted(fmt.strip, key=len, reverse=True):
                shown = shown.replace(m, "")
            assert parsed.calls == [] and calls == [] and content == shown.strip(), family


def test_deeply_nested_call_arguments_read_back_as_an_empty_input():
    """Arguments a model wrote as a JSON string nesting 100,000 lists (Hermes keeps such a string as the
    arguments): Anthropic's ``tool_use`` block takes them as no object, never a RecursionError."""
    from graftmem.server.anthropic import AnthropicRoutes

    text = '<tool_call>{"name": "f", "arguments": ' + json.dumps("[" * DEEP + "]" * DEEP) + "}</tool_call>"
    call = tc.parse(text, tc.HERMES, ["f"]).calls[0]
    assert AnthropicRoutes._tool_use(call)["input"] == {}
