"""Which resident block leaves the hot window first."""

from __future__ import annotations

from collections.abc import Sequence

from kvrt.policy import BlockView, register

__all__ = ["ClassThenLRU", "ScoreThenLRU"]

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
