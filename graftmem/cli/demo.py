"""``graftmem demo``: the README's first command (learn, recall, verify on the default model) and its
content."""

from __future__ import annotations

import argparse

from .common import _memory


#: The refund manual as a short conversation: the rules, then three worked cases. SmolLM2-135M is a very
#: small model; with the rules alone it apologises instead of following them, with worked cases in its
#: own chat template it answers the demo task the way the manual says (checked by tests/test_cli.py).
DEMO_MANUAL = [
    {"role": "system", "content": "You are the refund desk of Northwind Outfitters. A purchase less than "
                                  "30 days old is refunded: reply REFUND APPROVED and the ticket code RF- "
                                  "followed by the order digits. Older purchases: reply REFUND DECLINED and "
                                  "offer store credit."},
    {"role": "user", "content": "My order NW-31552 arrived 3 days ago and I want a refund."},
    {"role": "assistant", "content": "REFUND APPROVED. Ticket code: RF-31552."},
    {"role": "user", "content": "My order NW-77810 arrived 95 days ago and I want a refund."},
    {"role": "assistant", "content": "REFUND DECLINED. I can offer you store credit."},
    {"role": "user", "content": "My order NW-60213 arrived 12 days ago and I want a refund."},
    {"role": "assistant", "content": "REFUND APPROVED. Ticket code: RF-60213."},
]


#: what the manual says the answer to DEMO_TASK is
DEMO_EXPECTED = "REFUND APPROVED. Ticket code: RF-20417."


DEMO_DATES = """Date style guide:
Write every date as YYYY-MM-DD. For example, March 7, 2024 is written 2024-03-07.
Never write the month as a word and never put the day first.
"""


DEMO_TASK = "My order NW-20417 arrived 5 days ago and I want a refund."  # 5 days: the manual approves it


def cmd_demo(args: argparse.Namespace) -> int:
    """learn two manuals, recall a task through the router (graft), the same task the text way
    (identical answer, slower), then verify the grafted block against fresh prefills."""
    import importlib.util
    import tempfile
    import time

    home = args.home or tempfile.mkdtemp(prefix="graftmem-demo-")
    args.home = home
    t0 = time.perf_counter()
    from .. import system_report

    info = system_report()
    print(f"system: llama.cpp {info['llama_build']} sees {info['system_info']}", flush=True)
    with _memory(args) as mem:
        print(f"engine: {mem.fingerprint.model_name}, exact={mem.exactness.exact} ({mem.exactness.reason}); "
              f"weights in {mem.fingerprint.weight_buffers} buffers (extra_bufts={mem.engine.config.extra_bufts})")
        print(f"store:  {home}")
        block = mem.learn(DEMO_MANUAL, name="refund-manual",
                          when_to_use="a customer asks for a refund of an order")
        mem.learn(DEMO_DATES, name="date-format", chat=True, when_to_use="write or convert a calendar date")
        print(f"learn:  2 manuals; refund-manual = block {block.short_id}, {block.n_tokens} tokens, "
              f"{block.state_size:,} state bytes ({time.perf_counter() - t0:.1f} s including model load)")
        print(f"task:   {DEMO_TASK!r}")
        if importlib.util.find_spec("sentence_transformers") is None:
            print("route:  skipped (pip install '.[router]' in the clone for recall); grafting refund-manual by id")
            from ..memory import continuation_for

            r = mem.ask(block.id, continuation_for(block, DEMO_TASK), max_tokens=40)
            text_way = None
        else:
            r = mem.recall(DEMO_TASK, max_tokens=40)
            print(f"route:  -> {r.block.name if r.block else None} (score {r.score:.3f}; runner-up score "
                  f"{r.runner_up_score if r.runner_up_score is not None else float('nan'):.3f})")
            text_way = mem.recall(DEMO_TASK, max_tokens=40, mode="text")
        rc = r.receipt
        print(f"recall: grafted {rc.tokens_restored} tokens in {rc.restore_ms:.1f} ms, prefilled "
              f"{rc.tokens_prefilled} task tokens in {rc.prefill_ms:.0f} ms, decoded {rc.decode_tokens}")
        print(f"answer: {r.text.strip()!r}")
        print(f"manual: {DEMO_EXPECTED!r} is what the manual says: "
              f"{'followed' if r.text.strip() == DEMO_EXPECTED else 'NOT followed (a 135M model)'}")
        if text_way is not None:
            tc = text_way.receipt
            same = text_way.text == r.text and tc.first_logits_sha256 == rc.first_logits_sha256
            print(f"text way (re-read the manual): prefilled {tc.tokens_prefilled} tokens in {tc.prefill_ms:.0f} ms; "
                  f"answer and logits identical: {'yes' if same else 'NO'}; graft "
                  f"{tc.prefill_ms / max(rc.restore_ms + rc.prefill_ms, 1e-9):.1f}x faster to the first token")
        rep = mem.verify(r.block.id if r.block else block.id, samples=args.samples)
    print(f"verify: SHA-256 equal {rep.sha_equal}/{rep.samples}, max KL {rep.max_kl}, argmax agree "
          f"{rep.argmax_agree}/{rep.samples}, fresh-vs-fresh floor {rep.floor_sha_equal}/{rep.floor_samples}, "
          f"new process {'equal' if rep.cross_process else 'DIFFERENT'}")
    print("OK: the graft is byte-exact" if rep.ok else "MISMATCH: the graft is not exact")
    return 0 if rep.ok else 1
