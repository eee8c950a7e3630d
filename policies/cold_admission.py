"""Which evicted blocks earn a KV-byte slot in the cold store, and which keep tokens only."""

from __future__ import annotations

from kvrt.policy import BlockView, CacheClass, register

__all__ = ["AdmitAll", "SkipSmallVolatile"]

KIND = "cold_admission"


@register(KIND, "all")
class AdmitAll:
    """Every evicted block keeps its KV bytes."""

    def admit(self, block: BlockView) -> bool:
        return True


@register(KIND, "skip_small_volatile")
class SkipSmallVolatile:
    """Small volatile blocks keep tokens only: recomputing them is cheap, and they churn."""

    min_tokens = 32

    def admit(self, block: BlockView) -> bool:
        return block.cache_class is not CacheClass.VOLATILE or block.n_tokens >= self.min_tokens
