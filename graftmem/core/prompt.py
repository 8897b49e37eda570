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
by `template_format()` at a special-token seam; the two hand-written formats below stand in for a
template only where they render exactly what it renders (`renders_as_template`: SmolLM2) and serve
GGUFs without a template (Gemma 3 270M). docs/models.md lists every case where graftmem substitutes
anything, and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from .errors import ConfigError
from .template import ChatTemplate, TemplateError, load_template, model_template, today

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["ChatFormat", "CHATML", "GEMMA", "FORMATS", "detect_format", "format_of", "request_template",
           "split_ids", "template_format", "clean_seam", "seam_before", "starts_special", "renders_as_template",
           "no_format_reason",
           "has_special_text", "tokenize_literal"]

log = logging.getLogger("graftmem")


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

    def turn(self, role: str, content: str) -> str:
        """One complete turn of ``role`` (an OpenAI role: system, user, assistant, tool)."""
        mapped = dict(self.roles).get(role)
        if mapped is None:
            raise ConfigError(f"role {role!r} is not one of {', '.join(r for r, _ in self.roles)}")
        return f"{self.turn_open.format(role=mapped)}{content}{self.turn_close}"

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


#: The conversation a hand-written format must render exactly as the model's template does to stand in
#: for it (`renders_as_template`): a system turn (a chat block's manual), a user turn, an answer, a user turn.
_PROBE = ({"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"})


def renders_as_template(fmt: ChatFormat, tpl: ChatTemplate) -> bool:
    """Whether the hand-written ``fmt`` renders byte for byte what the model's template ``tpl`` renders
    (a conversation with a system turn, each prefix of it, with the generation prompt) and ``tpl``
    renders no tools: then ``fmt`` stands in for it (SmolLM2: every block and prompt learned before
    stays byte-identical). A check, not a guess from the vocabulary: a template that renders anything
    else (DeepSeek R1-Distill-Qwen's, on a vocabulary that has ChatML's markers) is used as it is."""
    if tpl.uses_tools:
        return False
    try:
        return all(tpl.render(list(_PROBE[:k]), add_generation_prompt=True) ==
                   fmt.render(list(_PROBE[:k]), generation_prompt=True) for k in (2, 4))
    except (TemplateError, ConfigError):
        return False


def _hand_written(engine: "Engine") -> Optional[ChatFormat]:
    """The hand-written format whose marker is one special token of this vocabulary (None: neither)."""
    for fmt in FORMATS.values():
        if len(engine.tokenize(fmt.probe, add_special=False)) == 1:
            return fmt
    return None


def detect_format(engine: "Engine", template: "ChatTemplate | str | None" = None) -> Optional[ChatFormat]:
    """The chat format of this engine's requests and chat blocks.

    ``template`` (a `ChatTemplate` or a file path, as llama-server's ``--chat-template-file``) wins.
    Otherwise the GGUF's own ``tokenizer.chat_template``, cut into a block part and a task part by
    `template_format`, unless a hand-written format renders exactly what it renders
    (`renders_as_template`: SmolLM2) or it cannot hold a manual as a turn of its own (then the
    hand-written format, logged). A GGUF without a template falls back to the hand-written format whose
    marker is a single special token in the vocabulary (Gemma 3 270M); None when nothing fits.
    """
    if template is not None:
        given = template if isinstance(template, ChatTemplate) else load_template(template, engine)
        return template_format(engine, given)
    cache = getattr(engine, "_graftmem_formats", None)
    if cache is None:
        cache = {}
        try:
            engine._graftmem_formats = cache  # type: ignore[attr-defined]
        except AttributeError:
            pass
    if "auto" in cache:
        return cache["auto"]
    legacy = _hand_written(engine)
    tpl = model_template(engine)
    chosen: Optional[ChatFormat] = legacy
    if tpl is not None and not (legacy is not None and renders_as_template(legacy, tpl)):
        try:
            chosen = template_format(engine, tpl)
        except TemplateError as exc:
            log.warning("model %s: its chat template cannot hold a manual as a turn of its own (%s); %s",
                        engine.fingerprint.model_name, exc,
                        f"using the hand-written {legacy.name!r} format" if legacy else "chat is unavailable")
            chosen = legacy
            cache["why"] = f"its chat template cannot hold a manual as a turn of its own ({exc})"
    if tpl is None and legacy is None:
        cache["why"] = (f"the GGUF has no chat template and none of the hand-written formats "
                        f"({', '.join(sorted(FORMATS))}) fits its vocabulary")
    cache["auto"] = chosen
    return chosen


def no_format_reason(engine: "Engine") -> str:
    """Why `detect_format` found no chat format for ``engine`` (what a refusal says: the real reason,
    not a guess)."""
    detect_format(engine)
    cache = getattr(engine, "_graftmem_formats", None) or {}
    return str(cache.get("why", "no chat format fits this model"))


def request_template(engine: "Engine", template: "ChatTemplate | str | None" = None) -> Optional[ChatTemplate]:
    """The template a chat *request* is rendered with: ``template`` (an object or a file) if given,
    else the GGUF's own, except where a hand-written format renders exactly what it renders
    (`renders_as_template`; None: render with `detect_format`'s format; what still differs is logged). Unlike a chat block's format, a request needs no block/task cut, so a
    template that cannot render a system turn alone (Qwen3.5 raises "No user query found") still
    renders every request."""
    if template is not None:
        return template if isinstance(template, ChatTemplate) else load_template(template, engine)
    tpl = model_template(engine)
    if tpl is None:
        return None
    legacy = _hand_written(engine)
    if legacy is not None and renders_as_template(legacy, tpl):
        log.info("model %s: graftmem's hand-written %r format renders what its chat template renders for a "
                 "conversation with a system turn; requests use it (what differs: a request without a system "
                 "message gets no default system turn the template may add, and tools are graftmem's Hermes "
                 "text in the system message, which the template does not render)",
                 engine.fingerprint.model_name, legacy.name)
        return None
    return tpl


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
    cuts at once, as `graftmem.server.chat.template_segments`' caller does)."""
    for c in range(min(hi, len(text)), max(lo, 1) - 1, -1):
        if c == len(text):
            return c
        if text[c] not in "<[":
            continue
        if (clean_seam(engine, text, c, add_special=add_special, whole=whole) if check
                else starts_special(engine, text, c)):
            return c
    return None


_MANUAL, _TASK = "GRAFTMEMMANUALQZ", "GRAFTMEMTASKQZ"


def template_format(engine: "Engine", tpl: ChatTemplate) -> ChatFormat:
    """A `ChatFormat` cut out of a model's own template: render ``[system: M, user: T]`` with the
    generation prompt, and ``[system: M]`` alone; the block ends where the two stop agreeing (the
    system turn's end where the template extends cleanly; before Phi-3.5's EOS, which it writes only
    when nothing follows), moved back to a special-token seam. Raises `TemplateError` when the manual
    cannot be a turn of its own (Gemma 2's template refuses a system role; Mistral-Nemo's puts it in
    the last user turn)."""
    msgs = [{"role": "system", "content": _MANUAL}, {"role": "user", "content": _TASK}]
    day = today()
    full = tpl.render(msgs, add_generation_prompt=True, now=day)
    alone = tpl.render(msgs[:1], now=day)
    i_m, i_t = full.find(_MANUAL), full.find(_TASK)
    if i_m < 0 or i_t < 0 or i_t < i_m or alone.find(_MANUAL) != i_m:
        raise TemplateError(f"template {tpl.name!r} does not render a system message as a turn before the user's")
    agree = next((i for i, (a, b) in enumerate(zip(alone, full)) if a != b), min(len(alone), len(full)))
    end = i_m + len(_MANUAL)
    cut = seam_before(engine, full, min(agree, i_t), end)
    if cut is None:
        raise TemplateError(f"template {tpl.name!r}: no special-token seam between the system turn and the user's")
    fmt = ChatFormat(name=f"template:{tpl.digest[:12]}", block_head=full[:i_m], block_tail=full[end:cut],
                     task_head=full[cut:i_t], task_tail=full[i_t + len(_TASK):], probe="", template=tpl)
    # the derived parts must give what the template renders, with other texts than the placeholders
    check = tpl.render([{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi there"}],
                       add_generation_prompt=True, now=day)
    if fmt.prefix("You help.") + fmt.continuation("Hi there") != check:
        raise TemplateError(f"template {tpl.name!r} renders a text differently from its placeholders")
    return fmt


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
