"""The RAM tier: cold entries in host memory, within a budget, victims by policy.

Synchronous bookkeeping with no ``await``, owned by the :class:`~kvrt._cold.store.ColdStore`
(whose service task is the only writer): the entries, an index by tokens for approximate
hits, pins, and the choice of victims when an entry needs room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from .._types import ColdEntryView
from ..policy import ColdVictim
from .entry import ColdEntry, ColdKey

__all__ = ["Outcome", "RamTier"]

Outcome = Literal["committed", "present", "too_large", "no_room", "full"]
"""What admitting an entry did: ``committed``; ``present`` (already held, touched);
``too_large`` (over the whole budget); ``no_room`` (a spare copy that does not fit in the
free room); ``full`` (every droppable entry gone, still no room)."""


@dataclass(slots=True)
class Slot:
    id: int
    entry: ColdEntry
    last_used: int
    spare: bool = False
    """A copy written through while its block is still hot in a session."""


class RamTier:
    """Entries in RAM, never more than ``budget_bytes``."""

    def __init__(self, budget_bytes: int, policy: ColdVictim) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.puts = self.evictions = self.refused = 0
        self.on_drop: Callable[[ColdKey], None] = lambda key: None
        """Told of every entry dropped to make room (the store counts demotions)."""
        self._policy = policy
        self._slots: dict[ColdKey, Slot] = {}
        self._by_tokens: dict[tuple[str, str], dict[ColdKey, None]] = {}
        self._by_place: dict[tuple[str, str, int], dict[ColdKey, None]] = {}
        """Entries by model, prefix and position: the blocks a context may continue."""
        self._pins: dict[ColdKey, int] = {}
        self._clock = 0
        self._next_id = 0

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def pinned(self) -> int:
        return len(self._pins)

    def get(self, key: ColdKey, *, touch: bool = False) -> ColdEntry | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        if touch:
            self._clock += 1
            slot.last_used = self._clock
        return slot.entry

    def similar(self, key: ColdKey) -> ColdEntry | None:
        """An entry with ``key``'s model and tokens after a different prefix: one computed
        at the same position first (no re-rotation), then the most recently used."""
        found = [
            self._slots[k]
            for k in self._by_tokens.get((key.fingerprint, key.tokens), ())
            if k != key
        ]
        if not found:
            return None
        return max(found, key=lambda s: (s.entry.key.start == key.start, s.last_used)).entry

    def placed_at(self, fingerprint: str, prefix: str, start: int) -> list[ColdEntry]:
        """The entries that begin at ``start`` after the prefix ``prefix`` (any tokens)."""
        found = self._by_place.get((fingerprint, prefix, start), ())
        return [self._slots[k].entry for k in found]

    def pin(self, keys: Iterable[ColdKey]) -> list[ColdKey]:
        """Pin the entries under ``keys`` that are here; the keys pinned."""
        held = [k for k in keys if k in self._slots]
        for k in held:
            self._pins[k] = self._pins.get(k, 0) + 1
        return held

    def unpin(self, held: Iterable[ColdKey]) -> None:
        for k in held:
            left = self._pins[k] - 1
            if left:
                self._pins[k] = left
            else:
                del self._pins[k]

    def keep(self, key: ColdKey) -> None:
        """The entry under ``key`` is no longer a spare copy."""
        slot = self._slots.get(key)
        if slot is not None:
            slot.spare = False

    def admit(self, entry: ColdEntry, *, spare: bool = False) -> Outcome:
        """Hold ``entry``, dropping victims by the policy (never pinned ones, never for a
        ``spare`` copy, which only uses free room) when it needs room."""
        if entry.key in self._slots:
            self.get(entry.key, touch=True)
            if not spare:
                self._slots[entry.key].spare = False  # now the only copy
            return "present"
        if entry.n_bytes > self.budget_bytes:
            self.refused += 1
            return "too_large"
        if spare and self.bytes + entry.n_bytes > self.budget_bytes:
            return "no_room"
        if self.bytes + entry.n_bytes > self.budget_bytes and not self._make_room(entry.n_bytes):
            return "full"
        self._clock += 1
        self._next_id += 1
        self._slots[entry.key] = Slot(self._next_id, entry, self._clock, spare)
        self._by_tokens.setdefault((entry.key.fingerprint, entry.key.tokens), {})[entry.key] = None
        place = (entry.key.fingerprint, entry.key.prefix, entry.key.start)
        self._by_place.setdefault(place, {})[entry.key] = None
        self.bytes += entry.n_bytes
        self.puts += 1
        return "committed"

    def _make_room(self, need: int) -> bool:
        """Drop victims the policy names, never pinned ones, until ``need`` bytes fit.

        Drops nothing unless that makes enough room; False when it cannot.
        """
        droppable = {key: s for key, s in self._slots.items() if key not in self._pins}
        by_id = {slot.id: key for key, slot in droppable.items()}
        views = [
            ColdEntryView(
                id=s.id,
                cache_class=s.entry.cache_class,
                n_bytes=s.entry.n_bytes,
                last_used=s.last_used,
                spare=s.spare,
            )
            for s in droppable.values()
        ]
        victims: list[ColdKey] = []
        left = self.bytes
        for victim in self._policy.order(views):
            if left + need <= self.budget_bytes:
                break
            key = by_id.get(victim)
            if key is None or key in victims:
                continue
            victims.append(key)
            left -= droppable[key].entry.n_bytes
        if left + need > self.budget_bytes:
            return False
        for key in victims:
            self._drop(key)
        return True

    def remove(self, key: ColdKey) -> bool:
        """Let the entry under ``key`` go at once (its bytes proved unusable), pinned or
        not; whether it was here. Not a victim: not counted as an eviction."""
        if key not in self._slots:
            return False
        self._unindex(key)
        return True

    def _drop(self, key: ColdKey) -> None:
        self._unindex(key)
        self.evictions += 1
        self.on_drop(key)

    def _unindex(self, key: ColdKey) -> None:
        slot = self._slots.pop(key)
        index = (key.fingerprint, key.tokens)
        same = self._by_tokens[index]
        del same[key]
        if not same:
            del self._by_tokens[index]
        place = (key.fingerprint, key.prefix, key.start)
        here = self._by_place[place]
        del here[key]
        if not here:
            del self._by_place[place]
        self.bytes -= slot.entry.n_bytes
