"""The labelled routing set: 12 manuals, 6 task phrasings each (72), and 24 off-topic tasks.

The first six manuals are the skill-agent example's; six more cover other desks so that near misses
exist (tickets vs bug reports, dates vs leave requests, backups vs git). Phrasings were written to
vary wording, length and register, and avoid copying the `when_to_use` text; the off-topic tasks are
things an agent is asked that no manual covers (they must be refused, not grafted).
"""

from __future__ import annotations

from bench.harness import example_modules

# the skill-agent example's manuals (examples/skill_agent/skills.py) are the first six
(skills,) = example_modules("skill_agent", "skills")
SKILLS, Skill = skills.SKILLS, skills.Skill

MORE = [
    Skill("password-reset", "reset a forgotten password or unlock a locked user account",
          """Account desk manual: password resets.
Never read a password over the phone or write it in a ticket. To reset a password, send the reset
link to the email address on file and reply with: RESET LINK SENT. A user locked out after five failed
logins is unlocked the same way; the lock clears when the new password is set."""),
    Skill("invoice-numbers", "create or quote an invoice number for a billing document",
          """Billing manual: invoice numbers.
Every invoice gets a number INV-YYYY-NNNN: the year it is issued, then a four-digit running number
with leading zeros. The 27th invoice of 2024 is INV-2024-0027. Credit notes use CN instead of INV.
Never reuse a number, even for a cancelled invoice."""),
    Skill("meeting-rooms", "book or reserve a meeting room or conference room",
          """Office manual: meeting rooms.
Rooms are booked through the front desk with the line BOOK <room> <date> <start>-<end>, times in
24-hour format. Rooms: Atlas (12 people, projector), Birch (6 people), Cedar (2 people, phone booth).
Bookings longer than four hours need a manager's approval."""),
    Skill("leave-requests", "request vacation days, sick leave or time off work",
          """HR manual: leave requests.
Employees request leave with the form LEAVE <type> <first day> <last day>, where type is VACATION,
SICK or UNPAID. Vacation is requested at least two weeks ahead; sick leave is reported on the first
morning of absence, with a doctor's note after three days."""),
    Skill("bug-reports", "report a software bug or defect to the engineering team",
          """Engineering manual: bug reports.
A bug report has four lines: TITLE (one sentence), STEPS (numbered steps to reproduce), EXPECTED,
ACTUAL. Add the version from the About screen. Severity is S1 when data is lost, S2 when a feature
is unusable, S3 otherwise. Bugs go to the tracker, not to the support desk."""),
    Skill("git-branches", "name a git branch or follow the branching and merge rules",
          """Engineering manual: git branches.
Branch names are <type>/<ticket>-<short-slug>, where type is feat, fix or chore, for example
fix/TK-7312-login-crash. Branch from main, rebase before review, squash-merge after two approvals.
Never push directly to main."""),
]

MANUALS = SKILLS + MORE

#: (task, manual name)
LABELLED: list[tuple[str, str]] = [
    # support-tickets
    ("Please open a ticket for customer 7312, the app crashes on start.", "support-tickets"),
    ("Customer 2290 needs a case logged for their broken scanner.", "support-tickets"),
    ("Create a support ticket for client number 5518.", "support-tickets"),
    ("What ticket code should I give customer 6604 for their complaint?", "support-tickets"),
    ("Log this issue for customer 3141: the screen flickers.", "support-tickets"),
    ("Open a case for customer 9087 so second line can follow up.", "support-tickets"),
    # refund-decisions
    ("I purchased a jacket 5 days ago and I would like my money back.", "refund-decisions"),
    ("Can I return these boots I bought two months ago for a refund?", "refund-decisions"),
    ("The customer wants a refund for an order from 40 days ago.", "refund-decisions"),
    ("Is a refund allowed for something bought last week?", "refund-decisions"),
    ("I want to send back my headphones and get reimbursed, bought 3 days ago.", "refund-decisions"),
    ("Should we approve the money-back request for a purchase made 29 days ago?", "refund-decisions"),
    # date-format
    ("Write June 12, 2023 in our date format.", "date-format"),
    ("How should I write 3/4/2022 in the report?", "date-format"),
    ("Convert the first of December 2021 to our standard.", "date-format"),
    ("What is the correct way to write today's date in a log file?", "date-format"),
    ("Normalize this date: Sept 9th, 2020.", "date-format"),
    ("Format 25 December 2024 the house way.", "date-format"),
    # backup-command
    ("How do I back up the folder reports?", "backup-command"),
    ("Give me the command to archive the directory logs before the upgrade.", "backup-command"),
    ("What do I run to save a copy of /etc/nginx before editing it?", "backup-command"),
    ("Shell command to make a tarball of the uploads folder?", "backup-command"),
    ("I need to snapshot the data directory before changing the server.", "backup-command"),
    ("Which tar command backs up the configs directory?", "backup-command"),
    # contact-records
    ("Add the contact Omar Haddad, email omar@example.net, phone 555-0142.", "contact-records"),
    ("Format this person for the CRM: Jane Doe, jane@doe.org, 555-0199.", "contact-records"),
    ("Make a record line for Paulo Silva with phone 555-0123 and email paulo@example.com.", "contact-records"),
    ("How do I enter a new customer's name, email and phone number in the CRM import?", "contact-records"),
    ("Turn these details into a contact line: Mei Chen / mei@chen.io / 555-0110.", "contact-records"),
    ("New lead: Tom Baker, tel 555-0155, mail tom@baker.co. Write the record.", "contact-records"),
    # shipping-escalation
    ("My parcel was supposed to arrive last week and it still is not here.", "shipping-escalation"),
    ("Where is my package? The tracking has not moved in days.", "shipping-escalation"),
    ("The delivery driver left my box at the wrong address.", "shipping-escalation"),
    ("My order arrived damaged during transport, who do I talk to?", "shipping-escalation"),
    ("The courier says delivered but I never got the shipment.", "shipping-escalation"),
    ("How long does shipping take and who can tell me where my order is?", "shipping-escalation"),
    # password-reset
    ("I forgot my password and cannot log in.", "password-reset"),
    ("My account got locked after too many failed attempts.", "password-reset"),
    ("Can you tell me my password over the phone?", "password-reset"),
    ("A user needs a new password, what do I do?", "password-reset"),
    ("How do I send someone a link to change their login credentials?", "password-reset"),
    ("I can't sign in anymore, the site says my credentials are wrong.", "password-reset"),
    # invoice-numbers
    ("What number does the 27th invoice of 2024 get?", "invoice-numbers"),
    ("I need to issue a bill to a client, how is it numbered?", "invoice-numbers"),
    ("Which number do I put on a credit note?", "invoice-numbers"),
    ("Can I reuse the number of a cancelled invoice?", "invoice-numbers"),
    ("Generate the billing document number for invoice 5 this year.", "invoice-numbers"),
    ("What's the format of our invoice IDs?", "invoice-numbers"),
    # meeting-rooms
    ("Book a room for six people tomorrow from 10 to 11.", "meeting-rooms"),
    ("Which conference room has a projector?", "meeting-rooms"),
    ("I need somewhere private for a phone call at 3 pm.", "meeting-rooms"),
    ("Reserve Atlas for the all-hands on Friday afternoon.", "meeting-rooms"),
    ("Can I reserve a meeting space for a whole day workshop?", "meeting-rooms"),
    ("How do I schedule a room for a team meeting?", "meeting-rooms"),
    # leave-requests
    ("I want to take vacation from July 1 to July 14.", "leave-requests"),
    ("I'm sick today and can't come in, what do I need to do?", "leave-requests"),
    ("How far in advance must holidays be requested?", "leave-requests"),
    ("Request two days of unpaid time off next month.", "leave-requests"),
    ("Do I need a doctor's note if I'm ill for four days?", "leave-requests"),
    ("How do I ask my employer for days off?", "leave-requests"),
    # bug-reports
    ("The export button crashes the app and we lose data, how do I report it?", "bug-reports"),
    ("Write up a defect: the search page shows no results for valid queries.", "bug-reports"),
    ("What severity is a bug where a feature is unusable?", "bug-reports"),
    ("I found an error in the software, where do I file it?", "bug-reports"),
    ("What should a good issue report for the developers contain?", "bug-reports"),
    ("The login form accepts empty passwords; report this to engineering.", "bug-reports"),
    # git-branches
    ("What should I call my branch for fixing ticket TK-7312?", "git-branches"),
    ("Can I push my change straight to main?", "git-branches"),
    ("How do we merge a feature branch after code review?", "git-branches"),
    ("Name a branch for the new dark mode feature, ticket TK-88.", "git-branches"),
    ("Should I rebase or merge main into my branch before review?", "git-branches"),
    ("What's our convention for naming git branches?", "git-branches"),
]

#: tasks no manual covers: a correct router refuses them (no graft)
OFF_TOPIC: list[str] = [
    "What is the capital of Mongolia?",
    "Write a haiku about autumn leaves.",
    "Explain how photosynthesis works.",
    "Who won the football world cup in 2010?",
    "Translate 'good morning' into Italian.",
    "What is 17 times 23?",
    "Recommend a good science fiction novel.",
    "How many moons does Jupiter have?",
    "Give me a recipe for pancakes.",
    "What's the weather like on Mars?",
    "Summarize the plot of Hamlet.",
    "Why is the sky blue?",
    "Tell me a joke about cats.",
    "What are the rules of chess castling?",
    "How do I tie a bowline knot?",
    "Describe the water cycle for a child.",
    "Which is heavier, a kilo of feathers or a kilo of steel?",
    "Suggest a name for my new puppy.",
    "How tall is Mount Everest?",
    "What does a violin sound like?",
    "Plan a three-day trip to Lisbon.",
    "What is the speed of light?",
    "Write a limerick about a frog.",
    "How do bees make honey?",
]

assert len(MANUALS) == 12 and len({m.name for m in MANUALS}) == 12
assert len(LABELLED) >= 60 and {t for _, t in LABELLED} == {m.name for m in MANUALS}
