"""Whether a cold block computed after a different prefix may stand in for recomputing it."""

from __future__ import annotations

from kvrt.policy import ApproximateQuery, CacheClass, register

__all__ = ["AllowApproximate", "AllowStableApproximate", "NeverApproximate"]

KIND = "approximate"


@register(KIND, "never")
class NeverApproximate:
    """Only exact hits are restored: the context always equals a fresh prefill."""

    def accept(self, query: ApproximateQuery) -> bool:
        return False


@register(KIND, "allow")
class AllowApproximate:
    """Every approximate hit of at least ``min_tokens`` is restored with a RoPE fix-up."""

    min_tokens = 16

    def accept(self, query: ApproximateQuery) -> bool:
        return query.n_tokens >= self.min_tokens


@register(KIND, "stable_only")
class AllowStableApproximate:
    """Approximate hits only for blocks of stable content (repo maps, pinned task text).

    Files and turns (volatile) are recomputed; a repo map or a system prompt after a
    changed history is restored with a RoPE fix-up.
    """

    min_tokens = 16

    def accept(self, query: ApproximateQuery) -> bool:
        return query.cache_class is not CacheClass.VOLATILE and query.n_tokens >= self.min_tokens
