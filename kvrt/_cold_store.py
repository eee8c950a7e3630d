"""The cold store: immutable KV blocks in host RAM, shared by every session of a runtime.

Writes go through one service task over a bounded stream (so a flood of evictions waits
instead of growing memory); reads are plain lookups. The store never holds more than its
budget: to make room it drops victims in the order its policy gives. Entries are
immutable, so a block served to one session can be served to any other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import msgspec
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskStatus

from ._backend import ColdBlock, ColdBlockMeta
from ._errors import KvrtError
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
    entries: int
    bytes: int
    budget_bytes: int
    exact_hits: int
    misses: int
    puts: int
    evictions: int
    refused: int
    queue: dict[str, int]


class ColdVictimPolicy(Protocol):
    def order(self, entries: Sequence[ColdEntryView]) -> list[int]: ...


@dataclass(slots=True)
class _Slot:
    id: int
    entry: ColdEntry
    last_used: int


@dataclass(slots=True)
class _Put:
    entry: ColdEntry
    done: anyio.Event = field(default_factory=anyio.Event)
    committed: bool = False


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
        self._bytes = 0
        self._clock = 0
        self._next_id = 0
        self._hits = self._misses = self._puts = self._evictions = self._refused = 0
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

    def stats(self) -> ColdStats:
        q = self._send.statistics()
        return ColdStats(
            entries=len(self._slots),
            bytes=self._bytes,
            budget_bytes=self.budget_bytes,
            exact_hits=self._hits,
            misses=self._misses,
            puts=self._puts,
            evictions=self._evictions,
            refused=self._refused,
            queue={
                "buffered": q.current_buffer_used,
                "size": int(q.max_buffer_size),
                "waiting_senders": q.tasks_waiting_send,
            },
        )

    # -- writes (through the service task) --

    async def put(self, entry: ColdEntry) -> bool:
        """Commit ``entry``; True once it is in the store, False if it cannot fit at all.

        Waits while the way in is full. If the caller is cancelled after sending, the
        entry may still be committed: readers check the store, not this result.
        """
        if entry.key in self._slots:
            self._touch(entry.key)
            return True
        request = _Put(entry)
        await self._send.send(request)
        await request.done.wait()
        return request.committed

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The store's service task: commits queued entries until :meth:`close`."""
        task_status.started()
        async with self._receive:
            async for request in self._receive:
                request.committed = self._commit(request.entry)
                request.done.set()

    def close(self) -> None:
        self._send.close()

    # -- bookkeeping (synchronous) --

    def _touch(self, key: ColdKey) -> None:
        self._clock += 1
        self._slots[key].last_used = self._clock

    def _commit(self, entry: ColdEntry) -> bool:
        if entry.key in self._slots:
            self._touch(entry.key)
            return True
        if entry.n_bytes > self.budget_bytes:
            self._refused += 1
            return False
        if self._bytes + entry.n_bytes > self.budget_bytes:
            self._make_room(entry.n_bytes)
        self._clock += 1
        self._next_id += 1
        self._slots[entry.key] = _Slot(self._next_id, entry, self._clock)
        self._bytes += entry.n_bytes
        self._puts += 1
        return True

    def _make_room(self, need: int) -> None:
        by_id = {slot.id: key for key, slot in self._slots.items()}
        views = [
            ColdEntryView(
                id=s.id,
                cache_class=s.entry.cache_class,
                n_bytes=s.entry.n_bytes,
                last_used=s.last_used,
            )
            for s in self._slots.values()
        ]
        for victim in self._policy.order(views):
            if self._bytes + need <= self.budget_bytes:
                break
            slot = self._slots.pop(by_id[victim])
            self._bytes -= slot.entry.n_bytes
            self._evictions += 1
        if self._bytes + need > self.budget_bytes:  # a policy must order every entry
            raise KvrtError("cold victim policy left the store over budget")
