"""Prompt shape for instruct models: the block holds a chat-template *prefix*, the task is its *continuation*.

Why the split sits where it does. A graft is exact only against a fresh prefill of the same token
ids. A user, though, compares against a fresh prefill of the same *string*, ``tokenize(prefix + task)``.
Those agree only if tokenizing the two halves separately gives the ids of tokenizing the whole:

    tokenize(prefix) + tokenize(continuation, add_special=False) == tokenize(prefix + continuation)

A split inside ordinary text breaks that easily: BPE merges across the seam (``"\\n" + "\\n"`` is one
token, a leading space glues to the next word, ``"." + ".."`` becomes ``"..."``). llama.cpp, however,
cuts the text into fragments at every special token *before* running BPE (``parse_special=True``), so
a seam placed right before a special token can never merge. Every format here therefore ends the block
with a complete turn (``...<|im_end|>\\n``) and starts the continuation with a special token
(``<|im_start|>user\\n...``). Leading spaces, newlines or special-token text in the task then sit inside
the continuation, where they tokenize exactly as they would in the whole prompt.

Special-token text inside a task (``"<|im_end|>"`` typed by a user) is parsed as the special token, in
the block path and in a fresh prefill alike, so exactness holds; it is also how llama.cpp's own chat
loop treats it. Escape such text before recall if your tasks come from untrusted users.

`split_ids()` checks the equality for any prefix/continuation pair, so raw (non-chat) blocks are
checked too; a recall whose seam does merge is reported with ``receipt.exact = False``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from .errors import ConfigError

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["ChatFormat", "CHATML", "GEMMA", "FORMATS", "detect_format", "format_named", "split_ids"]


@dataclass(frozen=True)
class ChatFormat:
    """One chat template, cut at a special-token seam.

    ``prefix(manual)`` is what a block stores: the manual as a complete turn. ``continuation(task)`` is
    what a recall prefills: a user turn holding the task and the header of the assistant's turn.
    ``probe`` is a special token that must tokenize to a single id in models that use this format.
    """

    name: str
    block_head: str
    block_tail: str
    task_head: str
    task_tail: str
    probe: str
    turn_open: str = ""        #: a turn's header, with ``{role}`` for the role name
    turn_close: str = ""       #: a turn's end
    roles: tuple[tuple[str, str], ...] = ()  #: OpenAI role -> this template's role

    def turn(self, role: str, content: str) -> str:
        """One complete turn of ``role`` (an OpenAI role: system, user, assistant, tool)."""
        mapped = dict(self.roles).get(role)
        if mapped is None:
            raise ConfigError(f"role {role!r} is not one of {', '.join(r for r, _ in self.roles)}")
        return f"{self.turn_open.format(role=mapped)}{content}{self.turn_close}"

    def render(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool = False) -> str:
        """Chat messages (``[{"role": ..., "content": ...}]``) as this template's text; with
        ``generation_prompt`` the header of the assistant's turn follows, ready for decoding."""
        parts = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ConfigError(f"message {i} must be a mapping with string 'role' and 'content', got {m!r:.80}")
            parts.append(self.turn(m["role"], m["content"]))
        if generation_prompt:
            parts.append(self.turn_open.format(role=dict(self.roles)["assistant"]))
        return "".join(parts)

    def prefix(self, manual: str) -> str:
        return f"{self.block_head}{manual}{self.block_tail}"

    def continuation(self, task: str) -> str:
        return f"{self.task_head}{task}{self.task_tail}"

    def body(self, prefix_text: str) -> str:
        """The manual inside a prefix made by `prefix()` (the text itself if it is not one)."""
        if prefix_text.startswith(self.block_head) and prefix_text.endswith(self.block_tail):
            return prefix_text[len(self.block_head):len(prefix_text) - len(self.block_tail)]
        return prefix_text


#: SmolLM2 and other ChatML models: the manual is the system turn.
CHATML = ChatFormat(
    name="chatml",
    block_head="<|im_start|>system\n", block_tail="<|im_end|>\n",
    task_head="<|im_start|>user\n", task_tail="<|im_end|>\n<|im_start|>assistant\n",
    probe="<|im_start|>",
    turn_open="<|im_start|>{role}\n", turn_close="<|im_end|>\n",
    roles=(("system", "system"), ("user", "user"), ("assistant", "assistant"), ("tool", "tool")),
)

#: Gemma 3 has no system role (its own template folds the system text into the first user turn);
#: the manual is a user turn of its own, so the seam still falls before ``<start_of_turn>``.
GEMMA = ChatFormat(
    name="gemma",
    block_head="<start_of_turn>user\n", block_tail="<end_of_turn>\n",
    task_head="<start_of_turn>user\n", task_tail="<end_of_turn>\n<start_of_turn>model\n",
    probe="<start_of_turn>",
    turn_open="<start_of_turn>{role}\n", turn_close="<end_of_turn>\n",
    # Gemma's own template has no system or tool role: their text is a user turn
    roles=(("system", "user"), ("user", "user"), ("assistant", "model"), ("tool", "user")),
)

FORMATS: dict[str, ChatFormat] = {f.name: f for f in (CHATML, GEMMA)}


def format_named(name: str) -> ChatFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown chat format {name!r}; known: {', '.join(sorted(FORMATS))}") from None


def detect_format(engine: "Engine") -> Optional[ChatFormat]:
    """The format whose probe token is a single special token in this engine's vocabulary.

    Detected from the vocabulary rather than from the GGUF's Jinja template: the template would need
    a Jinja renderer and its seam is not ours to choose; the vocabulary says which markers exist.
    """
    for fmt in FORMATS.values():
        ids = engine.tokenize(fmt.probe, add_special=False)
        if len(ids) == 1:
            return fmt
    return None


def split_ids(engine: "Engine", prefix_tokens: Sequence[int], prefix_text: str,
              continuation: str, *, add_special: bool = True) -> tuple[list[int], bool]:
    """Continuation ids, and whether ``prefix_tokens + ids == tokenize(prefix_text + continuation)``.

    ``prefix_tokens`` are the ids the block holds, tokenized with ``add_special`` (True for a root
    block, False for a block chained on a parent); the check costs one tokenization of the whole
    prompt, which is microseconds next to any prefill.
    """
    ids = engine.tokenize(continuation, add_special=False)
    whole = engine.tokenize(prefix_text + continuation, add_special=add_special)
    return ids, list(prefix_tokens) + ids == whole
