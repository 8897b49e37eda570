"""Memory features on core + store: learn, answer/recall, the router, the pager (long documents),
exactness verification, re-derivation, the flywheel and its answer checks. Each gets its collaborators
(engine, store, router, page index) as arguments; [`Memory`][graftmem.Memory] owns them and passes them.

Public for advanced use: the functions and classes below (the benches use them to time one phase).
"""

from .access import Access
from .answer import ask, graft
from .checks import (CallableVerifier, Candidate, ExactMatch, ProgramRun, ProgramVerifier, Verdict, Verifier,
                     normalize_answer, run_program)
from .exactness import graft_logits, kl_divergence, sample_queries, verify_block
from .flywheel import (Attempt, Flywheel, Gate, GateReport, Solution, SolverOutput, extract_answer,
                       extract_program, literals, substitute_literals)
from .learn import prefill_and_store
from .pager import (DEFAULT_PAGE_MIN_SCORE, PAGE_KIND, DocumentAnswer, DocumentPlan, DocumentReport, PageIndex, PageInfo, PassageHit,
                    learn_pages, plan_document, read_source, recall_document)
from .recall import answer_graft_way, answer_text_way, continuation_for, other_engines_hint
from .rederive import RederiveReport, compare_rederived, rederive, rederive_file
from .router import (DEFAULT_MIN_SCORE, LEX_WEIGHT, ROUTE_WEIGHT, Embedder, Router, SentenceTransformerEmbedder,
                     normalize_task, route_text)

__all__ = [
    "Access", "Attempt", "CallableVerifier", "Candidate", "DEFAULT_MIN_SCORE", "DEFAULT_PAGE_MIN_SCORE", "DocumentAnswer",
    "DocumentPlan", "DocumentReport", "Embedder", "ExactMatch", "Flywheel", "Gate", "GateReport", "LEX_WEIGHT",
    "PAGE_KIND", "PageIndex", "PageInfo", "PassageHit", "ProgramRun", "ProgramVerifier", "ROUTE_WEIGHT",
    "RederiveReport", "Router", "SentenceTransformerEmbedder", "Solution", "SolverOutput", "Verdict", "Verifier",
    "answer_graft_way", "answer_text_way", "ask", "compare_rederived", "continuation_for", "extract_answer",
    "extract_program", "graft", "graft_logits", "kl_divergence", "learn_pages", "literals", "normalize_answer",
    "normalize_task", "other_engines_hint", "plan_document", "prefill_and_store", "read_source", "recall_document",
    "rederive", "rederive_file", "route_text", "run_program", "sample_queries", "substitute_literals", "verify_block"]
