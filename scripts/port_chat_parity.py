"""Port the parse cases of llama.cpp's ``tests/test-chat.cpp`` (the pinned llama-cpp-python 0.3.36 sdist)
to tests/data/chat_parity.json, as data: each case keeps the sdist file:line it came from.

A case is ``tst.test(INPUT)`` with its settings (tools, reasoning format, enable_thinking) and its
expected message (content, reasoning, calls), for the templates whose family graftmem parses. Left
out, and counted: partial parses (``is_partial``: a stream's intermediate state, which graftmem does
not expose), continuations of a prefilled message (``messages`` / ``continue_final_message``),
``json_schema`` and ``tool_choice`` cases (a grammar decides the shape), the legacy reasoning format,
inputs that are not plain string literals.

    python scripts/port_chat_parity.py            # print the summary
    python scripts/port_chat_parity.py --write    # and rewrite tests/data/chat_parity.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "chat_parity.json"
MEMBER = "llama_cpp_python-0.3.36/vendor/llama.cpp/tests/test-chat.cpp"
SRC = "vendor/llama.cpp/tests/test-chat.cpp"


def _tiny():
    sys.path.insert(0, str(ROOT / "scripts"))
    import tiny_models

    return tiny_models


def _source() -> str:
    """test-chat.cpp from the pinned sdist (extracted once next to the sdist's other parts)."""
    tiny = _tiny()
    kept = tiny.cache_root() / "llama-cpp-python-0.3.36-test-chat.cpp"
    if not kept.exists():
        with tarfile.open(tiny.cache_root() / "sdist" / tiny.SDIST_FILE) as tf:
            f = tf.extractfile(MEMBER)
            assert f is not None
            tmp = kept.with_name(kept.name + ".tmp")
            tmp.write_bytes(f.read())
            tmp.replace(kept)
    return kept.read_text(encoding="utf-8")


def prompt_tail(template: str, tools: list[str], thinking: bool) -> str:
    """The end of the prompt graftmem's template layer renders for one user turn with these tools: where
    a template opens the think block (what the server's answer rule reads, `graftmem.server.tools.answer_spec`)."""
    sys.path.insert(0, str(ROOT))
    from graftmem.core.template import ChatTemplate

    tpl = ChatTemplate((_tiny().templates_dir() / f"{template}.jinja").read_text(), name=template,
                       bos_token="<s>", eos_token="</s>")
    fns = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in dict.fromkeys(tools)]
    try:
        return tpl.render([{"role": "user", "content": "Hello"}], add_generation_prompt=True, tools=fns or None,
                          enable_thinking=thinking)[-200:]
    except Exception:  # noqa: BLE001 - a template that needs more than one user turn: its tail is unknown
        return ""


#: cases graftmem reads differently, by template (and line where not all of it): why. tests/test_answer_parity.py
#: checks they still differ, so one that starts to agree is taken off here.
KNOWN: dict[str, str] = {
    "Kimi-K3": "Kimi K3's <|open|>/<|close|> markup is not a family graftmem parses yet",
    "meetkai-functionary-medium-v3.2": "Functionary v3.2's >>>recipient format is not a family graftmem parses",
    "Apriel-1.6-15b-Thinker-fixed": "Apriel 1.6's reasoning starts in the prompt ('Here are my reasoning steps:') and ends at "
                                    "[BEGIN FINAL RESPONSE]: not reasoning tags graftmem reads",
    "muse-glimmer": "muse's to=user<|message|> channel header is not parsed",
    "StepFun3.5-Flash:6615": "an argument's type comes from the tool's schema in llama.cpp (a string stays a string)",
    "StepFun3.5-Flash:6703": "an argument's type comes from the tool's schema in llama.cpp (quotes kept for a string)",
    "StepFun3.5-Flash:6721": "an argument's type comes from the tool's schema in llama.cpp (quotes kept for a string)",
    "MiniMax-M3:5793": "an argument's type comes from the tool's schema in llama.cpp (nested tags kept as a string)",
}


def known(case: dict[str, Any]) -> Optional[str]:
    line = case["src"].rsplit(":", 1)[1]
    return KNOWN.get(f"{case['template']}:{line}") or KNOWN.get(case["template"])


_ESC = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}


def _literals(s: str, i: int) -> tuple[Optional[str], int]:
    """Adjacent C++ string literals at ``s[i]`` (after whitespace / comments): their text and the end."""
    out: list[str] = []
    while True:
        while True:
            m = re.compile(r"\s+|//[^\n]*|/\*.*?\*/", re.S).match(s, i)
            if not m or m.end() == i:
                break
            i = m.end()
        if s.startswith('R"', i):
            d = s.index("(", i)
            delim = s[i + 2:d]
            end = s.index(")" + delim + '"', d)
            out.append(s[d + 1:end])
            i = end + len(delim) + 2
        elif s.startswith('"', i):
            j, buf = i + 1, []
            while s[j] != '"':
                if s[j] == "\\":
                    c = s[j + 1]
                    if c == "u":
                        buf.append(chr(int(s[j + 2:j + 6], 16)))
                        j += 6
                        continue
                    if c == "x":
                        m = re.compile(r"[0-9a-fA-F]+").match(s, j + 2)
                        assert m
                        buf.append(chr(int(m.group(0), 16)))
                        j = m.end()
                        continue
                    buf.append(_ESC[c])
                    j += 2
                else:
                    buf.append(s[j])
                    j += 1
            out.append("".join(buf))
            i = j + 1
        else:
            return ("".join(out) if out else None), i


def _args(s: str, i: int) -> tuple[str, int]:
    """The text between the parenthesis at ``s[i]`` and its match (strings skipped)."""
    assert s[i] in "({"
    depth, j = 0, i
    while True:
        c = s[j]
        if s.startswith('R"', j) or c == '"':
            _, j = _literals(s, j)
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return s[i + 1:j], j + 1
        j += 1


def _split_top(s: str) -> list[str]:
    """``s`` split at top-level commas."""
    parts, depth, j, start = [], 0, 0, 0
    while j < len(s):
        c = s[j]
        if s.startswith('R"', j) or c == '"':
            _, j = _literals(s, j)
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
        j += 1
    if s[start:].strip():
        parts.append(s[start:])
    return [p.strip() for p in parts]


def _str(expr: str) -> str:
    text, end = _literals(expr, 0)
    if text is None or expr[end:].strip():
        raise ValueError(f"not a string literal: {expr[:60]}")
    return text


def _msg(expr: str, named: dict[str, dict[str, Any]]) -> dict[str, Any]:
    expr = expr.strip()
    if re.fullmatch(r"\w+", expr):
        return json.loads(json.dumps(named[expr]))
    m = re.match(r"(\w+)\s*\(", expr)
    if not m:
        raise ValueError(expr[:60])
    body, _ = _args(expr, m.end() - 1)
    a = _split_top(body)
    fn = m.group(1)

    def msg(content: str = "", reasoning: str = "", name: str = "", args: str = "", cid: str = "") -> dict[str, Any]:
        calls = [{"name": name, "arguments": args, "id": cid}] if name or cid else []
        return {"content": content, "reasoning": reasoning, "tool_calls": calls}

    if fn == "simple_assist_msg":
        return msg(*[_str(x) for x in a])
    if fn == "message_with_tool_calls":
        return msg("", "", _str(a[0]), _str(a[1]))
    if fn in ("message_with_tool_calls_and_reasoning",):
        return msg("", _str(a[2]), _str(a[0]), _str(a[1]))
    if fn == "message_with_content_and_tool_call":
        return msg(_str(a[0]), "", _str(a[1]), _str(a[2]))
    if fn == "message_with_reasoning_and_tool_call":
        return msg("", _str(a[0]), _str(a[1]), _str(a[2]))
    if fn == "message_with_reasoning_content_and_multiple_tool_calls":
        calls = []
        for pair in _split_top(a[2].strip()[1:-1]):
            n, v = _split_top(pair.strip()[1:-1])
            calls.append({"name": _str(n), "arguments": _str(v), "id": ""})
        return {"content": _str(a[1]), "reasoning": _str(a[0]), "tool_calls": calls}
    raise ValueError(f"unknown message builder {fn}")


def port(render: bool = True) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The cases and the counts of those left out, by reason; ``render=False``: without their prompt tails
    (rendering every template takes most of the time)."""
    src = _source()
    line_of = lambda i: src.count("\n", 0, i) + 1  # noqa: E731
    named: dict[str, dict[str, Any]] = {}
    for m in re.finditer(r"const common_chat_msg (\w+)\s*=\s*", src):
        end = src.index(";", m.end())
        try:
            named[m.group(1)] = _msg(src[m.end():end], named)
        except (ValueError, KeyError, IndexError):
            pass
    tools: dict[str, str] = {}
    for m in re.finditer(r"static common_chat_tool (\w+)\s*\{", src):
        name, _ = _literals(src, m.end())
        if name:
            tools[m.group(1)] = name
    testers: dict[str, list[tuple[int, list[str]]]] = {}  # variable -> (position, templates)
    for m in re.finditer(r'auto (\w+)\s*=\s*peg_tester\(([^,)]+)', src):
        arg = m.group(2).strip()
        if arg.startswith('"'):
            names = [_str(arg)]
        else:  # a loop over template paths: for (const auto & path : { "a", "b" })
            loops = list(re.finditer(r"for\s*\(const auto &\s*" + re.escape(arg) + r"\s*:\s*\{([^}]*)\}", src[:m.start()]))
            names = [_str(x) for x in _split_top(loops[-1].group(1))] if loops else []
        names = [n.removeprefix("models/templates/").removesuffix(".jinja") for n in names]
        testers.setdefault(m.group(1), []).append((m.start(), names))
    cases, skipped = [], {}

    def skip(why: str) -> None:
        skipped[why] = skipped.get(why, 0) + 1

    for m in re.finditer(r"\b(\w+)\.test\(", src):
        var = m.group(1)
        if var not in testers:
            continue
        line_start = src.rfind("\n", 0, m.start()) + 1
        if src[line_start:m.start()].lstrip().startswith("//"):
            continue  # a commented-out case
        tpl = [t for pos, t in testers[var] if pos < m.start()]
        if not tpl or not tpl[-1]:
            continue
        inner, j = _args(src, m.end() - 1)
        text, end = _literals(inner, 0)
        if text is None or inner[end:].strip():
            skip("input not a string literal")
            continue
        case: dict[str, Any] = {"src": f"{SRC}:{line_of(m.start())}", "template": tpl[-1][0], "input": text,
                                "tools": [], "reasoning_format": "none", "enable_thinking": True,
                                "expect": {"content": "", "reasoning": "", "tool_calls": []}}
        why = None
        while True:
            mm = re.compile(r"(?:\s|//[^\n]*)*\.\s*(\w+)\(").match(src, j)
            if not mm:
                break
            body, j = _args(src, mm.end() - 1)
            meth = mm.group(1)
            try:
                if meth == "run":
                    break
                if meth == "tools":
                    case["tools"] = [tools[t] for t in _split_top(body.strip()[1:-1])]
                elif meth == "reasoning_format":
                    case["reasoning_format"] = body.strip().replace("COMMON_REASONING_FORMAT_", "").lower()
                elif meth == "enable_thinking":
                    case["enable_thinking"] = body.strip() == "true"
                elif meth == "parallel_tool_calls":
                    case["parallel"] = body.strip() == "true"
                elif meth == "is_partial":
                    why = why or ("partial parse" if body.strip() == "true" else None)
                elif meth in ("messages", "continue_final_message", "add_generation_prompt"):
                    why = why or "continuation of a prefilled message"
                elif meth in ("json_schema", "tool_choice"):
                    why = why or f"{meth}: a grammar decides the shape"
                elif meth == "expect":
                    case["expect"] = _msg(body, named)
                elif meth == "expect_content":
                    case["expect"]["content"] = _str(body)
                elif meth == "expect_reasoning":
                    case["expect"]["reasoning"] = _str(body)
                elif meth == "expect_tool_calls":
                    calls = []
                    for c in _split_top(body.strip()[1:-1]):
                        parts = [("" if x.strip() == "{}" else _str(x)) for x in _split_top(c.strip()[1:-1])]
                        calls.append({"name": parts[0], "arguments": parts[1], "id": parts[2] if len(parts) > 2 else ""})
                    case["expect"]["tool_calls"] = calls
                elif meth == "expect_reconstruction":
                    pass
                else:
                    why = why or f"setting {meth}"
            except (ValueError, KeyError, IndexError) as exc:
                why = why or f"not portable ({type(exc).__name__}: {str(exc)[:30]})"
        if case["reasoning_format"] == "deepseek_legacy":
            why = why or "legacy reasoning format"
        if why:
            skip(why)
            continue
        for name in tpl[-1]:
            one = {**case, "template": name, "expect": json.loads(json.dumps(case["expect"])),
                   "prompt_tail": prompt_tail(name, case["tools"], case["enable_thinking"]) if render else ""}
            if (why := known(one)) is not None:
                one["known"] = why
            cases.append(one)
    return cases, skipped


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    cases, skipped = port()
    sys.stdout.write(f"{len(cases)} cases ported; left out: {json.dumps(skipped, sort_keys=True)}\n")
    if args.write:
        OUT.write_text(json.dumps({"source": "llama-cpp-python 0.3.36 sdist, " + SRC, "left_out": skipped,
                                   "cases": cases}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
