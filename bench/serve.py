"""Time to first token through the OpenAI-compatible API: an agent that re-sends a long system prompt,
served cold (cache off), warm (its prefix learned), and warm after a server restart on the same home.

The three ways are interleaved per round (the machine is noisy); the table reports medians and the
ratio to cold. The answers are also compared: a warm answer must equal the cold one, token for token.

    python bench/serve.py [--words 1100] [--rounds 3]

This is the first half of the issue's bench (no llama-server / llama-cpp-python server next to it yet).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import openai

from graftmem.core import Engine
from graftmem.server import api_server
from graftmem.store import Store

HERE = Path(__file__).resolve().parent


def manual(n_words: int) -> str:
    import random

    rng = random.Random(7)
    vocab = ("refund order ticket customer shipping label parcel warehouse policy receipt invoice step check "
             "before after always never escalate manager note account code date window").split()
    return "You are the support agent. Follow this manual.\n" + " ".join(rng.choice(vocab) for _ in range(n_words))


def ttft(client: openai.OpenAI, messages: list, cache: bool) -> tuple[float, str]:
    t0 = time.perf_counter()
    first = None
    parts = []
    for ch in client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, stream=True,
                                             extra_body={"graftmem": {"cache": cache}}):
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
    return (first if first is not None else time.perf_counter() - t0) * 1e3, "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=1100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="graftmem-bench-serve-"))
    system = manual(args.words)
    turns = [{"role": "system", "content": system}, {"role": "user", "content": "A customer wants a refund."},
             {"role": "assistant", "content": "I will check the receipt first."},
             {"role": "user", "content": "What do you do next?"}]
    times: dict[str, list[float]] = {"cold": [], "warm": [], "restart": []}
    equal = True
    with Engine("smollm2") as eng:
        n_prompt = sum(len(eng.tokenize(m["content"])) for m in turns)
        store = Store(home)
        with api_server(store, [eng], min_prefix_tokens=64) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            ttft(c, turns, True), ttft(c, turns, True)  # two sightings: the prefix is learned
            for _ in range(args.rounds):
                cold_ms, cold_text = ttft(c, turns, False)
                warm_ms, warm_text = ttft(c, turns, True)
                times["cold"].append(cold_ms)
                times["warm"].append(warm_ms)
                equal &= cold_text == warm_text
        for _ in range(args.rounds):  # a fresh server on the same home, its first request each time
            with api_server(store, [eng]) as srv:
                c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
                ms, text = ttft(c, turns, True)
                times["restart"].append(ms)
                equal &= text == cold_text
        store.close()
    cold = statistics.median(times["cold"])
    rows = [(k, statistics.median(v), min(v), max(v), cold / statistics.median(v)) for k, v in times.items()]
    print(f"SmolLM2-135M, prompt ~{n_prompt} tokens, {args.rounds} rounds; warm answers equal cold: {equal}")
    print(f"{'way':<10}{'TTFT median ms':>16}{'min':>10}{'max':>10}{'x vs cold':>12}")
    for k, med, lo, hi, ratio in rows:
        print(f"{k:<10}{med:>16.1f}{lo:>10.1f}{hi:>10.1f}{ratio:>12.1f}")
    out = {"prompt_tokens": n_prompt, "rounds": args.rounds, "answers_equal": equal, "ttft_ms": times}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "serve.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
