"""An ordinary tool-using agent loop, written only against the `openai` package.

Nothing here knows about graftmem: point ``--base-url`` at any OpenAI-compatible server. Against
``graftmem serve``, the long, stable part of every request (the system prompt with its skill manual,
the tool description and the worked examples) is grafted from verified KV-cache blocks instead of
prefilled, from the second call on and after a server restart too; each step prints its time to first
token and ``usage.prompt_tokens_details.cached_tokens``.

    graftmem serve --port 8765 &
    python examples/openai_agent/agent.py                       # cold: the server learns the prefix
    # restart the server, then:
    python examples/openai_agent/agent.py                       # warm: cached_tokens > 0 from step 1

Options: --base-url (default $OPENAI_BASE_URL or http://127.0.0.1:8765/v1), --task, --max-steps,
--max-tokens, --json (one JSON object with every step, for scripts and tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from openai import OpenAI

MANUAL = {
    "returns": "Returns: items can be returned within 30 days of delivery, unused and in their box. The "
               "customer prints the return label from their account; the refund follows once the warehouse "
               "has checked the parcel.",
    "refunds": "Refunds: a refund goes to the original payment method within 14 days. A damaged or broken "
               "item is refunded in full once the customer sends a photo of the damage and the receipt; the "
               "customer does not need to send the item back.",
    "shipping": "Shipping: parcels ship on Mondays and Thursdays. Standard delivery takes 3 to 5 working days; "
                "express takes 1 day and costs 9 EUR.",
    "warranty": "Warranty: electrical items have a 2-year warranty. A fault after 30 days is a warranty case: "
                "the item is repaired or replaced, not refunded.",
    "escalation": "Escalation: escalate to a manager when a customer asks for more than 500 EUR, threatens "
                  "legal action, or has contacted us more than 3 times about the same order.",
}

SYSTEM = ("You are the support agent of an online shop. For every question, first call the lookup tool to "
          "read the skill manual, then answer in one or two sentences from what it says.")

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Read the section of the skill manual about one topic: "
                                     + ", ".join(MANUAL) + ".",
    "parameters": {"type": "object", "properties": {"topic": {"type": "string", "enum": list(MANUAL)}},
                   "required": ["topic"]}}}]


def lookup(topic: str) -> str:
    """The tool: the manual section whose name (or words) best match ``topic``."""
    words = set(re.findall(r"[a-z]+", str(topic).lower()))
    best = max(MANUAL, key=lambda k: (k in words or k.rstrip("s") in words, len(words & set(MANUAL[k].lower().split()))))
    return MANUAL[best]


def worked_example(question: str, topic: str, answer: str, i: int) -> list[dict]:
    """A solved exchange in the conversation, so that even a small model follows the tool format."""
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"example_{i}", "type": "function",
                 "function": {"name": "lookup", "arguments": json.dumps({"topic": topic})}}]},
            {"role": "tool", "tool_call_id": f"example_{i}", "content": lookup(topic)},
            {"role": "assistant", "content": answer}]


EXAMPLES = (worked_example("How do returns work?", "returns",
                           "You can return it within 30 days, unused and in its box.", 1)
            + worked_example("When do parcels ship?", "shipping", "Parcels ship on Mondays and Thursdays.", 2))


def step(client: OpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed call: the text, the tool calls (assembled from their deltas), TTFT and usage."""
    t0 = time.perf_counter()
    first, text, calls, usage, finish = None, "", {}, None, None
    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if first is None and (delta.content or delta.tool_calls):
            first = time.perf_counter() - t0
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += tc.id or ""
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"ttft_ms": round((first if first is not None else time.perf_counter() - t0) * 1e3, 1),
            "text": text, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None}


def run(client: OpenAI, model: str, task: str, max_steps: int, max_tokens: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLES, {"role": "user", "content": task}]
    steps = []
    for _ in range(max_steps):
        s = step(client, model, messages, max_tokens)
        steps.append(s)
        if not s["tool_calls"]:
            break
        messages.append({"role": "assistant", "content": s["text"] or None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in s["tool_calls"]]})
        for c in s["tool_calls"]:
            try:
                args = json.loads(c["arguments"] or "{}")
            except ValueError:
                args = {}
            s.setdefault("tool_results", []).append(result := lookup(args.get("topic", "")))
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    return {"task": task, "answer": steps[-1]["text"], "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description="A tool-using support agent over any OpenAI-compatible server.")
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8765/v1"))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="A customer's kettle arrived broken. How do refunds work for it?")
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0)
    out = run(client, args.model, args.task, args.max_steps, args.max_tokens)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for i, s in enumerate(out["steps"], 1):
        what = "; ".join(f"{c['name']}({c['arguments']})" for c in s["tool_calls"]) or repr(s["text"])
        print(f"step {i}: TTFT {s['ttft_ms']:.0f} ms, {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens "
              f"cached -> {what}")
    print(f"answer: {out['answer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
