"""The prompt-cache side channel between tenants (issue 24): tenant B's first request for a prefix only
tenant A sent, right after A's request (A's cells are in the engine), against B's first request for a
random prefix of the same shape. Before tenants, B got ``cached_tokens`` > 0 and a faster answer for A's
prefix (36 vs 0 cached tokens, 200 ms vs 436-757 ms in the red team's run).

    python -m bench.tenants [--repeats 6]    # prints a table, writes bench/results/tenants.json

SmolLM2, one engine, ``min_prefix_tokens=16``, ``sightings=1``, every B request from a fresh tenant.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import openai

from bench.harness import RESULTS, engine, prose, summary, write_results
from graftmem import Store
from graftmem.server import ApiKeys, api_server, hash_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=str(RESULTS / "tenants.json"))
    args = ap.parse_args()
    n = args.repeats
    keys = {"alice": "alice-key-0123456789", **{f"b{i}": f"tenant-b-key-{i}-0123456789" for i in range(2 * n)}}
    secret = [{"role": "system", "content": "Alice's door code is 7311. " + prose(150, 3)},
              {"role": "user", "content": "Hi"}]
    with engine("smollm2") as eng, tempfile.TemporaryDirectory() as d:
        (Path(d) / "keys").write_text("".join(f"{k} {hash_key(v)}\n" for k, v in keys.items()))
        store = Store(Path(d) / "home")
        try:
            with api_server(store, [eng], api_key=ApiKeys.load(Path(d) / "keys"), min_prefix_tokens=16,
                            sightings=1) as srv:
                def ask(key: str, msgs: list) -> tuple[float, int]:
                    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=300)
                    t0 = time.monotonic()
                    r = c.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0)
                    return time.monotonic() - t0, r.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]

                ask(keys["alice"], secret)
                srv.pipeline.wait_idle()
                rows: dict[str, list[tuple[float, int]]] = {"A's prefix": [], "random prefix": [], "A again": []}
                for i in range(n):
                    ask(keys["alice"], secret)  # A's cells are in the engine now
                    rows["A's prefix"].append(ask(keys[f"b{i}"], secret))
                    srv.pipeline.wait_idle()
                    ask(keys["alice"], secret)
                    other = [{"role": "system", "content": "Alice's door code is 7311. " + prose(150, 50 + i)},
                             {"role": "user", "content": "Hi"}]
                    rows["random prefix"].append(ask(keys[f"b{n + i}"], other))
                    srv.pipeline.wait_idle()
                    rows["A again"].append(ask(keys["alice"], secret))
        finally:
            store.close()
    out = {}
    print("| request | n | median ms | min ms | max ms | cached_tokens seen |\n| --- | --- | --- | --- | --- | --- |")
    for name, xs in rows.items():
        ts = [t * 1e3 for t, _ in xs]
        out[name] = {"ms": ts, "cached_tokens": [c for _, c in xs]}
        s = summary(ts)
        print(f"| {'B, first, ' if name != 'A again' else ''}{name} | {s['n']} | {s['median']:.0f} | "
              f"{s['min']:.0f} | {s['max']:.0f} | {sorted({c for _, c in xs})} |")
    write_results(args.out, out, args=args, indent=1)


if __name__ == "__main__":
    main()
