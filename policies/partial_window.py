"""Whether KV computed under a partial window is computed again once its prefix fits."""

from __future__ import annotations

from kvrt.policy import PartialWindowQuery, register

__all__ = ["KeepPartial", "RecomputePartial"]

KIND = "partial_window"


@register(KIND, "recompute")
class RecomputePartial:
    """Compute it again whenever its whole prefix fits hot: a session whose context later
    fits its window is exact, at the cost of prefilling those blocks once more."""

    def recompute(self, query: PartialWindowQuery) -> bool:
        return True


@register(KIND, "keep")
class KeepPartial:
    """Keep partial-window KV (cheaper, never exact: the context stays labelled so)."""

    def recompute(self, query: PartialWindowQuery) -> bool:
        return False
