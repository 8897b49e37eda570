"""Memory features on core + store: learn, answer/recall, the router, the pager (long documents),
exactness verification, re-derivation, the flywheel and its answer checks. Each gets its collaborators
(engine, store, router, page index) as arguments; [`Memory`][graftmem.Memory] owns them and passes them.

Public for advanced use: the functions and classes below (the benches use them to time one phase).
"""

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

__all__ = sorted([
    "ask", "graft", "CallableVerifier", "Candidate", "ExactMatch", "ProgramRun", "ProgramVerifier", "Verdict",
    "Verifier", "normalize_answer", "run_program", "graft_logits", "kl_divergence", "sample_queries",
    "verify_block", "Attempt", "Flywheel", "Gate", "GateReport", "Solution", "SolverOutput", "extract_answer",
    "extract_program", "literals", "substitute_literals", "prefill_and_store", "PAGE_KIND", "DEFAULT_PAGE_MIN_SCORE",
    "DocumentAnswer", "DocumentPlan", "DocumentReport", "PageIndex", "PageInfo", "PassageHit", "learn_pages",
    "plan_document", "read_source", "recall_document", "answer_graft_way", "answer_text_way",
    "continuation_for", "other_engines_hint", "RederiveReport", "compare_rederived", "rederive", "rederive_file",
    "DEFAULT_MIN_SCORE", "LEX_WEIGHT", "ROUTE_WEIGHT", "Embedder", "Router", "SentenceTransformerEmbedder",
    "normalize_task", "route_text"])
