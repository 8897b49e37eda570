"""The lexical half of routing: a compact, normalized BM25 ("coverage") over words.

Why a lexical score beside MiniLM. A dense vector of a passage is an average of what the passage says;
a one-sentence fact inside unrelated text is diluted in it, and a rare name (a person, a product, an
error code) counts for little in a model that never saw it. A word index sees exactly those: a rare
word that the task and one passage share is the strongest evidence there is. Dense catches
paraphrases that share no words; lexical catches shared rare words. The router adds the two.

Why this score and not raw BM25. Raw BM25 grows with the number and rarity of query words and has no
fixed scale, so it cannot be added to a cosine or compared with a ``min_score``. ``coverage`` is BM25
normalized per query: the IDF-weighted share of the task's words that the entry contains, each word
counted with BM25's saturating term frequency and length normalization, scaled so that one occurrence
in an entry of average length counts fully and capped there, so it lies in [0, 1]. Words of the task that no entry contains count in the denominator with the largest
IDF: a task about something the store has never heard of (off-topic) gets a low coverage everywhere.

No dependency: ~100 lines of numpy. Rebuilt lazily after a change (10,000 entries: tens of ms), queried
by postings (a few numpy operations per query word).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["tokens", "Lexicon", "K1", "B"]

#: BM25's term-frequency saturation and length normalization (the usual defaults)
K1 = 1.2
B = 0.75

_WORD = re.compile(r"[a-z0-9]+")

# function words and question/request boilerplate: they say nothing about which manual a task needs
_STOP = frozenset("""
a about above after again against all am an and any are as at be because been before being below between
both but by can could did do does doing down during each few for from further had has have having he her
here hers herself him himself his how i if in into is it its itself just me more most my myself no nor not
now of off on once only or other our ours ourselves out over own same she should so some such than that the
their theirs them themselves then there these they this those through to too under until up very was we
were what when where which while who whom why will with would you your yours yourself yourselves
s t d ll m re ve don didn doesn isn wasn aren can't cannot won shall may might must also get got
please need needs want wants like one two let tell give make i'm it's what's
""".split())


def _stem(w: str) -> str:
    """A light suffix stripper (plural -s, -es, -ies, -ed, -ing, final -e) so that "tickets"/"ticket",
    "named"/"naming"/"name" meet; both sides go through it, so only consistency matters."""
    if len(w) <= 3 or w.isdigit():
        return w
    if w.endswith("ies") and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith("sses"):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    for suf in ("ing", "ed"):
        if w.endswith(suf) and len(w) - len(suf) >= 3:
            w = w[: -len(suf)]
            if len(w) >= 3 and w[-1] == w[-2] and w[-1] not in "lsz":
                w = w[:-1]  # running -> runn -> run
            break
    if w.endswith("e") and len(w) >= 4:
        w = w[:-1]
    return w


def tokens(text: str) -> list[str]:
    """Words of ``text`` for the lexical index: lower-cased alphanumeric runs, stop words dropped, stemmed."""
    return [_stem(w) for w in _WORD.findall(text.casefold()) if w not in _STOP]


class Lexicon:
    """Term counts of a list of entries (position ``j`` = entry ``j`` of the router) and their coverage
    scores for a query. Entries are appended and removed by position, like the router's rows."""

    def __init__(self) -> None:
        self._docs: list[Counter[str]] = []
        self._lens: list[int] = []
        self._postings: Optional[dict[str, tuple[np.ndarray, np.ndarray]]] = None
        self._norm: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, token_lists: Iterable[Sequence[str]]) -> None:
        for toks in token_lists:
            self._docs.append(Counter(toks))
            self._lens.append(len(toks))
        self._postings = None

    def keep(self, positions: Sequence[int]) -> None:
        """Keep only the entries at ``positions`` (in that order), as the router compacts its rows."""
        self._docs = [self._docs[j] for j in positions]
        self._lens = [self._lens[j] for j in positions]
        self._postings = None

    def clear(self) -> None:
        self._docs, self._lens, self._postings, self._norm = [], [], None, None

    def _build(self) -> None:
        acc: dict[str, tuple[list[int], list[int]]] = {}
        for j, doc in enumerate(self._docs):
            for term, tf in doc.items():
                ids, tfs = acc.setdefault(term, ([], []))
                ids.append(j)
                tfs.append(tf)
        self._postings = {t: (np.asarray(i, dtype=np.int64), np.asarray(f, dtype=np.float32))
                          for t, (i, f) in acc.items()}
        lens = np.asarray(self._lens, dtype=np.float32)
        avg = float(lens.mean()) if len(lens) and lens.mean() > 0 else 1.0
        self._norm = K1 * (1.0 - B + B * lens / avg)

    def coverage(self, query: str) -> np.ndarray:
        """One score in [0, 1] per entry: the IDF-weighted, saturated share of the query's words it holds."""
        n = len(self._docs)
        out = np.zeros(n, dtype=np.float32)
        terms = set(tokens(query))
        if not n or not terms:
            return out
        if self._postings is None:
            self._build()
        assert self._postings is not None and self._norm is not None
        total = 0.0
        for t in terms:
            posting = self._postings.get(t)
            df = 0 if posting is None else len(posting[0])
            idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            total += idf
            if posting is not None:
                ids, tfs = posting
                # BM25's saturating tf with length normalization, scaled so that one occurrence in an
                # entry of average length counts 1 (capped there): coverage is a share of the words
                out[ids] += idf * np.minimum(1.0, tfs * (K1 + 1.0) / (tfs + self._norm[ids]))
        return out / total if total > 0 else out
