"""The cold store: immutable KV blocks in host RAM, shared by every session of a runtime.

Writes go through one service task over a bounded stream (so a flood of evictions waits
instead of growing memory); reads are plain lookups. The store never holds more than its
budget: to make room it drops victims in the order its policy gives. Entries in use (a
restore reading them, a prefetch holding them for the next call) are pinned and never
dropped; when nothing else can go, a put waits, bounded, for a pin to be released and
then fails with :class:`~kvrt.ColdStoreFullError`. Entries are immutable, so a block
served to one session can be served to any other.

Besides exact lookups by key, the store finds entries by their tokens alone (the same
tokens after another prefix): the *approximate* hits a policy may allow.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import msgspec
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskStatus

from ._backend import ColdBlock, ColdBlockMeta
from ._errors import ColdStoreFullError, KvrtError
from ._types import CacheClass, ColdEntryView

__all__ = ["ColdEntry", "ColdKey", "ColdStats", "ColdStore", "token_digest"]


def token_digest(tokens: Sequence[int], seed: bytes = b"") -> str:
    """A stable digest of a token sequence (optionally chained onto ``seed``)."""
    h = hashlib.blake2b(seed, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


class ColdKey(msgspec.Struct, frozen=True):
    """Identity of a cold block: equal keys mean restoring equals never having evicted."""

    fingerprint: str
    """Model digest plus KV layout."""
    prefix: str
    """Digest of every logical token before the block."""
    tokens: str
    """Digest of the block's own tokens."""
    start: int
    """Position of the block's first token."""


@dataclass(frozen=True, slots=True)
class ColdEntry:
    """One immutable cold block: KV bytes plus what they belong to."""

    key: ColdKey
    cache_class: CacheClass
    block: ColdBlock

    @property
    def n_bytes(self) -> int:
        return int(self.block.data.size)

    @property
    def meta(self) -> ColdBlockMeta:
        return self.block.meta

    @property
    def data(self) -> npt.NDArray[np.uint8]:
        return self.block.data


class ColdStats(msgspec.Struct, frozen=True, kw_only=True):
    """The cold store's figures, shared by every session of a runtime."""

    entries: int
    """Blocks held."""
    bytes: int
    """Bytes held."""
    budget_bytes: int
    """The store's budget; ``bytes`` never passes it."""
    exact_hits: int
    """Lookups that found an exact copy (same model, prefix, tokens, position)."""
    approximate_hits: int
    """Approximate copies used (same tokens after another prefix)."""
    misses: int
    """Lookups that found nothing."""
    puts: int
    """Blocks stored."""
    evictions: int
    """Blocks dropped to stay within budget (the cold-victim policy's choice)."""
    refused: int
    """Entries larger than the whole budget."""
    pinned: int
    """Entries in use by a restore or a prefetch, which cannot be dropped."""
    full_waits: int
    """Puts that waited for a pin to be released."""
    full_failures: int
    """Puts that gave up after the bounded wait."""
    queue: dict[str, int]
    """The bounded stream of puts toward the store: buffered, size, waiting senders."""


class ColdVictimPolicy(Protocol):
    def order(self, entries: Sequence[ColdEntryView]) -> list[int]: ...


@dataclass(slots=True)
class _Slot:
    id: int
    entry: ColdEntry
    last_used: int
    spare: bool = False


@dataclass(slots=True)
class _Put:
    entry: ColdEntry
    spare: bool = False
    """A copy of a block that is still hot: it may use free room only, never drop others."""
    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: str = "pending"
    """``committed``, ``too_large``, ``full`` (every droppable entry gone, still no room)
    or ``no_room`` (a spare copy that does not fit as things are)."""


class ColdStore:
    """Host-RAM cold tier bounded by ``budget_bytes``; run :meth:`serve` in a task group."""

    def __init__(
        self, budget_bytes: int, victim_policy: ColdVictimPolicy, *, queue_size: int = 16
    ) -> None:
        if budget_bytes <= 0:
            raise KvrtError("the cold store needs a budget above zero bytes")
        self.budget_bytes = budget_bytes
        self._policy = victim_policy
        self._slots: dict[ColdKey, _Slot] = {}
        self._by_tokens: dict[tuple[str, str], dict[ColdKey, None]] = {}
        self._pins: dict[ColdKey, int] = {}
        self._computing: dict[ColdKey, anyio.Event] = {}
        self._freed = anyio.Event()
        self._bytes = 0
        self._clock = 0
        self._next_id = 0
        self._hits = self._approx = self._misses = self._puts = 0
        self._evictions = self._refused = self._waits = self._failures = 0
        self._send, self._receive = anyio.create_memory_object_stream[_Put](queue_size)

    # -- reads (any task) --

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def lookup(self, key: ColdKey) -> ColdEntry | None:
        """The entry under ``key`` (counted as a hit or a miss, and touched)."""
        slot = self._slots.get(key)
        if slot is None:
            self._misses += 1
            return None
        self._hits += 1
        self._clock += 1
        slot.last_used = self._clock
        return slot.entry

    def peek(self, key: ColdKey) -> ColdEntry | None:
        """The entry under ``key`` without counting or touching it."""
        slot = self._slots.get(key)
        return slot.entry if slot is not None else None

    def similar(self, key: ColdKey, *, count: bool = True) -> ColdEntry | None:
        """An entry with ``key``'s model and tokens after a different prefix, if any.

        Prefers one computed at the same position (no re-rotation), then the most recently
        used. ``count`` records it as an approximate hit (see :meth:`count_approximate`).
        """
        found = [
            self._slots[k]
            for k in self._by_tokens.get((key.fingerprint, key.tokens), ())
            if k != key
        ]
        if not found:
            return None
        best = max(found, key=lambda s: (s.entry.key.start == key.start, s.last_used))
        if count:
            self.count_approximate(best.entry.key)
        return best.entry

    def count_approximate(self, key: ColdKey) -> None:
        """Record the entry under ``key`` as used for an approximate hit (and touch it)."""
        if key in self._slots:
            self._approx += 1
            self._touch(key)

    # -- pins --

    @contextmanager
    def pinned(self, keys: Iterable[ColdKey]) -> Iterator[None]:
        """Keep the entries under ``keys`` (those present) from being dropped meanwhile."""
        held = [k for k in keys if k in self._slots]
        for k in held:
            self._pins[k] = self._pins.get(k, 0) + 1
        try:
            yield
        finally:
            for k in held:
                left = self._pins[k] - 1
                if left:
                    self._pins[k] = left
                else:
                    del self._pins[k]
            if held:
                self._freed.set()
                self._freed = anyio.Event()

    def keep(self, key: ColdKey) -> None:
        """The entry under ``key`` is no longer a spare copy: its block left the session
        that held it hot, so this is the copy to keep (ranked by the victim policy as any
        other)."""
        slot = self._slots.get(key)
        if slot is not None:
            slot.spare = False

    # -- blocks being computed --

    @contextmanager
    def computing(self, keys: Iterable[ColdKey]) -> Iterator[None]:
        """Announce that the blocks under ``keys`` are being computed by one session and
        will be written to the store: another session about to compute the same blocks
        may wait for them (:meth:`computed`) and restore them instead."""
        claimed = {k: anyio.Event() for k in keys if k not in self._computing}
        self._computing.update(claimed)
        try:
            yield
        finally:
            for k, done in claimed.items():
                del self._computing[k]
                done.set()

    def computed(self, key: ColdKey) -> anyio.Event | None:
        """Set once the session computing ``key``'s block is done with it; None if no
        session is computing it now."""
        return self._computing.get(key)

    def stats(self) -> ColdStats:
        q = self._send.statistics()
        return ColdStats(
            entries=len(self._slots),
            bytes=self._bytes,
            budget_bytes=self.budget_bytes,
            exact_hits=self._hits,
            approximate_hits=self._approx,
            misses=self._misses,
            puts=self._puts,
            evictions=self._evictions,
            refused=self._refused,
            pinned=len(self._pins),
            full_waits=self._waits,
            full_failures=self._failures,
            queue={
                "buffered": q.current_buffer_used,
                "size": int(q.max_buffer_size),
                "waiting_senders": q.tasks_waiting_send,
            },
        )

    # -- writes (through the service task) --

    async def put(self, entry: ColdEntry, *, wait: float = math.inf, spare: bool = False) -> bool:
        """Commit ``entry``; True once it is in the store, False if it is larger than the
        whole budget (or, for a ``spare`` copy — a block still hot in its session, written
        through — if it does not fit in the free room: a spare copy never drops another
        entry).

        Waits while the way in is full, and up to ``wait`` seconds while the store is full
        of entries that cannot be dropped (pinned, or kept by the victim policy); then
        raises :class:`~kvrt.ColdStoreFullError`. If the caller is cancelled after sending,
        the entry may still be committed: readers check the store, not this result.
        """
        deadline = anyio.current_time() + wait
        waited = False
        while True:
            if entry.key in self._slots:
                self._touch(entry.key)
                return True
            freed = self._freed
            request = _Put(entry, spare)
            await self._send.send(request)
            await request.done.wait()
            if request.outcome != "full":
                return request.outcome == "committed"  # or too_large, or no_room
            if not waited:
                waited = True
                self._waits += 1
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await freed.wait()
            if anyio.current_time() >= deadline:
                self._failures += 1
                raise ColdStoreFullError(
                    f"the cold store ({self.budget_bytes} bytes) stayed full for {wait:g} s: "
                    f"{len(self._pins)} entries are in use by restores or prefetches and the "
                    f"victim policy may drop none of the others to fit {entry.n_bytes} bytes"
                )

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The store's service task: commits queued entries until :meth:`close`."""
        task_status.started()
        async with self._receive:
            async for request in self._receive:
                request.outcome = self._commit(request.entry, spare=request.spare)
                request.done.set()

    def close(self) -> None:
        self._send.close()

    # -- bookkeeping (synchronous) --

    def _touch(self, key: ColdKey) -> None:
        self._clock += 1
        self._slots[key].last_used = self._clock

    def _commit(self, entry: ColdEntry, *, spare: bool = False) -> str:
        if entry.key in self._slots:
            self._touch(entry.key)
            if not spare:
                self._slots[entry.key].spare = False  # now the only copy
            return "committed"
        if entry.n_bytes > self.budget_bytes:
            self._refused += 1
            return "too_large"
        if spare and self._bytes + entry.n_bytes > self.budget_bytes:
            return "no_room"
        if self._bytes + entry.n_bytes > self.budget_bytes and not self._make_room(entry.n_bytes):
            return "full"
        self._clock += 1
        self._next_id += 1
        self._slots[entry.key] = _Slot(self._next_id, entry, self._clock, spare)
        self._by_tokens.setdefault((entry.key.fingerprint, entry.key.tokens), {})[entry.key] = None
        self._bytes += entry.n_bytes
        self._puts += 1
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
        left = self._bytes
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

    def _drop(self, key: ColdKey) -> None:
        slot = self._slots.pop(key)
        index = (key.fingerprint, key.tokens)
        same = self._by_tokens[index]
        del same[key]
        if not same:
            del self._by_tokens[index]
        self._bytes -= slot.entry.n_bytes
        self._evictions += 1
