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

Which format: the model's own chat template (`graftmem.core.template`), cut into the same four parts
at the seam the server's rule cuts a conversation at (`graftmem.core.segments.template_format`); the two
hand-written formats below stand in for a template only where they render exactly what it renders
(`graftmem.core.segments.renders_as_template`: SmolLM2) and serve GGUFs without a template (Gemma 3 270M). docs/models.md lists every case where graftmem substitutes
anything, and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from .errors import ConfigError
from .template import ChatTemplate

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["ChatFormat", "CHATML", "GEMMA", "FORMATS", "format_of", "split_ids", "clean_seam", "seam_before",
           "starts_special", "has_special_text", "tokenize_literal"]


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
    #: the model's own template this format was derived from (None: a hand-written format)
    template: Optional[ChatTemplate] = field(default=None, compare=False, repr=False)

    @property
    def parts(self) -> list[str]:
        """What a block learned through a derived format stores to rebuild it (`format_of`)."""
        return [self.block_head, self.block_tail, self.task_head, self.task_tail]

    def head(self, role: str) -> str:
        """The header of a turn of ``role`` (an OpenAI role: system, user, assistant, tool)."""
        mapped = dict(self.roles).get(role)
        if mapped is None:
            raise ConfigError(f"role {role!r} is not one of {', '.join(r for r, _ in self.roles)}")
        return self.turn_open.format(role=mapped)

    def turn(self, role: str, content: str) -> str:
        """One complete turn of ``role`` (an OpenAI role: system, user, assistant, tool)."""
        return f"{self.head(role)}{content}{self.turn_close}"

    def render(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool = False) -> str:
        """Chat messages (``[{"role": ..., "content": ...}]``) as this template's text; with
        ``generation_prompt`` the header of the assistant's turn follows, ready for decoding. Each
        message is checked first, whichever renders it (a model's own template would render a role-less
        or unknown-role message as whatever its Jinja makes of it)."""
        known = dict(self.roles) if self.template is None else dict.fromkeys(("system", "user", "assistant", "tool"))
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ConfigError(f"message {i} must be a mapping with string 'role' and 'content', got {m!r:.80}")
            if m["role"] not in known:
                raise ConfigError(f"message {i}: role {m['role']!r} is not one of {', '.join(known)}")
        if self.template is not None:
            return self.template.render(messages, add_generation_prompt=generation_prompt)
        parts = []
        for m in messages:
            parts.append(self.turn(m["role"], m["content"]))
        if generation_prompt:
            parts.append(self.head("assistant"))
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



def format_of(metadata: Mapping[str, Any]) -> Optional[ChatFormat]:
    """The format a chat block was learned with, from its metadata: a hand-written one by name, a
    template-derived one from the four parts it stored (so recall needs neither engine nor template)."""
    name = str(metadata.get("chat_format", ""))
    if name in FORMATS:
        return FORMATS[name]
    parts = metadata.get("chat_parts")
    if name.startswith("template:") and isinstance(parts, list) and len(parts) == 4 \
            and all(isinstance(p, str) for p in parts):
        return ChatFormat(name=name, block_head=parts[0], block_tail=parts[1], task_head=parts[2],
                          task_tail=parts[3], probe="")
    return None


def clean_seam(engine: "Engine", text: str, cut: int, *, add_special: bool = True,
               whole: Optional[Sequence[int]] = None) -> bool:
    """Whether ``text`` may be cut at ``cut``: the rest starts with a special token (llama.cpp splits
    fragments at special tokens before BPE, so nothing merges across) and the two halves tokenized
    apart give the ids of the whole (``whole``: those ids, when the caller has them)."""
    rest = text[cut:]
    if not rest:
        return True
    if cut == 0 or not starts_special(engine, text, cut):
        return False
    a = engine.tokenize(rest, add_special=False)
    if whole is None:
        whole = engine.tokenize(text, add_special=add_special)
    return engine.tokenize(text[:cut], add_special=add_special) + a == list(whole)


def has_special_text(engine: "Engine", text: str) -> bool:
    """Whether ``text`` spells a special token (``"<|eot_id|>"`` typed by a user): tokenized with and
    without special-token parsing it gives other ids."""
    return engine.tokenize(text, add_special=False) != engine.tokenize(text, add_special=False, parse_special=False)


def tokenize_literal(engine: "Engine", text: str, spans: Sequence[tuple[int, int]], *,
                     add_special: bool = True) -> list[int]:
    """Ids of ``text`` with the character ``spans`` tokenized as plain text (special-token text inside
    them stays text) and the rest, the template's own markers, with special tokens parsed: what
    llama-server does with message content, so a user cannot forge a turn. The pieces are tokenized
    apart, so the ids are a function of the text and the spans, the same for a graft and a cold prefill."""
    ids: list[int] = []
    pos = 0
    for a, b in sorted(spans):
        if a > pos:
            ids += engine.tokenize(text[pos:a], add_special=add_special and not ids and pos == 0)
        elif pos == 0 and add_special:
            ids += engine.tokenize("", add_special=True)
        ids += engine.tokenize(text[a:b], add_special=False, parse_special=False)
        pos = b
    if pos < len(text):
        ids += engine.tokenize(text[pos:], add_special=add_special and pos == 0)
    return ids


def starts_special(engine: "Engine", text: str, at: int) -> bool:
    """Whether ``text[at:]`` starts with a special token's text (parsed as one token only when special
    tokens are parsed); a window is enough: no special token's text is 64 characters long."""
    window = text[at:at + 64]
    a = engine.tokenize(window, add_special=False)
    b = engine.tokenize(window, add_special=False, parse_special=False)
    return bool(a) and a[:1] != b[:1]


def seam_before(engine: "Engine", text: str, hi: int, lo: int = 1, *, add_special: bool = True,
                whole: Optional[Sequence[int]] = None, check: bool = True) -> Optional[int]:
    """The last clean seam (`clean_seam`) in ``text[lo..hi]``, None if there is none. ``check=False``
    only asks that the rest start with a special token (the caller then checks the ids of all its
    cuts at once, as `graftmem.core.segments.tokenize_cut` does)."""
    for c in range(min(hi, len(text)), max(lo, 1) - 1, -1):
        if c == len(text):
            return c
        if text[c] not in "<[":
            continue
        if (clean_seam(engine, text, c, add_special=add_special, whole=whole) if check
                else starts_special(engine, text, c)):
            return c
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
