"""Routing benchmark: accuracy (tuning and held-out sets, dense vs hybrid), passage routing in real
prose, the min_score trade-off, route latency at 100 and 10,000 blocks, and recall with graft vs the
text way on a ~1,000-token manual.

    python -m bench.routing [--reps 3] [--synthetic 10000] [--home DIR] [--out bench/results/routing.json]
    python -m bench.routing --quality-only      # sections 0 and 0b only (no LLM prefill; a few minutes)

0. **Quality, tuning vs held-out** (free-standing routers over the manuals' texts, no store): top-1 on
   the tuning set (bench/routing_set.py: 72 phrasings, 12 manuals) and on the HELD-OUT set
   (bench/routing_heldout.py: 54 phrasings over 18 manuals, written before the router changed, never
   tuned on), for three routers: dense v1 (one route-text vector per block, as index version 1),
   dense + passages, and hybrid (the default: dense mix + lexical coverage); the off-topic tasks of
   each set refused at DEFAULT_MIN_SCORE.
0b. **Passage routing in real prose**: needles in the docstrings of stdlib modules (a tuning set and a
   held-out set, bench/routing_heldout.py) and in bench/needle.py's synthetic corpus; pages planned
   with Gemma 3's tokenizer and indexed (not prefilled); the page of the top passage must hold the
   needle; cosine only vs hybrid.

1. **Accuracy**: 12 manuals learned for real (SmolLM2, chat blocks, with `when_to_use`), 72 labelled
   task phrasings (bench/routing_set.py); top-1 and top-3 accuracy through ``Memory.search``.
2. **min_score sweep**: for each threshold, the in-domain tasks grafted right / grafted wrong /
   refused, and the 24 off-topic tasks grafted (always wrong) / refused.
3. **Route latency, 100 blocks**: the 12 manuals plus 88 short real blocks in a real store; one task
   routed = embed the task + faiss search + the store-change check (``Router.search`` with the
   exact-lookup cache off); also the cached path and ``Memory.search`` (which reads the manifests).
4. **Route latency, 10,000 blocks**: a free-standing index with 10,000 synthetic entries (embedded
   texts) plus the 12 manuals; same query path, and top-1 accuracy among the distractors.
5. **Graft vs text**: a ~1,000-token manual; recall the same tasks with ``mode="graft"`` and
   ``mode="text"`` interleaved in one run; answers and first-step logits SHA-256 must be equal.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import RESULTS, engine, summary, write_results
from bench.routing_heldout import (ALL_MANUALS, DOC_NEEDLES_HELDOUT, DOC_NEEDLES_TUNE, HELDOUT,
                                   HELDOUT_OFF_TOPIC, docstring_document, insert_needles)
from bench.routing_set import LABELLED, MANUALS, OFF_TOPIC
from graftmem import Memory
from graftmem.memory import (DEFAULT_MIN_SCORE, DEFAULT_PAGE_MIN_SCORE, LEX_WEIGHT, ROUTE_WEIGHT,
                             PageIndex, Router, SentenceTransformerEmbedder, plan_document)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: the routers compared in section 0: (label, Router keyword arguments)
VARIANTS = [("dense v1 (route text only)", {"lex_weight": 0.0, "passages": False}),
            ("dense + passages", {"lex_weight": 0.0}),
            ("hybrid (default)", {})]


#: how a route latency is summarised: milliseconds with p50 and p95 (the keys docs/routing.md quotes)
LATENCY = {"unit": "ms", "percentiles": (50, 95)}


def table(rows: list[list], header: list[str]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{x}}}" for x in w)
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in rows])


def filler_blocks(n: int) -> list[tuple[str, str, str]]:
    """n short, distinct, plausible manuals (name, when_to_use, text) built from word lists."""
    import random

    rng = random.Random(7)
    verbs = ["approve", "cancel", "schedule", "audit", "renew", "escalate", "archive", "price", "label",
             "inspect", "translate", "register", "reconcile", "forecast", "onboard", "retire", "migrate",
             "certify", "sample", "quote"]
    things = ["supplier contracts", "fleet vehicles", "warehouse pallets", "lab samples", "trade-show stands",
              "software licences", "office plants", "parking permits", "travel expenses", "server racks",
              "insurance claims", "press releases", "safety drills", "payroll runs", "marketing budgets",
              "customer surveys", "training courses", "visitor badges", "recycling bins", "coffee machines",
              "tax filings", "patent drafts", "social media posts", "loading docks", "print jobs"]
    teams = ["finance", "facilities", "legal", "logistics", "marketing", "security", "research", "sales",
             "procurement", "quality", "IT", "HR"]
    out, seen = [], set()
    while len(out) < n:
        v, t, team = rng.choice(verbs), rng.choice(things), rng.choice(teams)
        k = rng.randrange(10_000)
        name = f"{v}-{t.replace(' ', '-')}-{k}"
        if name in seen:
            continue
        seen.add(name)
        wtu = f"how the {team} team must {v} {t}"
        text = (f"{team.capitalize()} procedure {k}: to {v} {t}, file form {team[:3].upper()}-{k} "
                f"and wait for sign-off from the {team} lead.")
        out.append((name, wtu, text))
    return out


def accuracy_and_sweep(mem: Memory, ids: dict[str, str]) -> dict:
    by_id = {v: k for k, v in ids.items()}
    ranks, top1s, tops = [], [], []
    router, digest = mem.router, mem.fingerprint.digest()

    def ranking(task: str) -> list[tuple[str, float]]:
        # among the 12 manuals only, even when the store holds more blocks (a reused --home)
        hits = router.search(task, len(router), fingerprint_digest=digest, use_cache=False)
        return [(by_id[b], float(sc)) for b, sc in hits if b in by_id]

    for task, want in LABELLED:
        hits = ranking(task)
        names = [n for n, _ in hits]
        ranks.append(names.index(want) + 1 if want in names else 99)
        top1s.append(names[0])
        tops.append(hits[0][1])
    off_scores = [ranking(t)[0][1] for t in OFF_TOPIC]
    n = len(LABELLED)
    correct = [r == 1 for r in ranks]
    misses = [{"task": t, "want": w, "got": g, "score": round(s, 3)}
              for (t, w), g, s, ok in zip(LABELLED, top1s, tops, correct) if not ok]
    sweep = []
    for th in sorted({round(x, 3) for x in np.arange(0.0, 0.601, 0.025)} | {DEFAULT_MIN_SCORE}):
        right = sum(ok and s >= th for ok, s in zip(correct, tops))
        wrong = sum((not ok) and s >= th for ok, s in zip(correct, tops))
        refused = sum(s < th for s in tops)
        off_grafted = sum(s >= th for s in off_scores)
        sweep.append({"min_score": float(th), "in_domain_right": int(right), "in_domain_wrong": int(wrong),
                      "in_domain_refused": int(refused), "off_topic_grafted": int(off_grafted),
                      "off_topic_refused": int(len(off_scores) - off_grafted),
                      "wrong_grafts_total": int(wrong + off_grafted)})
    return {"manuals": len(MANUALS), "phrasings": n, "off_topic": len(OFF_TOPIC),
            "top1": sum(correct) / n, "top3": sum(r <= 3 for r in ranks) / n, "misses": misses,
            "in_domain_top_score": summary(tops, percentiles=(5,)),
            "off_topic_top_score": summary(off_scores, percentiles=(95,)),
            "sweep": sweep}


def free_router(emb, manuals, **kw) -> Router:
    r = Router(emb, **kw)
    r.add_documents([m.name for m in manuals], [(m.name, m.when_to_use, m.manual) for m in manuals])
    return r


def set_quality(r: Router, labelled: list[tuple[str, str]], off_topic: list[str]) -> dict:
    ranked = [(r.search(t, 3, use_cache=False), w) for t, w in labelled]
    off = [r.search(t, 1, use_cache=False)[0][1] for t in off_topic]
    right = [h[0][0] == w for h, w in ranked]
    return {"n": len(labelled), "top1": sum(right), "top3": sum(w in [i for i, _ in h] for h, w in ranked),
            "right_and_kept": sum(ok and h[0][1] >= DEFAULT_MIN_SCORE for ok, (h, _) in zip(right, ranked)),
            "off_topic": len(off), "off_topic_refused": sum(s < DEFAULT_MIN_SCORE for s in off),
            "off_topic_max": max(off),
            "misses": [{"task": t, "want": w, "got": h[0][0], "score": round(h[0][1], 3)}
                       for (h, w), (t, _) in zip(ranked, labelled) if h[0][0] != w]}


def quality(emb) -> dict:
    """Section 0: the three routers on the tuning set and on the held-out set."""
    out = {}
    for label, kw in VARIANTS:
        out[label] = {"tuning": set_quality(free_router(emb, MANUALS, **kw), LABELLED, OFF_TOPIC),
                      "heldout": set_quality(free_router(emb, ALL_MANUALS, **kw), HELDOUT, HELDOUT_OFF_TOPIC)}
    return out


def page_quality(emb, window: int = 1024) -> dict:
    """Section 0b: passage routing on needle sets in real prose and in the synthetic corpus."""
    from bench import needle as needle_bench

    out = {}
    with engine("gemma3-270m") as eng:
        synth_text, synth = needle_bench.make_corpus(eng, 16_000, 7, 0)
        sets = [("docstrings, tuning", *insert_needles(docstring_document(DOC_NEEDLES_TUNE["modules"]),
                                                      DOC_NEEDLES_TUNE["needles"])),
                ("docstrings, HELD-OUT", *insert_needles(docstring_document(DOC_NEEDLES_HELDOUT["modules"]),
                                                        DOC_NEEDLES_HELDOUT["needles"])),
                ("synthetic (bench/needle.py)", synth_text,
                 [{**nd, "question": needle_bench.question(nd["name"])[0]} for nd in synth])]
        for label, text, needles in sets:
            plan = plan_document(eng, text, window=window, document="d")
            home = Path(tempfile.mkdtemp(prefix="graftmem-page-quality-"))
            hybrid = PageIndex(home, emb)
            hybrid.start_document(plan, "fp")
            t0 = time.perf_counter()
            for page in plan.pages:
                hybrid.add_page(plan, page, f"b{page.page}", "fp", embed=True)
            build_s = time.perf_counter() - t0
            row = {"tokens": plan.n_tokens, "pages": len(plan.pages), "passages": len(hybrid),
                   "needles": len(needles), "index_build_s": build_s}
            for name, index in (("cosine only", PageIndex(home, emb, lex_weight=0.0)), ("hybrid", hybrid)):
                hits = [(index.search(nd["question"], 1, fp_digest="fp")[0], nd) for nd in needles]
                ok = [h.page.page in plan.pages_holding(nd["char_start"], nd["char_end"]) for h, nd in hits]
                row[name] = {"routed": sum(ok), "scores": [round(h.score, 3) for h, _ in hits],
                             "above_page_min_score": sum(o and h.score >= DEFAULT_PAGE_MIN_SCORE
                                                         for o, (h, _) in zip(ok, hits)),
                             "misses": [nd["question"] for o, (_, nd) in zip(ok, hits) if not o]}
                row[name]["off_topic_top"] = round(max(index.search(t, 1, fp_digest="fp")[0].score
                                                       for t in OFF_TOPIC), 3)
                index.close()
            out[label] = row
    return out


def print_quality(q: dict, pq: dict) -> None:
    print(f"\n## Routing quality (top-1; off-topic refused at min_score {DEFAULT_MIN_SCORE}; lex_weight "
          f"{LEX_WEIGHT}, route_weight {ROUTE_WEIGHT})")
    rows = []
    for label, r in q.items():
        t, h = r["tuning"], r["heldout"]
        rows.append([label, f"{t['top1']}/{t['n']}", f"{t['off_topic_refused']}/{t['off_topic']}",
                     f"{h['top1']}/{h['n']} ({h['top1'] / h['n'] * 100:.1f}%)", f"{h['top3']}/{h['n']}",
                     f"{h['right_and_kept']}/{h['n']}", f"{h['off_topic_refused']}/{h['off_topic']}"])
    print(table(rows, ["router", "tuning top-1", "tuning off-topic refused", "HELD-OUT top-1",
                       "held-out top-3", "held-out right & >= min_score", "held-out off-topic refused"]))
    for m in q["hybrid (default)"]["heldout"]["misses"]:
        print(f"   held-out miss: {m['task']!r} -> {m['got']} ({m['score']}), want {m['want']}")
    print(f"\n## Passage routing (page of the top passage holds the needle; page min_score "
          f"{DEFAULT_PAGE_MIN_SCORE})")
    print(table([[label, r["tokens"], r["pages"], r["passages"], f"{r['cosine only']['routed']}/{r['needles']}",
                  f"{r['hybrid']['routed']}/{r['needles']}", f"{r['hybrid']['above_page_min_score']}/{r['needles']}",
                  r["cosine only"]["off_topic_top"], r["hybrid"]["off_topic_top"]] for label, r in pq.items()],
                ["needle set", "tokens", "pages", "passages", "cosine only", "hybrid", "hybrid >= min_score",
                 "off-topic max (cos)", "off-topic max (hyb)"]))
    for label, r in pq.items():
        for name in ("cosine only", "hybrid"):
            for m in r[name]["misses"]:
                print(f"   {label}, {name} miss: {m!r}")


def latency(fn, tasks: list[str], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        for t in tasks:
            t0 = time.perf_counter()
            fn(t)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def long_manual(mem: Memory, target: int = 1000) -> str:
    """A ~target-token handbook: the 12 manuals as chapters, cut at a line boundary."""
    parts = [f"Chapter {i + 1}: {m.name}\n{m.manual}\n" for i, m in enumerate(MANUALS)]
    text = "Company operations handbook.\n"
    for p in parts:
        if len(mem.engine.tokenize(text + p)) > target:
            lines = p.splitlines(keepends=True)
            for line in lines:
                if len(mem.engine.tokenize(text + line)) > target:
                    break
                text += line
            break
        text += p
    return text


def graft_vs_text_summary(qs: list[str], rows: list[dict], max_tokens: int) -> dict:
    """Medians per task and overall for one ``max_tokens``; identical = one answer and one logits hash."""
    per_task = []
    for q in qs:
        g = [r for r in rows if r["task"] == q and r["mode"] == "graft"]
        x = [r for r in rows if r["task"] == q and r["mode"] == "text"]
        per_task.append({
            "task": q, "graft_ms": summary(r["ms"] for r in g)["median"],
            "text_ms": summary(r["ms"] for r in x)["median"],
            "graft_ttft_ms": summary(r["ttft_ms"] for r in g)["median"],
            "text_ttft_ms": summary(r["ttft_ms"] for r in x)["median"],
            "graft_decode_ms": summary(r["decode_ms"] for r in g)["median"],
            "text_decode_ms": summary(r["decode_ms"] for r in x)["median"],
            "identical": len({r["text"] for r in g + x}) == 1 and len({r["sha"] for r in g + x}) == 1,
            "answer": g[0]["text"], "decode_tokens": g[0]["decode_tokens"],
            "graft_prefilled": g[0]["prefilled"], "text_prefilled": x[0]["prefilled"]})
    g_all = summary(r["ms"] for r in rows if r["mode"] == "graft")["median"]
    x_all = summary(r["ms"] for r in rows if r["mode"] == "text")["median"]
    return {"max_tokens": max_tokens, "per_task": per_task, "graft_ms_median": g_all, "text_ms_median": x_all,
            "speedup": x_all / g_all,
            "ttft_speedup": summary(r["ttft_ms"] for r in rows if r["mode"] == "text")["median"]
            / summary(r["ttft_ms"] for r in rows if r["mode"] == "graft")["median"],
            "all_identical": all(p["identical"] for p in per_task)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--synthetic", type=int, default=10_000)
    ap.add_argument("--graft-reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[1, 4, 16],
                    help="answer lengths to compare at (1 = the recall call up to its first answer token)")
    ap.add_argument("--out", default=str(RESULTS / "routing.json"))
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads (1: robust on a shared, oversubscribed CPU; both paths use the same)")
    ap.add_argument("--quality-only", action="store_true",
                    help="only sections 0 and 0b (routing quality; no learning, no recall)")
    ap.add_argument("--home", default=None, help="store to (re)use; learning is skipped for blocks already "
                                                 "there (default: a fresh temp dir)")
    args = ap.parse_args()
    res: dict = {"machine": {"load_avg_start": os.getloadavg()[0], "llama_threads": args.threads}}
    emb = SentenceTransformerEmbedder()
    tasks = [t for t, _ in LABELLED]
    t0 = time.perf_counter()
    res["quality"] = quality(emb)
    res["page_quality"] = page_quality(emb)
    print(f"quality sections in {time.perf_counter() - t0:.0f} s")
    print_quality(res["quality"], res["page_quality"])
    if args.quality_only:
        out = Path(args.out).with_name(Path(args.out).stem + "_quality.json")
        write_results(out, res, args=args, default=float)
        print(f"wrote {out}")
        return 0

    home = args.home or tempfile.mkdtemp(prefix="graftmem-routing-bench-")
    with Memory("smollm2", home=home, embedder=emb, config={"n_threads": args.threads}) as mem:
        # ---------------------------------------------------------------- 1+2 accuracy, sweep
        t0 = time.perf_counter()
        ids = {m.name: mem.learn(m.manual, name=m.name, when_to_use=m.when_to_use, chat=True).id
               for m in MANUALS}
        print(f"learned {len(MANUALS)} manuals in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        mem.search("warm up", top_k=1)
        print(f"router ready in {time.perf_counter() - t0:.1f} s (MiniLM load + {len(MANUALS)} embeddings)")
        acc = accuracy_and_sweep(mem, ids)
        res["accuracy"] = acc
        print(f"\n## Accuracy: {acc['phrasings']} phrasings over {acc['manuals']} manuals: top-1 "
              f"{acc['top1'] * 100:.1f}%, top-3 {acc['top3'] * 100:.1f}%")
        for m in acc["misses"]:
            print(f"   miss: {m['task']!r} -> {m['got']} ({m['score']}), want {m['want']}")
        print(f"   top score, in-domain: min {acc['in_domain_top_score']['min']:.3f}, median "
              f"{acc['in_domain_top_score']['median']:.3f}; off-topic: max {acc['off_topic_top_score']['max']:.3f}, "
              f"median {acc['off_topic_top_score']['median']:.3f}")
        print(f"\n## min_score sweep ({acc['phrasings']} in-domain, {acc['off_topic']} off-topic; default "
              f"{DEFAULT_MIN_SCORE})")
        print(table([[s["min_score"], s["in_domain_right"], s["in_domain_wrong"], s["in_domain_refused"],
                      s["off_topic_grafted"], s["off_topic_refused"], s["wrong_grafts_total"]]
                     for s in acc["sweep"]],
                    ["min_score", "right", "wrong", "refused", "off-topic grafted", "off-topic refused",
                     "wrong grafts"]))

        # ---------------------------------------------------------------- 3 latency, 100 blocks
        t0 = time.perf_counter()
        for name, wtu, text in filler_blocks(100 - len(MANUALS)):
            mem.learn(text, name=name, when_to_use=wtu, chat=True)
        print(f"\nlearned {100 - len(MANUALS)} filler blocks in {time.perf_counter() - t0:.1f} s")
        # the 10k index (free-standing: synthetic entries, embedded texts, plus the 12 real manuals)
        n = args.synthetic
        t0 = time.perf_counter()

        r10 = Router(emb)
        r10.add_documents([f"syn{i}" for i in range(n)], filler_blocks(n))
        r10.add_documents([m.name for m in MANUALS], [(m.name, m.when_to_use, m.manual) for m in MANUALS])
        build_s = time.perf_counter() - t0
        print(f"built the {len(r10):,}-entry index ({r10.n_rows:,} dense rows) in {build_s:.1f} s")

        router = mem.router
        digest = mem.fingerprint.digest()
        router.search("warm up again", 2, fingerprint_digest=digest, use_cache=False)
        assert len(router) == 100
        # interleaved, so that both sizes see the same load on this shared machine
        lat100, lat10k, idx100, idx10k, lex10k = [], [], [], [], []
        for _ in range(args.reps):
            for t in tasks:
                for rt, kw, out in ((router, {"fingerprint_digest": digest}, lat100), (r10, {}, lat10k)):
                    t0 = time.perf_counter()
                    rt.search(t, 2, use_cache=False, **kw)
                    out.append((time.perf_counter() - t0) * 1e3)
                q = router.embed_task(t)
                for rt, out in ((router, idx100), (r10, idx10k)):
                    t0 = time.perf_counter()
                    rt._index.search(q, 2)
                    out.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                r10._lex.coverage(t)
                lex10k.append((time.perf_counter() - t0) * 1e3)
        acc10k = sum(r10.search(t, 1, use_cache=False)[0][0] == w for t, w in LABELLED) / len(LABELLED)
        res["latency_10k"] = {"entries": len(r10), "build_s": build_s, "route": summary(lat10k, **LATENCY),
                              "faiss_search_only": summary(idx10k, **LATENCY),
                              "lexical_coverage_only": summary(lex10k, **LATENCY),
                              "dense_rows": r10.n_rows, "top1_with_synthetic_distractors": acc10k}
        for t in tasks:  # fill the exact-lookup memory, then time only hits
            router.search(t, 2, fingerprint_digest=digest)
        cached = latency(lambda t: router.search(t, 2, fingerprint_digest=digest), tasks, args.reps)
        msearch = latency(lambda t: mem.search(t, top_k=5), tasks, 1)
        embed_only = latency(lambda t: router.embed_task(t), tasks, args.reps)
        acc100 = sum(mem.search(t, top_k=1)[0].block_id == ids[w] for t, w in LABELLED) / len(LABELLED)
        res["latency_100"] = {"route": summary(lat100, **LATENCY), "exact_lookup": summary(cached, **LATENCY),
                              "faiss_search_only": summary(idx100, **LATENCY),
                              "memory_search_top5": summary(msearch, **LATENCY),
                              "embed_task_only": summary(embed_only, **LATENCY),
                              "top1_with_88_fillers": acc100}

        # ---------------------------------------------------------------- 5 graft vs text, ~1k tokens
        # its own store (same engine), so that the handbook is the block these tasks route to
        hb_home = Path(home) / "handbook"
        hb = Memory(engine=mem.engine, home=hb_home, embedder=emb)
        manual = long_manual(mem)
        big = hb.learn(manual, name="operations-handbook",
                       when_to_use="any question about company operations procedures", chat=True)
        qs = ["Please open a ticket for customer 7312.", "Write June 12, 2023 in our date format.",
              "How do I back up the folder reports?"]
        runs = []
        for mt in args.max_tokens:
            rows = []
            for q in qs:
                for rep in range(args.graft_reps):
                    for mode in (("graft", "text") if rep % 2 == 0 else ("text", "graft")):
                        t0 = time.perf_counter()
                        r = hb.recall(q, max_tokens=mt, min_score=-1.0, mode=mode)
                        rows.append({"task": q, "mode": mode, "ms": (time.perf_counter() - t0) * 1e3,
                                     "ttft_ms": r.receipt.restore_ms + r.receipt.prefill_ms,
                                     "decode_ms": r.receipt.decode_ms,
                                     "text": r.text, "sha": r.receipt.first_logits_sha256,
                                     "prefilled": r.receipt.tokens_prefilled,
                                     "restored": r.receipt.tokens_restored,
                                     "decode_tokens": r.receipt.decode_tokens,
                                     "block": r.block.id if r.block else None})
            assert all(r["block"] == big.id for r in rows), "the handbook must be routed"
            runs.append(graft_vs_text_summary(qs, rows, mt))
        hb.close()
        res["graft_vs_text"] = {"manual_tokens": big.n_tokens, "runs": runs,
                                "all_identical": all(run["all_identical"] for run in runs)}

    res["machine"]["load_avg_end"] = os.getloadavg()[0]

    l1, l2 = res["latency_100"], res["latency_10k"]
    print(f"\n## Route latency (one task: embed + faiss search + store check), {args.reps} x {len(tasks)} tasks, "
          "100 and 10k interleaved")
    print(table([
        ["100 (real store)", f"{l1['route']['p50_ms']:.1f}", f"{l1['route']['p95_ms']:.1f}", f"{acc100 * 100:.1f}%"],
        ["100, exact-lookup hit", f"{l1['exact_lookup']['p50_ms']:.3f}", f"{l1['exact_lookup']['p95_ms']:.3f}", "-"],
        ["100, Memory.search top-5", f"{l1['memory_search_top5']['p50_ms']:.1f}",
         f"{l1['memory_search_top5']['p95_ms']:.1f}", "-"],
        ["(embedding the task alone)", f"{l1['embed_task_only']['p50_ms']:.1f}", f"{l1['embed_task_only']['p95_ms']:.1f}", "-"],
        [f"{len(r10):,} (synthetic)", f"{l2['route']['p50_ms']:.1f}", f"{l2['route']['p95_ms']:.1f}", f"{acc10k * 100:.1f}%"],
        ["(faiss search alone, 100)", f"{l1['faiss_search_only']['p50_ms']:.3f}", f"{l1['faiss_search_only']['p95_ms']:.3f}", "-"],
        [f"(faiss search alone, {len(r10):,})", f"{l2['faiss_search_only']['p50_ms']:.3f}", f"{l2['faiss_search_only']['p95_ms']:.3f}", "-"],
        [f"(lexical coverage alone, {len(r10):,})", f"{l2['lexical_coverage_only']['p50_ms']:.3f}", f"{l2['lexical_coverage_only']['p95_ms']:.3f}", "-"],
    ], ["blocks", "p50 ms", "p95 ms", "top-1"]))
    gv = res["graft_vs_text"]
    for run in gv["runs"]:
        print(f"\n## Recall, graft vs text, {gv['manual_tokens']}-token manual, max_tokens={run['max_tokens']} "
              f"(median of {args.graft_reps} interleaved runs; ms = the whole recall call, routing included)")
        print(table([[p["task"][:40], p["graft_prefilled"], p["text_prefilled"], f"{p['graft_ms']:.0f}",
                      f"{p['text_ms']:.0f}", f"{p['text_ms'] / p['graft_ms']:.1f}x",
                      f"{p['graft_ttft_ms']:.0f}", f"{p['text_ttft_ms']:.0f}",
                      f"{p['text_ttft_ms'] / p['graft_ttft_ms']:.1f}x", p["decode_tokens"],
                      f"{p['graft_decode_ms']:.0f}/{p['text_decode_ms']:.0f}", "yes" if p["identical"] else "NO"]
                     for p in run["per_task"]],
                    ["task", "prefilled graft", "prefilled text", "graft ms", "text ms", "speedup",
                     "graft restore+prefill ms", "text prefill ms", "prefill speedup", "decoded",
                     "decode ms g/t", "identical"]))
        print(f"overall: graft {run['graft_ms_median']:.0f} ms vs text {run['text_ms_median']:.0f} ms: "
              f"{run['speedup']:.1f}x for the whole recall call, {run['ttft_speedup']:.1f}x for restore+prefill "
              f"vs prefill; identical answers: {run['all_identical']}")
    print(f"load average: {res['machine']['load_avg_start']:.1f} at start, {res['machine']['load_avg_end']:.1f} at end")
    write_results(args.out, res, args=args, default=float)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
