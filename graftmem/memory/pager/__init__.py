"""Long documents through one fixed window: pages, page blocks, passage routing, one-page recall.

Why pages. A graft is exact only at the positions a state was computed at, and a context can only
hold ``n_ctx`` positions. A document longer than the window is therefore cut into *pages* that each
fit the window; every page is prefilled on its own from position 0 (with the model's BOS, as any
fresh prompt) and stored as an ordinary block of kind ``page``. Answering a question restores ONE
page and prefills only the question, so the restore cost and the context size are those of one page
however large the store grows. This is the paper's "needle in store" setting (88 pages of 32k tokens
behind a 32k window), at the sizes our small models and this CPU allow.

Why passages. A page holds thousands of tokens; one embedding of a whole page (or of its start, which
is what `Router` embeds for a block) cannot say which page holds one sentence.
Each page is therefore cut into passages of a few sentences; every passage gets its own MiniLM
vector, and a passage maps back to its page. A question routes to the best passage, and the page of
that passage is the one grafted. The passage index is a small SQLite file (``home/pages/index.sqlite``)
beside the store: it records documents, their pages and the passages with their vectors. It is
append-mostly and written in one transaction per page, after the page's block is stored atomically, so
a kill at any point leaves either a page whose passages are missing (the next build embeds them
without prefilling again) or nothing at all.

Why the build is resumable. A page's block id is a content address (engine fingerprint + token ids),
and the cutting is deterministic (same text, window, overlap and tokenizer give the same pages), so a
rerun computes the same ids, finds the stored ones and skips them: nothing is prefilled twice and
nothing is stored twice. The document row records how many pages are done, for progress reports.

Positions in the document. ``token_start`` of a page is the previous page's plus the tokens of the
text between the two page starts; of a passage, the previous passage's plus the tokens between them.
Each piece is tokenized whole, so an offset differs from tokenizing the entire document at once only
where a piece boundary splits a token (measured: 23 tokens off after 60,000), at the cost of one extra
tokenization of the text.

Where each idea lives: `plan` (cutting a document into pages and passages), `index` (the passage index,
`PageIndex`) and `document` (learning and asking a document: `learn_pages`, `learn_document`,
`recall_document`). Every name stays importable from ``graftmem.memory.pager``.
"""

from ...core.blocks import PAGE_KIND
from .document import (DEFAULT_PAGE_MIN_SCORE, DocumentAnswer, DocumentReport, learn_document, learn_pages,
                       recall_document)
from .index import PageIndex, PageInfo, PassageHit
from .plan import (DEFAULT_OVERLAP, DEFAULT_RESERVE, PASSAGE_CHARS, DocumentPlan, Page, Source, plan_document,
                   read_source)

__all__ = ["Page", "DocumentPlan", "PageInfo", "PassageHit", "DocumentReport", "DocumentAnswer",
           "PageIndex", "plan_document", "learn_pages", "learn_document", "recall_document",
           "DEFAULT_RESERVE", "DEFAULT_OVERLAP", "DEFAULT_PAGE_MIN_SCORE", "PAGE_KIND",
           # importable here as before the split
           "Source", "read_source", "PASSAGE_CHARS"]
