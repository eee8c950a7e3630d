"""Which cache class a chat message's segment gets from its role."""

from __future__ import annotations

from kvrt.policy import CacheClass, register

__all__ = ["SystemPinned", "Unclassed"]


@register("message_class", "system_pinned")
class SystemPinned:
    """System messages ``task_pinned`` (evicted last, written through), the rest
    ``volatile``."""

    def cache_class(self, role: str) -> CacheClass:
        return CacheClass.TASK_PINNED if role == "system" else CacheClass.VOLATILE


@register("message_class", "volatile")
class Unclassed:
    """Every message ``volatile``: no turn outranks another."""

    def cache_class(self, role: str) -> CacheClass:
        return CacheClass.VOLATILE
