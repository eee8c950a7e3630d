"""Whether restoring a cold block beats recomputing it."""

from __future__ import annotations

from kvrt._types import RestoreQuery

from ._registry import register

__all__ = ["AlwaysRestore", "SizeThreshold"]

KIND = "restore"


@register(KIND, "always")
class AlwaysRestore:
    """Restore every exact hit: on these machines a restore is orders of magnitude cheaper."""

    def restore(self, query: RestoreQuery) -> bool:
        return True


@register(KIND, "size_threshold")
class SizeThreshold:
    """Recompute blocks below ``min_tokens`` (fixed per-restore overhead dominates there)."""

    min_tokens = 16

    def restore(self, query: RestoreQuery) -> bool:
        return query.n_tokens >= self.min_tokens
