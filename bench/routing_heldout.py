"""HELD-OUT routing and passage-routing sets: written before the router was changed, never tuned on.

Why a second set. ``bench/routing_set.py`` is what the router's weights and threshold were chosen on,
so its score says little about tasks nobody looked at. This file was written (and committed) before
the hybrid router existed and is only ever *measured*: if a number here is bad, the fix goes through
the tuning set, not through an edit of this file.

What is in it:

* ``EXTRA_MANUALS``: six manuals the tuning set does not have (an on-call runbook, a write-up guide,
  expense claims, production access, a release-notes style guide, a phone directory), so the held-out
  accuracy is also measured on manuals nobody tuned on.
* ``HELDOUT``: 3 phrasings for each of the 18 manuals (12 tuning manuals + 6 new). They are written to
  share few words with their manual: terse alerts, questions about what a document should contain,
  second-hand requests, jargon.
* ``HELDOUT_OFF_TOPIC``: 16 tasks no manual covers (must be refused).
* ``DOC_NEEDLES_TUNE`` / ``DOC_NEEDLES_HELDOUT``: passage routing in real prose. The document is the
  docstrings of installed Python standard-library modules (:func:`docstring_document`), each set over
  its own modules, with one-sentence facts (needles) inserted between two sentences of a paragraph,
  and a question per needle that paraphrases it.
"""

from __future__ import annotations

import importlib
import inspect

from bench.routing_set import LABELLED, MANUALS, Skill

EXTRA_MANUALS = [
    Skill("disk-space-runbook", "on-call runbook for a server whose disk or filesystem is filling up",
          """On-call runbook: disk space.
When a host reports a volume above 90 percent, first run df -h to find the volume and du -sh /var/log/*
to find what grew. Rotated logs older than seven days may be deleted. Never delete database files.
If the volume is still above 90 percent after cleanup, page the storage team and open an incident."""),
    Skill("postmortem-guide", "how to write an incident postmortem document",
          """Writing guide: postmortems.
A postmortem is blameless. It has five sections: Summary (two sentences), Impact (who was affected and
for how long), Timeline (times in UTC), Root cause, and Action items (each with an owner and a due
date). Publish it within five working days of the incident."""),
    Skill("expense-claims", "claim back money spent on business travel or purchases",
          """Finance manual: expense claims.
Submit a claim with the form EXP <date> <amount> <category>, one line per receipt, categories TRAVEL,
MEALS or EQUIPMENT. Attach a photo of every receipt over 25 euros. Claims are paid with the next
salary if submitted before the 20th of the month."""),
    Skill("prod-access", "request access to production systems, servers or databases",
          """Security manual: production access.
Access to production is requested with a ticket to the security team naming the system, the reason
and the duration, at most 30 days. Access needs approval from your manager and is granted through the
bastion host only. Shared accounts are forbidden; access expires automatically."""),
    Skill("release-notes", "write the release notes for a new software version",
          """Style guide: release notes.
Release notes start with the version number and date, then three headings in this order: New,
Changed, Fixed. Each item is one line in the present tense that says what the user can now do,
with the ticket number in brackets. Do not mention internal refactorings."""),
    Skill("phone-extensions", "find the internal phone extension of a department or desk",
          """Office manual: phone extensions.
Internal calls use four-digit extensions. Reception 1000, IT helpdesk 2400, payroll 3150, facilities
3300, security desk 4000. From outside, dial the main number and then the extension. The emergency
line inside the building is 4444."""),
]

ALL_MANUALS = MANUALS + EXTRA_MANUALS

#: (task, manual name): 3 per manual, none used for tuning
HELDOUT: list[tuple[str, str]] = [
    ("Client #4410 reports the mobile app freezes; get them a reference for follow-up.", "support-tickets"),
    ("Need a case number for account 8802 please.", "support-tickets"),
    ("Escalation from customer 1207, what code do I hand them?", "support-tickets"),
    ("Bought a coat 31 days back, want to give it back for cash.", "refund-decisions"),
    ("Return window question: purchase from yesterday, full reimbursement possible?", "refund-decisions"),
    ("Customer is unhappy with a blender from three weeks ago and wants the money returned.", "refund-decisions"),
    ("11/02/2019 -> house style?", "date-format"),
    ("How do we spell out the day in documents, e.g. 5th of May 2025?", "date-format"),
    ("Timestamp style for the changelog entry dated August 30 2022?", "date-format"),
    ("tar the photos dir before I wipe the disk", "backup-command"),
    ("Before migrating, how do I keep an archive copy of /srv/app?", "backup-command"),
    ("Preserve the invoices folder as a compressed file.", "backup-command"),
    ("Put Ana Lopez (ana@lopez.es, 555-0177) into our address book format.", "contact-records"),
    ("CRM entry for a new prospect: Karl Berg, karl@berg.de, 555-0101.", "contact-records"),
    ("What line do I import for a person with a name, a mail address and a number?", "contact-records"),
    ("Tracking says out for delivery since Monday, nothing arrived.", "shipping-escalation"),
    ("The box came crushed and the carrier won't answer.", "shipping-escalation"),
    ("Order #5531 seems lost in transit.", "shipping-escalation"),
    ("User locked out, five bad logins.", "password-reset"),
    ("Someone asks me to read out their password on a call, is that ok?", "password-reset"),
    ("Forgotten login, needs a fresh one.", "password-reset"),
    ("Numbering for the 140th bill we send this year?", "invoice-numbers"),
    ("How is a refund document (credit) numbered compared to a normal one?", "invoice-numbers"),
    ("We voided INV-2023-0410, can its number go on the next bill?", "invoice-numbers"),
    ("Where can two of us take a quick call in private?", "meeting-rooms"),
    ("Grab Birch for Thursday 14:00-15:30.", "meeting-rooms"),
    ("Offsite-style planning day in the office, 9 to 5, which space and who approves?", "meeting-rooms"),
    ("Off ill since this morning.", "leave-requests"),
    ("Planning a fortnight away in August, what's the process?", "leave-requests"),
    ("Can I take a few days without pay?", "leave-requests"),
    ("Checkout total is wrong when a coupon is applied, how do I write this up for devs?", "bug-reports"),
    ("Data got wiped when saving a draft, what severity?", "bug-reports"),
    ("Template for reporting a defect?", "bug-reports"),
    ("Branch name for chore work on TK-501, cleaning up configs?", "git-branches"),
    ("Merge strategy after approvals?", "git-branches"),
    ("Is a direct commit to the main line allowed?", "git-branches"),
    ("ALERT: /var on web-07 at 96%", "disk-space-runbook"),
    ("Paged: volume usage critical on db-2, what now?", "disk-space-runbook"),
    ("The server is running out of room, logs keep growing.", "disk-space-runbook"),
    ("What goes into the document after an outage?", "postmortem-guide"),
    ("Write-up for last night's downtime: which sections?", "postmortem-guide"),
    ("How soon must we publish the incident review, and who gets blamed?", "postmortem-guide"),
    ("Taxi and hotel from the Berlin trip, how do I get reimbursed?", "expense-claims"),
    ("I paid for a keyboard myself, can the company pay me back?", "expense-claims"),
    ("Do I need the receipt for a 12 euro lunch with a client?", "expense-claims"),
    ("I need to get onto the live database for a week to debug.", "prod-access"),
    ("Can we use one shared login for the production servers?", "prod-access"),
    ("How do I get ssh into prod?", "prod-access"),
    ("Draft the changelog for version 4.2.", "release-notes"),
    ("What headings does the What's New page of a version have?", "release-notes"),
    ("Should the notes for the next version mention the refactor of the billing module?", "release-notes"),
    ("What number do I dial for the helpdesk?", "phone-extensions"),
    ("How do I reach payroll by phone from inside the building?", "phone-extensions"),
    ("Emergency number inside the office?", "phone-extensions"),
]

#: tasks no manual covers (held out): a correct router refuses them
HELDOUT_OFF_TOPIC: list[str] = [
    "What year did the Berlin wall fall?",
    "Compose a short poem about the sea.",
    "How does a refrigerator keep food cold?",
    "Name three famous painters from Spain.",
    "What is the square root of 144?",
    "Explain the offside rule in football.",
    "Suggest a vegetarian dinner for four.",
    "How far is the moon from the earth?",
    "Who wrote Pride and Prejudice?",
    "What do pandas eat?",
    "Teach me a tongue twister.",
    "How do volcanoes form?",
    "What is the tallest building in the world?",
    "Give me tips for learning the guitar.",
    "Why do cats purr?",
    "What language is spoken in Brazil?",
]


# --------------------------------------------------------------------------- passage routing in real prose
def docstring_document(modules: list[str], max_chars: int = 80_000) -> str:
    """Real prose: the docstrings of ``modules`` (the module's, then each public class, function and
    method's, in source order), one paragraph per docstring, cut at ``max_chars``."""
    parts: list[str] = []
    for name in modules:
        mod = importlib.import_module(name)
        doc = inspect.getdoc(mod)
        if doc:
            parts.append(doc)
        members = []
        for attr, obj in vars(mod).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                members.append((attr, obj))
        for attr, obj in members:
            d = inspect.getdoc(obj)
            if d:
                parts.append(f"{attr}: {d}")
            if inspect.isclass(obj):
                for mname, meth in vars(obj).items():
                    if mname.startswith("_") or not inspect.isfunction(meth):
                        continue
                    md = inspect.getdoc(meth)
                    if md:
                        parts.append(f"{attr}.{mname}: {md}")
    text = "\n\n".join(" ".join(p.split()) for p in parts)
    return text[:max_chars]


def insert_needles(text: str, needles: list[dict]) -> tuple[str, list[dict]]:
    """Put each needle (``{"fact", "question", "answer", "at"}``, ``at`` a fraction of the text) after the
    first sentence end at or after that fraction, inside a paragraph. Returns the text and the needles
    with their ``char_start``/``char_end`` in it."""
    out = text
    placed = []
    for nd in sorted(needles, key=lambda n: n["at"]):
        pos = int(len(out) * nd["at"])
        cut = out.find(". ", pos)
        cut = len(out) if cut < 0 else cut + 2
        fact = nd["fact"] + " "
        out = out[:cut] + fact + out[cut:]
        for p in placed:  # needles placed earlier sit before this one (sorted), so they do not move
            assert p["char_end"] <= cut
        placed.append({**nd, "char_start": cut, "char_end": cut + len(nd["fact"])})
    return out, placed


#: the tuning needle set (what the passage scoring may be tuned on)
DOC_NEEDLES_TUNE = {
    "modules": ["argparse", "textwrap", "shutil"],
    "needles": [
        {"fact": "The spare key to the archive room is kept by Philomena Hartsgrove.",
         "question": "Who keeps the spare key to the archive room?", "answer": "Hartsgrove", "at": 0.05},
        {"fact": "The Kestrel pipeline was switched off on 14 March because of a cooling fault.",
         "question": "Why was the Kestrel pipeline switched off?", "answer": "cooling", "at": 0.35},
        {"fact": "Our mascot, a tortoise called Wendeline, is 61 years old.",
         "question": "How old is the tortoise Wendeline?", "answer": "61", "at": 0.6},
        {"fact": "The Grisholm bridge toll for bicycles is 3 crowns.",
         "question": "What do cyclists pay to cross the Grisholm bridge?", "answer": "3", "at": 0.9},
    ],
}

#: the HELD-OUT needle set: other modules, other needles; measured, never tuned on
DOC_NEEDLES_HELDOUT = {
    "modules": ["collections", "json", "logging", "pathlib", "subprocess", "threading"],
    "needles": [
        {"fact": "The night porter Ambrose Thistlewood locks the east gate at eleven.",
         "question": "At what time does Ambrose Thistlewood lock the gate?", "answer": "eleven", "at": 0.03},
        {"fact": "The Quillfeather observatory was funded by a salt merchant from Varna.",
         "question": "Who paid for the Quillfeather observatory?", "answer": "salt", "at": 0.17},
        {"fact": "Brother Anselm's recipe for quince jam needs nine cloves.",
         "question": "How many cloves go into Brother Anselm's quince jam?", "answer": "nine", "at": 0.31},
        {"fact": "The tram line to Oberwyl closes for repairs every second Tuesday.",
         "question": "When is the Oberwyl tram out of service?", "answer": "Tuesday", "at": 0.46},
        {"fact": "Margarethe Voskuijlen won the regional chess title with the black pieces.",
         "question": "Which colour did Margarethe Voskuijlen play when she won the title?",
         "answer": "black", "at": 0.6},
        {"fact": "The ferry Saint Ebba carries at most 212 passengers.",
         "question": "What is the passenger limit of the Saint Ebba?", "answer": "212", "at": 0.75},
        {"fact": "Dr. Isolde Brannagh keeps her bees on the roof of the old tannery.",
         "question": "Where does Isolde Brannagh keep her hives?", "answer": "tannery", "at": 0.88},
        {"fact": "The lost manuscript of the Harrowgate choir was found inside a hollow organ pipe.",
         "question": "Where was the Harrowgate choir's manuscript discovered?", "answer": "organ", "at": 0.97},
    ],
}

assert len(EXTRA_MANUALS) == 6 and len({m.name for m in ALL_MANUALS}) == 18
assert {w for _, w in HELDOUT} == {m.name for m in ALL_MANUALS}
assert all(sum(w == m.name for _, w in HELDOUT) == 3 for m in ALL_MANUALS)
assert not {t for t, _ in HELDOUT} & {t for t, _ in LABELLED}
