"""Which resident block leaves the hot window first."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from kvrt.policy import BlockView, register

__all__ = ["ClassThenLRU", "LexicalRelevance", "ScoreThenLRU"]

KIND = "hot_eviction"


@register(KIND, "class_lru")
class ClassThenLRU:
    """Lowest cache class first, then least recently used, then earliest position.

    Mechanism decides which blocks may go at all (sinks, the recent window); this only
    orders the candidates.
    """

    def order(self, candidates: Sequence[BlockView]) -> list[int]:
        ranked = sorted(candidates, key=lambda b: (b.cache_class.rank, b.last_used, b.start))
        return [b.id for b in ranked]


@register(KIND, "score_lru")
class ScoreThenLRU:
    """Lowest cache class first, then lowest importance score, then least recently used.

    Blocks without a score count as least important within their class.
    """

    def order(self, candidates: Sequence[BlockView]) -> list[int]:
        def key(b: BlockView) -> tuple[int, float, int, int]:
            score = float("-inf") if b.score is None else b.score
            return (b.cache_class.rank, score, b.last_used, b.start)

        return [b.id for b in sorted(candidates, key=key)]


@register(KIND, "relevance")
class LexicalRelevance:
    """Blocks least relevant to the query leave first: BM25 over token ids.

    Each block is a bag of token ids; the query is the context's last segment. A block
    sharing the query's rarer tokens (a name, a key, a term) scores high and stays hot;
    filler sharing only common ones goes. The cache class still comes first (a
    ``task_pinned`` block outlasts any ``volatile`` one); within a class, least relevant
    first, then least recently used. Cost: one pass over the context's tokens per placement.
    """

    k1 = 1.2
    b = 0.75

    def relevance(self, blocks: Sequence[Sequence[int]], query: Sequence[int]) -> list[float]:
        n = len(blocks)
        if not n or not query:
            return [0.0] * n
        counts = [Counter(tokens) for tokens in blocks]
        lengths = [len(tokens) for tokens in blocks]
        average = sum(lengths) / n or 1.0
        terms = set(query)
        df = {t: sum(1 for c in counts if t in c) for t in terms}
        idf = {t: math.log((n - df[t] + 0.5) / (df[t] + 0.5) + 1.0) for t in terms}
        scores = []
        for c, length in zip(counts, lengths, strict=True):
            norm = self.k1 * (1.0 - self.b + self.b * length / average)
            scores.append(
                sum(idf[t] * c[t] * (self.k1 + 1.0) / (c[t] + norm) for t in terms if t in c)
            )
        return scores

    def order(self, candidates: Sequence[BlockView]) -> list[int]:
        def key(b: BlockView) -> tuple[int, float, int, int]:
            relevance = 0.0 if b.relevance is None else b.relevance
            return (b.cache_class.rank, relevance, b.last_used, b.start)

        return [b.id for b in sorted(candidates, key=key)]
