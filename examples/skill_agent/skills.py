"""Six skill manuals, six tasks, and a checker per task (the checkable output each manual teaches).

Written for this example: each manual teaches one procedure whose result can be checked by code (a
ticket code, a formatted record, a command line, a date, a decision, an extension number). The
`when_to_use` line is what an author would write for the router; the task phrasings do not reuse it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Skill:
    name: str
    when_to_use: str
    manual: str


@dataclass(frozen=True)
class Task:
    text: str
    skill: str                       # the manual that must be routed to
    check: Callable[[str], bool]     # task success, judged on the answer text
    expected: str                    # what a correct answer contains (for the printout)


def _has(s: str) -> Callable[[str], bool]:
    return lambda answer: s.lower() in answer.lower()


SKILLS = [
    Skill(
        name="support-tickets",
        when_to_use="open, create or log a support ticket for a customer and give its ticket code",
        manual="""Support desk manual: opening tickets.
Every customer problem that cannot be solved in the first reply gets a ticket. The ticket code is how
the customer and the second-line team find the case again, so it must be exact.
Procedure:
1. Find the customer's number. It has four digits, for example 4821.
2. Build the ticket code: the letters TK, a dash, then the customer's number, with no spaces.
3. Reply with only the ticket code, nothing else.
Worked example.
Request: Please open a ticket for customer 4821, their printer is broken.
Answer: TK-4821
Request: Customer 1093 cannot log in, open a ticket.
Answer: TK-1093""",
    ),
    Skill(
        name="refund-decisions",
        when_to_use="decide whether a refund or money-back request is approved or declined",
        manual="""Refund policy manual.
Customers may return a purchase for a full refund within 30 days of the purchase date. After 30 days
no refund is given; the customer is offered store credit instead.
Procedure:
1. Find how many days ago the purchase was made.
2. If it was less than 30 days ago, reply exactly: REFUND APPROVED
3. If it was 30 days ago or more, reply exactly: REFUND DECLINED
Worked example.
Request: I bought this lamp 12 days ago and want my money back.
Answer: REFUND APPROVED
Request: I bought these shoes 45 days ago, can I get a refund?
Answer: REFUND DECLINED""",
    ),
    Skill(
        name="date-format",
        when_to_use="write, convert or normalize a calendar date into the house date format",
        manual="""Style guide: dates.
All documents, logs and emails write calendar dates in the ISO format YYYY-MM-DD: four-digit year,
two-digit month, two-digit day, separated by dashes. Never use slashes, never write the month name.
Months: January 01, February 02, March 03, April 04, May 05, June 06, July 07, August 08,
September 09, October 10, November 11, December 12.
Procedure: convert the date and reply with only the converted date.
Worked example.
Request: Write March 7, 2024 in our date format.
Answer: 2024-03-07
Request: Convert 21 October 2019.
Answer: 2019-10-21""",
    ),
    Skill(
        name="backup-command",
        when_to_use="give the shell command that backs up or archives a directory",
        manual="""Operations manual: backups.
Before any change to a server, the directory that will change is archived with tar and gzip.
Procedure:
1. Take the name of the directory to back up.
2. The command is: tar -czf backup.tar.gz followed by a space and the directory name.
3. Reply with only the command line.
Worked example.
Request: How do I back up the folder photos?
Answer: tar -czf backup.tar.gz photos
Request: Give me the backup command for the directory configs.
Answer: tar -czf backup.tar.gz configs""",
    ),
    Skill(
        name="contact-records",
        when_to_use="format a person's contact details (name, email, phone) as a record line",
        manual="""Data entry manual: contact records.
The CRM imports one contact per line. A contact record is the full name, the email address and the
phone number, in that order, separated by a space, a vertical bar and a space.
Procedure: reply with only the record line: NAME | EMAIL | PHONE
Worked example.
Request: Add the contact Ana Ruiz, email ana@example.com, phone 555-0101.
Answer: Ana Ruiz | ana@example.com | 555-0101
Request: New contact: Li Wei, phone 555-0177, email li.wei@example.org.
Answer: Li Wei | li.wei@example.org | 555-0177""",
    ),
    Skill(
        name="shipping-escalation",
        when_to_use="answer a question about a late, lost or missing parcel or delivery",
        manual="""Support desk manual: shipping questions.
The support desk does not track parcels itself. Every question about a delivery (late, lost,
damaged in transit, wrong address) goes to the logistics team, which answers on extension 4410.
Procedure: tell the customer to call the logistics team at extension 4410.
Worked example.
Request: My package has not arrived yet, where is it?
Answer: Please call our logistics team at extension 4410.
Request: The courier left my parcel at the wrong house.
Answer: Please call our logistics team at extension 4410.""",
    ),
]

TASKS = [
    Task("Please open a ticket for customer 7312, the app crashes on start.", "support-tickets",
         lambda a: bool(re.search(r"\bTK-7312\b", a)), "TK-7312"),
    Task("I purchased a jacket 5 days ago and I would like my money back.", "refund-decisions",
         _has("REFUND APPROVED"), "REFUND APPROVED"),
    Task("Write June 12, 2023 in our date format.", "date-format",
         _has("2023-06-12"), "2023-06-12"),
    Task("How do I back up the folder reports?", "backup-command",
         lambda a: "tar -czf backup.tar.gz reports" in a, "tar -czf backup.tar.gz reports"),
    Task("Add the contact Omar Haddad, email omar@example.net, phone 555-0142.", "contact-records",
         _has("Omar Haddad | omar@example.net | 555-0142"), "Omar Haddad | omar@example.net | 555-0142"),
    Task("My parcel was supposed to arrive last week and it still is not here.", "shipping-escalation",
         _has("4410"), "extension 4410"),
]
