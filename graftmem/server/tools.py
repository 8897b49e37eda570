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

A model's answer is searched for complete ``<tool_call>...</tool_call>`` spans whose JSON names a tool
of the request; each one becomes an entry of ``message.tool_calls`` (``arguments`` as a JSON string, as
OpenAI sends it) and the finish reason is ``"tool_calls"``. Text outside the spans stays the content.
``tool_choice: "none"`` keeps the tools in the prompt but parses nothing; ``"required"`` and a named
function are enforced: the answer is decoded under a grammar of a call in the family's own syntax
(`ToolSpec.forced`, `graftmem.core.toolcalls.call_grammar`), so it parses into calls every time.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..core import jsontext, toolcalls
from ..core.toolcalls import ToolCallFormat
from .http import HTTPError

__all__ = ["ToolSpec", "CALL_OPEN", "CALL_CLOSE", "MAX_TOOLS", "parse_tools", "tools_prompt", "render_calls",
           "render_tool_result", "parse_calls", "ToolStream", "ThinkStream"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
#: The tools one request may offer (OpenAI's own limit); every door checks it before converting them.
MAX_TOOLS = 128
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)
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


def parse_calls(text: str, spec: Optional[ToolSpec]) -> tuple[Optional[str], list[dict[str, Any]]]:
    """The content and the tool calls in an answer (no calls: the text unchanged and an empty list)."""
    if spec is not None and spec.parse and spec.fmt is not toolcalls.HERMES:
        parsed = toolcalls.parse(text, spec.fmt, spec.names)
        return (parsed.content, parsed.calls) if parsed.calls else (text, [])
    if spec is None or not spec.parse or CALL_OPEN not in text:
        return text, []
    calls = []
    for m in _CALL_RE.finditer(text):
        try:
            obj = jsontext.loads(m.group(1))
        except ValueError:  # not JSON, or nested too deep (100,000 brackets are text, not a RecursionError)
            continue
        if not isinstance(obj, dict) or obj.get("name") not in spec.names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    content = _CALL_RE.sub("", text).strip()
    return content or None, calls


class ToolStream:
    """Streams an answer's content while holding back anything that may be a tool call.

    Text is passed on until ``<tool_call>`` appears (or may be appearing: a suffix that is a prefix of
    it is held); from there on nothing is streamed, and `finish()` decides from the whole answer.
    Llama 3's bare JSON is held until the answer's first character: ``{`` holds it whole, anything
    else streams. Other families whose call markers may be control tokens (Mistral, harmony, DeepSeek,
    Gemma 4: the streamed text never shows them) are held whole and decided at the end."""

    def __init__(self, fmt: ToolCallFormat = toolcalls.HERMES) -> None:
        self.buf, self.sent = "", 0
        self.bare_json = fmt.bare_json
        self.held = fmt not in (toolcalls.HERMES, toolcalls.QWEN_XML) and not fmt.bare_json

    def feed(self, text: str) -> str:
        self.buf += text
        if self.bare_json:
            head = self.buf.lstrip()
            if not head:
                return ""
            self.bare_json, self.held = False, head.startswith("{")
        if self.held:
            return ""
        cut = self.buf.find(CALL_OPEN, self.sent)
        if cut >= 0:
            self.held = True
            safe = cut
        else:
            safe = len(self.buf)
            for n in range(min(len(CALL_OPEN) - 1, len(self.buf) - self.sent), 0, -1):
                if CALL_OPEN.startswith(self.buf[-n:]):
                    safe -= n
                    break
        out, self.sent = self.buf[self.sent:safe], max(self.sent, safe)
        return out

    def rest(self, final_text: str, calls: Sequence[dict[str, Any]]) -> str:
        """What content is still to send once the answer is complete."""
        if calls:
            return ""
        return final_text[self.sent:] if final_text.startswith(self.buf[:self.sent]) else ""


class ThinkStream:
    """Splits a streamed answer into reasoning and content at ``<think>...</think>``, as
    `graftmem.core.toolcalls.split_reasoning` splits a whole one.

    ``inside``: the prompt opened the think block (Qwen3's and DeepSeek R1's generation prompts end with
    ``<think>``), so the answer starts as reasoning. A suffix that may be the start of a tag is held
    until the next piece decides; whitespace right after ``</think>`` is dropped, as the whole-answer
    split drops it, so the streamed content equals the final one."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, inside: bool = False) -> None:
        self.buf, self.state = "", "think" if inside else "start"

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` that may be sent now."""
        self.buf += text
        think, content = "", ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if not head or (self.OPEN.startswith(head) and head != self.OPEN):
                    return think, content  # nothing yet, or maybe "<think>" arriving
                if head.startswith(self.OPEN):
                    self.buf, self.state = head[len(self.OPEN):], "think"
                    continue
                self.state = "content"
            if self.state == "think":
                i = self.buf.find(self.CLOSE)
                if i >= 0:
                    think += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(self.CLOSE):], "after"
                    continue
                keep = next((n for n in range(min(len(self.CLOSE) - 1, len(self.buf)), 0, -1)
                             if self.CLOSE.startswith(self.buf[-n:])), 0)
                think += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return think, content
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return think, content
                self.state = "content"
            content += self.buf
            self.buf = ""
            return think, content

    def flush(self) -> tuple[str, str]:
        """What is left at the end of the answer (a held partial tag is text after all)."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "think" else ("", rest if self.state != "after" else rest.lstrip())
