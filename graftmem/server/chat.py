"""OpenAI ``messages`` rendered with the model's chat template, as *segments* of token ids.

A segment is one message's turn (``<|im_start|>role\\n...<|im_end|>\\n`` in ChatML), and the last one is
the header of the assistant's turn. Every segment starts with a special token, so tokenizing them one
by one gives the ids of tokenizing the whole prompt (the seam argument of `graftmem.core.prompt`).

Why segments and not one token list: the server prefills a prompt one segment per ``prefill`` call,
cache or no cache. The K/V bytes of a token depend on how the prompt was cut into prefill calls (a
token's row position inside a micro-batch changes the kernels' rounding; ``graftmem.store.chain``
has the measurement), so byte-exactness holds between two computations that cut the prompt at the
same places. A conversation prefix is learned as a chain of one block per segment, whose state is
exactly the state of prefilling those segments call by call; a request that grafts it and prefills
its remaining segments computes the same bytes as a request served cold.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..core.prompt import ChatFormat
from .http import HTTPError
from .tools import ToolSpec, render_calls, render_tool_result, tools_prompt

if TYPE_CHECKING:
    from ..core.engine import Engine

__all__ = ["message_text", "render_segments", "tokenize_segments", "chunk_prompt", "CHUNK_TOKENS", "TokenCache"]

#: A raw prompt (``/v1/completions``) is cut into segments of about this many tokens.
CHUNK_TOKENS = 256


def message_text(msg: Any, i: int) -> tuple[str, str]:
    """The role and the text of message ``i`` (content as a string or a list of text parts)."""
    if not isinstance(msg, dict):
        raise HTTPError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
    role = msg.get("role")
    if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant", "tool"):
        raise HTTPError(400, f"messages[{i}].role must be system, developer, user, assistant or tool, "
                        f"got {role!r}", param=f"messages[{i}].role")
    content = msg.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise HTTPError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                param=f"messages[{i}].content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise HTTPError(400, f"messages[{i}].content must be a string or a list of text parts",
                        param=f"messages[{i}].content")
    if msg.get("tool_calls"):
        if role != "assistant":
            raise HTTPError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                            param=f"messages[{i}].tool_calls")
        calls = render_calls(msg["tool_calls"], i)
        content = f"{content}\n{calls}" if content else calls
    if role == "tool":
        content = render_tool_result(content)
    return role, content


def render_segments(fmt: ChatFormat, messages: Sequence[Any], tools: Optional[ToolSpec] = None) -> list[str]:
    """The prompt's segments: one per message, then the assistant's header. ``tools`` are appended to
    the first message when it is a system one, else put in a system message of their own before it
    (`graftmem.server.tools`)."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", param="messages")
    rendered = [message_text(msg, i) for i, msg in enumerate(messages)]
    if tools is not None:
        if rendered[0][0] in ("system", "developer"):
            rendered[0] = (rendered[0][0], f"{rendered[0][1]}\n\n{tools_prompt(tools)}")
        else:
            rendered.insert(0, ("system", tools_prompt(tools)))
    segs = []
    for role, text in rendered:
        if fmt.name == "gemma":  # no system role: its own template folds it into a user turn
            role = {"system": "user", "developer": "user", "assistant": "model", "tool": "user"}[role] \
                if role != "user" else role
        elif role == "developer":
            role = "system"
        head = fmt.task_head.replace("user", role, 1)
        segs.append(f"{head}{text}{fmt.block_tail}")
    segs.append(fmt.task_tail[len(fmt.block_tail):])  # the assistant's header
    return segs


class TokenCache:
    """Token ids of recently seen segment texts, least recently used dropped past ``max_chars``.

    An agent re-sends its system prompt, tools and conversation on every call; tokenizing those
    ~3,000 tokens again was the event loop's largest cost per request (8 ms of a 15 ms request path,
    measured with py-spy). The ids of a text are a function of the text and the model's vocabulary, so
    a cache per engine's model returns exactly what tokenizing would."""

    def __init__(self, max_chars: int = 32 << 20) -> None:
        self.max_chars = max_chars
        self._ids: "OrderedDict[tuple[str, bool], list[int]]" = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def tokenize(self, engine: "Engine", text: str, add_special: bool) -> list[int]:
        key = (text, add_special)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                return list(ids)
        ids = engine.tokenize(text, add_special=add_special)
        if len(text) <= self.max_chars:
            with self._lock:
                if key not in self._ids:
                    self._ids[key] = list(ids)
                    self._chars += len(text)
                while self._chars > self.max_chars:
                    (old, _), _ = self._ids.popitem(last=False)
                    self._chars -= len(old)
        return ids


def tokenize_segments(engine: "Engine", segs: Sequence[str], cache: Optional[TokenCache] = None) -> list[list[int]]:
    """Token ids per segment: the first with the model's BOS, the others without."""
    if cache is None:
        return [engine.tokenize(s, add_special=i == 0) for i, s in enumerate(segs)]
    return [cache.tokenize(engine, s, i == 0) for i, s in enumerate(segs)]


def chunk_prompt(engine: "Engine", prompt: str, size: int = CHUNK_TOKENS, slack: int = 32) -> tuple[list[list[int]], list[str]]:
    """A raw prompt's token ids cut into segments of ``size`` tokens or a little more, and their texts.

    A completion prompt has no messages to cut at, so it is cut by token count, where the cut is clean:
    the segment's text (its tokens detokenized) tokenizes back to exactly its tokens, so each learned
    block's text and tokens stay bound (what an import checks). A cut is searched in the ``slack``
    tokens after each ``size``; without a clean one, the rest of the prompt is one segment. Every cut
    depends only on the ids before it, so two prompts that share a prefix share its segments, which is
    what the prefix cache matches on; and the prompt is prefilled one segment per call, cached or not
    (the exactness argument of this module)."""
    ids = engine.tokenize(prompt, add_special=True)
    segs: list[list[int]] = []
    texts: list[str] = []
    start = 0
    while len(ids) - start > size:
        cut = None
        for end in range(start + size, min(start + size + slack, len(ids))):
            text = engine.detokenize(ids[start:end])
            if engine.tokenize(text, add_special=start == 0) == ids[start:end]:
                cut = end
                break
        if cut is None:
            break
        segs.append(ids[start:cut])
        texts.append(text)
        start = cut
    segs.append(ids[start:])
    texts.append(engine.detokenize(ids[start:]))
    return segs, texts
