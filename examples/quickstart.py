"""Quickstart: learn a manual once, answer from its grafted KV state, prove the graft is exact.

    python examples/quickstart.py
"""

import tempfile

from graftmem import Memory

with Memory(home=tempfile.mkdtemp(prefix="graftmem-quickstart-")) as mem:
    manual = mem.learn(
        "Refunds: ask for the order number (NW-12345), check the purchase is under 30 days old, "
        "then answer REFUND APPROVED with ticket code RF-<order digits>.",
        name="refunds")
    answer = mem.ask(manual.id, "\nCustomer: order NW-20417, bought 5 days ago.\nAgent:", max_tokens=32)
    print(answer.text.strip())
    print(answer.receipt)
    report = mem.verify(manual.id, samples=10)
    print(f"byte-exact: {report.ok} ({report.sha_equal}/{report.samples} SHA-equal, max KL {report.max_kl})")
