"""Tool use over the OpenAI API: tool descriptions and tool messages rendered into the prompt, tool
calls parsed out of the answer.

The format is the Hermes one that SmolLM2, Qwen and most open chat models were tuned on:

- the request's ``tools`` are appended to the system message (one is added when there is none) as
  ``<tools>`` followed by one JSON object per line, keys sorted, then an instruction to answer a call
  as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant message's ``tool_calls`` are rendered after its content in the same form (``name``
  first, then ``arguments`` with sorted keys);
- a ``role: "tool"`` message is rendered as ``<tool_response>...</tool_response>`` in a ``tool`` turn
  (a ``user`` turn for templates without that role).

Everything is rendered deterministically (sorted keys, fixed separators), so the same tools and the
same conversation always give the same token ids: the tool block is part of the stable prefix that the
prefix cache learns and grafts, like the system prompt it extends.

A model's answer is split by `graftmem.core.answers` (one state machine for the stream and the whole
answer; `answer_spec` is the rule that sets it up for a request): each call of a tool of the request
becomes an entry of ``message.tool_calls`` (``arguments`` as a JSON string, as OpenAI sends it) and the
finish reason is ``"tool_calls"``; text outside the calls stays the content, reasoning goes apart.
``tool_choice: "none"`` keeps the tools in the prompt but parses nothing; ``"required"`` and a named
function are enforced: the answer is decoded under a grammar of a call in the family's own syntax
(`ToolSpec.forced`, `graftmem.core.toolcalls.call_grammar`), so it parses into calls every time.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..core import answers, jsontext, toolcalls
from ..core.answers import Answer, AnswerParser, AnswerSpec, Event
from ..core.toolcalls import ToolCallFormat
from .http import HTTPError

if TYPE_CHECKING:
    from ..core.template import ChatTemplate

__all__ = ["ToolSpec", "CALL_OPEN", "CALL_CLOSE", "MAX_TOOLS", "parse_tools", "tools_prompt", "render_calls",
           "render_tool_result", "request_tools", "answer_spec", "split_answer", "Answer", "AnswerParser", "AnswerSpec", "Event"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
#: The tools one request may offer (OpenAI's own limit); every door checks it before converting them.
MAX_TOOLS = 128
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


@dataclass(frozen=True)
class ToolSpec:
    """The request's tools (checked) and whether calls are parsed out of the answer."""

    functions: tuple[dict[str, Any], ...]
    parse: bool
    #: the family's call grammar (`graftmem.core.toolcalls`): Hermes unless the model's own template
    #: renders the tools, then the family its template writes
    fmt: ToolCallFormat = field(default=toolcalls.HERMES)
    #: split ``<think>`` / harmony analysis off into ``reasoning_content`` (model templates only)
    reasoning: bool = False
    #: the functions a call is forced to (``tool_choice: "required"``: all; a named function: that
    #: one), enforced by a grammar in the family's own call syntax (`graftmem.core.toolcalls.call_grammar`);
    #: None: the model may answer in text (``auto``)
    forced: Optional[tuple[str, ...]] = None
    #: ``parallel_tool_calls``: a forced answer may hold several calls (default one, as llama-server's)
    parallel: bool = False

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}


def parse_tools(body: dict[str, Any]) -> Optional[ToolSpec]:
    """The request's ``tools`` / ``tool_choice``, checked (400 on a malformed one); None without tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise HTTPError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise HTTPError(400, f"tools must be a list of up to {MAX_TOOLS} function tools", param="tools")
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME_RE.match(fn["name"]):
            raise HTTPError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                            "with a name of letters, digits, _ . - (up to 64)", param=f"tools[{i}]")
        desc, params = fn.get("description"), fn.get("parameters")
        if desc is not None and not isinstance(desc, str):
            raise HTTPError(400, f"tools[{i}].function.description must be a string", param=f"tools[{i}]")
        if params is not None and not isinstance(params, dict):
            raise HTTPError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                            param=f"tools[{i}]")
        entry: dict[str, Any] = {"name": fn["name"]}
        if desc:
            entry["description"] = desc
        if params is not None:
            entry["parameters"] = params
        functions.append(entry)
    forced: Optional[tuple[str, ...]] = None
    if choice == "required":
        forced = tuple(f["name"] for f in functions)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {f["name"] for f in functions}:
            raise HTTPError(400, f"tool_choice names the function {name!r:.80}, which is not one of the request's "
                            "tools", param="tool_choice")
        forced = (name,)
    elif choice is not None and choice not in ("none", "auto"):
        raise HTTPError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise HTTPError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return ToolSpec(tuple(functions), parse=choice != "none", forced=forced, parallel=bool(parallel))


def tools_prompt(spec: ToolSpec) -> str:
    """The text appended to the system message: the tools, one JSON object per line, and the format."""
    lines = "\n".join(_dumps({"type": "function", "function": f}) for f in spec.functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def call_parts(call: Any, i: int, j: int) -> tuple[str, Any]:
    """The function name and arguments of ``messages[i].tool_calls[j]`` (an OpenAI call object), the
    arguments decoded from their JSON string where they are one (kept as sent where not): what every
    renderer of a prior call needs, the Hermes one here and the model templates' (`graftmem.server.chat`)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise HTTPError(400, f"messages[{i}].tool_calls[{j}] must have function.name",
                        param=f"messages[{i}].tool_calls")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = jsontext.loads(args) if args.strip() else {}
        except ValueError:
            pass  # kept as the string the client sent (also when nested too deep to decode)
    return fn["name"], args


def render_calls(calls: Any, i: int) -> str:
    """An assistant message's ``tool_calls`` as the text the model would have written."""
    if not isinstance(calls, list):
        raise HTTPError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
    out = []
    for j, call in enumerate(calls):
        name, args = call_parts(call, i, j)
        # name first, as models write it (and as they then imitate it); the arguments' keys sorted
        out.append(f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {_dumps(args)}}}\n{CALL_CLOSE}')
    return "\n".join(out)


def render_tool_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def request_tools(body: dict[str, Any], template: Optional["ChatTemplate"]) -> Optional[ToolSpec]:
    """The request's tools (``tools`` / ``tool_choice`` in the chat shape, `parse_tools`) in the call
    format the model answers in: its template's family when the template renders the tools, else Hermes
    (graftmem's tool prompt). The one rule the chat pipeline and the parity bench use."""
    tools = parse_tools(body)
    if tools is not None and template is not None and template.uses_tools:
        tools = dataclasses.replace(tools, fmt=toolcalls.tool_format(template.source))
    return tools


def answer_spec(template: Optional["ChatTemplate"], tools: Optional[ToolSpec], *, reasoning: bool = True,
                prompt_tail: str = "") -> AnswerSpec:
    """How an answer to this request splits (`graftmem.core.answers`): the request's tools (none, or
    ``tool_choice: "none"``: calls are not parsed), the family of the model's template (a template that
    renders no tools gets graftmem's Hermes prompt: Hermes calls, and its own family's too), its
    reasoning tags unless ``reasoning_format: "none"``, and whether the prompt (``prompt_tail``: its
    last text) opened the think block. The one rule every door uses, streamed or not."""
    names = tools.names if tools is not None and tools.parse else None
    src = template.source if template is not None else None
    fmt = None  # no tools: the template's own family (its channels, for harmony)
    if tools is not None:  # the family the tools are written in: the template's, or graftmem's Hermes prompt
        fmt = toolcalls.tool_format(src) if template is not None and template.uses_tools else toolcalls.HERMES
    return answers.answer_spec(src, fmt=fmt, names=names, reasoning=reasoning and template is not None,
                               prompt_tail=prompt_tail)


def split_answer(text: str, spec: AnswerSpec) -> Answer:
    """The whole answer split (`graftmem.core.answers.split_answer`: the stream fed at once)."""
    return answers.split_answer(text, spec)
