"""Which cold-store entry is dropped first when the store is over budget."""

from __future__ import annotations

from collections.abc import Sequence

from kvrt.policy import ColdEntryView, register

__all__ = ["ColdClassThenLRU"]

KIND = "cold_victim"


@register(KIND, "class_lru")
class ColdClassThenLRU:
    """Spare copies (blocks still hot in a session) first, then the lowest cache class,
    then least recently used."""

    def order(self, entries: Sequence[ColdEntryView]) -> list[int]:
        ranked = sorted(entries, key=lambda e: (not e.spare, e.cache_class.rank, e.last_used, e.id))
        return [e.id for e in ranked]
