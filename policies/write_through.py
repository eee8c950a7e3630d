"""Which blocks are copied to the cold store as soon as they are computed."""

from __future__ import annotations

from kvrt.policy import BlockView, CacheClass, register

__all__ = ["AllThrough", "NoneThrough", "StableThrough"]

STABLE = frozenset({CacheClass.TASK_PINNED, CacheClass.REPO_MAP})


@register("write_through", "stable")
class StableThrough:
    """The classes other sessions are likeliest to send again (``task_pinned``: system
    prompts; ``repo_map``): written through, so a second session restores them at once."""

    def write_through(self, block: BlockView) -> bool:
        return block.cache_class in STABLE


@register("write_through", "none")
class NoneThrough:
    """Nothing is written before it leaves the hot window (less cold-store traffic)."""

    def write_through(self, block: BlockView) -> bool:
        return False


@register("write_through", "all")
class AllThrough:
    """Every computed block (the most sharing, the most cold-store traffic)."""

    def write_through(self, block: BlockView) -> bool:
        return True
