"""A model's own chat template (``tokenizer.chat_template`` in the GGUF, or a file the user passes),
rendered with a sandboxed jinja2 the way transformers and llama-cpp-python render it.

Why the model's template and not a hand-written format: a model answers well only to the prompt
shape it was tuned on, and every peer (llama-server ``--jinja``, vLLM, LM Studio, Ollama,
llama-cpp-python's ``Jinja2ChatFormatter``) renders the GGUF's template. A request to graftmem must be
token for token the prompt its template renders, or a graft is exact against a prompt nobody asked for.

The environment is transformers' (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson``
without HTML escaping and with ``indent`` / ``separators`` / ``sort_keys``, ``raise_exception``,
``strftime_now``, the ``{% generation %}`` tag rendered as its body), sandboxed: templates are data from
a file, so attribute access to Python internals is refused. The immutable sandbox is tried first; a
template that mutates a list (Kimi's ``.append``) is rendered in the mutable sandbox, which still refuses
internals.

Special tokens: where the vocabulary adds BOS by itself and the template also writes it, the BOS text is
removed from the rendered text (as llama-server does), so the prompt holds one BOS, not two.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from .errors import ConfigError

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["ChatTemplate", "TemplateError", "load_template", "model_template", "reserved_kwargs", "today"]

log = logging.getLogger("graftmem")


#: The longest text a render may produce (characters): as long as any text a verb accepts
#: (`graftmem.memory.validate.MAX_TEXT_CHARS`); no context holds more.
MAX_RENDER_CHARS = 4 << 20


class TemplateError(ConfigError):
    """A chat template failed to render (its own ``raise_exception`` or a jinja error)."""


#: The names a render sets itself (`ChatTemplate.render`'s arguments and what it puts in the context).
_RENDER_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                           "strftime_now", "now", "self"})


def reserved_kwargs() -> frozenset[str]:
    """The names a render's ``kwargs`` (a request's ``chat_template_kwargs``) may not take: the render's own
    (``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ...) and the environment's globals
    (``raise_exception``, ``namespace``, ``range``, ...). One of them would replace the conversation, the BOS
    text or a helper the template calls (or collide with the render's arguments: a ``TypeError``, a 500)."""
    return _RENDER_NAMES | frozenset(_envs()[0].globals)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping (jinja's default escapes <, >, & and '); a generator
    # (``tools | map(...)``) is a list, as in llama.cpp's own Jinja engine
    return json.dumps(_plain(x), ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _plain(x: Any) -> Any:
    if isinstance(x, (list, tuple)) or hasattr(x, "__next__"):
        return [_plain(v) for v in x]
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _environments() -> tuple[Any, Any]:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    out = []
    for cls in (ImmutableSandboxedEnvironment, SandboxedEnvironment):
        env = _bounded(cls)(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                            extensions=[Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.filters = {k: _bounded_filter(f) for k, f in env.filters.items()}
        env.globals["raise_exception"] = raise_exception
        out.append(env)
    return out[0], out[1]


#: The largest number a template may hand to an operation that allocates by it (a repeat count, a
#: width, an exponent): one C call allocating gigabytes is not interrupted by the render's time budget
#: (`graftmem.core.budget`), so it is refused before it starts. jinja's sandbox already caps ``range``.
MAX_TEMPLATE_SIZE = 1 << 20


def _too_big(*values: Any) -> bool:
    return any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_TEMPLATE_SIZE for v in values)


def _bounded(cls: Any) -> Any:
    """``cls`` (a jinja sandbox) whose ``*``, ``**`` and ``%`` and whose calls refuse sizes over
    `MAX_TEMPLATE_SIZE`: ``"x" * 10**9``, ``2 ** 10**9``, ``"%0999999999d" % 1``, ``s.ljust(10**9)``."""
    from jinja2.exceptions import SecurityError

    class Bounded(cls):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
                big = len(left) * right > MAX_TEMPLATE_SIZE
            elif operator == "*" and isinstance(right, (str, list, tuple)) and isinstance(left, int):
                big = len(right) * left > MAX_TEMPLATE_SIZE
            elif operator == "**":
                big = _too_big(right) or (isinstance(right, int) and isinstance(left, int)
                                          and abs(left).bit_length() * abs(right) > MAX_TEMPLATE_SIZE)
            elif operator == "%" and isinstance(left, str):
                big = any(int(w) > MAX_TEMPLATE_SIZE for w in re.findall(r"%[-+ #0]*(\d+)", left))
            else:
                big = False
            if big:
                raise SecurityError(f"the template asks for an operation over {MAX_TEMPLATE_SIZE} items")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            if _too_big(*args, *kwargs.values()):
                raise SecurityError(f"the template passes a number over {MAX_TEMPLATE_SIZE} to {__obj!r:.60}")
            return super().call(__context, __obj, *args, **kwargs)

    return Bounded


def _bounded_filter(fn: Any) -> Any:
    """A filter that refuses a number argument over `MAX_TEMPLATE_SIZE` (``center(10**9)``, ``indent``...):
    filters are called directly by the compiled template, not through the sandbox's ``call``."""
    from jinja2.exceptions import SecurityError

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _too_big(*args[1:], *kwargs.values()):
            raise SecurityError(f"the template passes a number over {MAX_TEMPLATE_SIZE} to a filter")
        return fn(*args, **kwargs)

    return run


_ENVS: Optional[tuple[Any, Any]] = None


def _envs() -> tuple[Any, Any]:
    global _ENVS
    if _ENVS is None:
        _ENVS = _environments()
    return _ENVS


@dataclass
class ChatTemplate:
    """One jinja chat template and the special-token texts it is rendered with.

    ``now`` pins what ``strftime_now`` returns (a template that writes today's date into its system
    block, as GPT-OSS does, would otherwise render another prompt tomorrow); None means the clock.
    """

    source: str
    name: str = "model"
    bos_token: str = ""
    eos_token: str = ""
    strip_bos: bool = False  #: the vocabulary adds BOS itself: drop a leading BOS text from renders
    now: Optional[_dt.datetime] = None
    _compiled: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)
    _supports_system: Optional[bool] = field(default=None, repr=False, compare=False)

    @property
    def digest(self) -> str:
        """SHA-256 of the template text: what a block learned through it records."""
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    @property
    def uses_tools(self) -> bool:
        """Whether the template renders a request's ``tools`` at all (SmolLM2's, Gemma 3's do not)."""
        return "tools" in self.source

    def _template(self, mutable: bool) -> Any:
        key = int(mutable)
        if key not in self._compiled:
            import jinja2

            try:
                self._compiled[key] = _envs()[key].from_string(self.source)
            except jinja2.exceptions.TemplateError as exc:
                raise TemplateError(f"chat template {self.name!r} does not compile: {exc}") from exc
        return self._compiled[key]

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               tools: Optional[Sequence[Mapping[str, Any]]] = None,
               documents: Optional[Sequence[Mapping[str, Any]]] = None,
               now: Optional[_dt.datetime] = None, **kwargs: Any) -> str:
        """The template's text for ``messages``; ``kwargs`` are ``chat_template_kwargs`` such as
        ``enable_thinking`` or ``reasoning_effort``; ``now`` pins ``strftime_now`` for this render
        (else the template's ``now``, else the clock). BOS is dropped where the vocabulary adds it. A
        ``kwargs`` name the render sets itself (`reserved_kwargs`) is a `TemplateError`."""
        if clash := sorted(reserved_kwargs() & kwargs.keys()):
            raise TemplateError(f"chat template kwargs {', '.join(clash)} are set by the render itself")
        msgs = [dict(m) for m in messages]
        if msgs and msgs[0].get("role") == "system" and not self.supports_system:
            # as llama.cpp does for templates that refuse a system role (Gemma 2): its text opens the
            # first user message
            first = next((i for i, m in enumerate(msgs) if m.get("role") == "user"), None)
            sys_text = str(msgs[0].get("content") or "")
            if first is None:
                msgs = [{"role": "user", "content": sys_text}] + msgs[1:]
            else:
                msgs[first] = {**msgs[first], "content": f"{sys_text}\n\n{msgs[first].get('content') or ''}"}
                msgs = msgs[1:]
        return self._render(msgs, add_generation_prompt=add_generation_prompt, tools=tools,
                            documents=documents, now=now, **kwargs)

    @property
    def supports_system(self) -> bool:
        """Whether the template accepts a system message (Gemma 2's raises on one)."""
        if self._supports_system is None:
            try:
                out = self._render([{"role": "system", "content": "GRAFTMEMSYSQZ"},
                                    {"role": "user", "content": "hi"}], add_generation_prompt=True)
                self._supports_system = "GRAFTMEMSYSQZ" in out
            except TemplateError:
                self._supports_system = False
        return self._supports_system

    def _render(self, msgs: list[dict[str, Any]], *, add_generation_prompt: bool,
                tools: Optional[Sequence[Mapping[str, Any]]] = None,
                documents: Optional[Sequence[Mapping[str, Any]]] = None,
                now: Optional[_dt.datetime] = None, **kwargs: Any) -> str:
        import jinja2
        from jinja2.exceptions import SecurityError

        now = now or self.now

        def strftime_now(fmt: str) -> str:
            return (now or _dt.datetime.now()).strftime(fmt)

        ctx = {"messages": msgs, "add_generation_prompt": add_generation_prompt,
               "bos_token": self.bos_token, "eos_token": self.eos_token, "strftime_now": strftime_now,
               **kwargs}
        if tools is not None:
            ctx["tools"] = [dict(t) for t in tools]
        if documents is not None:
            ctx["documents"] = [dict(d) for d in documents]
        text = None
        for mutable in (False, True):
            try:
                text = self._template(mutable).render(**ctx)
                break
            except SecurityError:
                if mutable:
                    raise TemplateError(f"chat template {self.name!r} does something the sandbox refuses") from None
                continue  # e.g. Kimi's list.append: render in the mutable sandbox
            except jinja2.exceptions.TemplateError as exc:
                raise TemplateError(f"chat template {self.name!r}: {exc}") from exc
            except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
                raise TemplateError(f"chat template {self.name!r} failed on these messages: {exc!r}") from exc
        assert text is not None
        if len(text) > MAX_RENDER_CHARS:
            raise TemplateError(f"chat template {self.name!r} rendered {len(text)} characters, over the "
                                f"{MAX_RENDER_CHARS}-character limit")
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


def today() -> _dt.datetime:
    """Midnight of today: what renders pin ``strftime_now`` to. Every render of one request (the whole
    prompt and its growing prefixes) must see the same time, or a template that prints the time would
    never extend; a day's granularity keeps a template that prints the date (GPT-OSS, Llama 3.2)
    rendering the same prefix, hence grafting it, all day."""
    return _dt.datetime.combine(_dt.date.today(), _dt.time())


def load_template(path: str | Path, engine: Optional["Engine"] = None) -> ChatTemplate:
    """A template file (llama-server's ``--chat-template-file``), with ``engine``'s special tokens."""
    p = Path(path)
    try:
        source = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read chat template {p}: {exc}") from exc
    return _with_tokens(ChatTemplate(source=source, name=p.name), engine)


def model_template(engine: "Engine") -> Optional[ChatTemplate]:
    """The GGUF's own ``tokenizer.chat_template``, or None if it has none."""
    source = engine.chat_template()
    if not source:
        return None
    return _with_tokens(ChatTemplate(source=source, name=engine.fingerprint.model_name), engine)


def _with_tokens(tpl: ChatTemplate, engine: Optional["Engine"]) -> ChatTemplate:
    if engine is not None:
        toks = engine.special_tokens()
        tpl.bos_token, tpl.eos_token = toks["bos_text"], toks["eos_text"]
        tpl.strip_bos = bool(toks["add_bos"])
    return tpl
