"""The cold store: immutable KV blocks shared by every session of a runtime, in tiers.

RAM is the first tier. Writes go through one service task over a bounded stream (so a
flood of evictions waits instead of growing memory). The RAM tier never holds more than
its budget: to make room it drops victims in the order its policy gives. Entries in use (a
restore reading them, a prefetch holding them for the next call) are pinned and never
dropped; when nothing else can go, a put waits, bounded, for a pin to be released and
then fails with :class:`~kvrt.ColdStoreFullError`. Entries are immutable, so a block
served to one session can be served to any other.

Below RAM, an ordered list of tiers behind one protocol (:class:`~kvrt._cold.tier.ColdTier`:
the disk tier, then the remote tier, each optional): every entry admitted to RAM is
written through to them by background writers fed by a bounded queue (backpressure
again), so a crash loses only the writes in flight and a new process, or another host,
finds the blocks. A RAM victim with a copy below (or one on its way) is *demoted*, not
lost; a hit below is read, verified and *promoted* back into RAM. Closing the store
finishes the queued writes, within ``flush_timeout``.

Besides exact lookups by key, the store finds entries by their tokens alone (the same
tokens after another prefix): the *approximate* hits a policy may allow (RAM only).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio
from anyio.abc import TaskStatus

from .._errors import ColdStoreFullError, KvrtError
from ..policy import ColdVictim
from .disk import DiskStats
from .entry import ColdEntry, ColdKey
from .ram import Outcome, RamTier
from .remote import RemoteStats
from .stats import ColdStats
from .tier import ColdTier

__all__ = ["ColdStats", "ColdStore", "Fetched", "Tier"]

log = logging.getLogger("kvrt")

Tier = Literal["ram", "disk", "remote"]


@dataclass(frozen=True, slots=True)
class Fetched:
    """An entry found by :meth:`ColdStore.fetch`, and the tier it came from."""

    entry: ColdEntry
    tier: Tier


@dataclass(slots=True)
class _Put:
    entry: ColdEntry
    spare: bool = False
    """A copy of a block that is still hot: it may use free room only, never drop others."""
    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: Outcome | Literal["pending"] = "pending"
    spill: bool = False
    """Set when the commit queued the entry for the tiers below RAM."""


class ColdStore:
    """The cold tiers: RAM bounded by ``budget_bytes``, then ``tiers`` in order (nearest
    first); run :meth:`serve` in a task group."""

    def __init__(
        self,
        budget_bytes: int,
        victim_policy: ColdVictim,
        *,
        queue_size: int = 16,
        tiers: Sequence[ColdTier] = (),
        flush_timeout: float = 30.0,
        writers: int = 2,
    ) -> None:
        if budget_bytes <= 0:
            raise KvrtError("the cold store needs a budget above zero bytes")
        self.budget_bytes = budget_bytes
        self.ram = RamTier(budget_bytes, victim_policy)
        self.ram.on_drop = self._dropped
        self.tiers = tuple(tiers)
        if len({t.name for t in self.tiers}) != len(self.tiers):
            raise KvrtError("the cold store takes each kind of tier once")
        self.pending = 0
        """Blocks queued for, or being written to, the tiers below RAM."""
        self.flush_timeout = flush_timeout
        self.flush_report: str | None = None
        """What closing the store did with the writes still queued (None before close)."""
        self._writers = writers
        self._writing: dict[ColdKey, ColdEntry] = {}
        self._written: anyio.Event | None = None
        """Set when a write below RAM finishes, for whoever waits on one (then replaced)."""
        """Entries queued for the tiers below or being written: served from here meanwhile."""
        self._spill_send, self._spill_receive = anyio.create_memory_object_stream[ColdEntry](
            queue_size
        )
        self._computing: dict[ColdKey, anyio.Event] = {}
        self._freed = anyio.Event()
        self._hits = self._approx = self._misses = self._waits = self._failures = 0
        self._demoted = self._promoted = 0
        self._rejected = 0
        self._tier_hits = {t.name: 0 for t in self.tiers}
        """Fetches each tier below RAM answered."""
        self._send, self._receive = anyio.create_memory_object_stream[_Put](queue_size)

    # -- where blocks are (any task) --

    def __contains__(self, key: object) -> bool:
        """Whether any tier holds ``key``."""
        return isinstance(key, ColdKey) and self.tier(key) is not None

    def tier(self, key: ColdKey) -> Tier | None:
        """The nearest tier holding ``key``."""
        if key in self.ram or key in self._writing:
            return "ram"
        below = self._below(key)
        return below.name if below is not None else None

    def _below(self, key: ColdKey) -> ColdTier | None:
        return next((t for t in self.tiers if key in t), None)

    def lower_holds(self, key: ColdKey) -> bool:
        """Whether a tier below RAM (disk, remote) holds ``key`` now."""
        return self._below(key) is not None

    def size(self, key: ColdKey) -> int | None:
        """Bytes of the block under ``key`` in its nearest tier (on disk: its file)."""
        entry = self.peek(key)
        if entry is not None:
            return entry.n_bytes
        return next((n for t in self.tiers if (n := t.size(key)) is not None), None)

    async def discover(self, keys: Iterable[ColdKey]) -> None:
        """Ask the remote tier, in one round trip, which of ``keys`` no local tier holds it
        has (a session does this before placing a context); those count as cold after."""
        unknown = [k for k in keys if self.tier(k) is None]
        for tier in self.tiers:
            if unknown:
                await tier.discover(unknown)
                unknown = [k for k in unknown if k not in tier]

    async def wait_written(self, keys: Iterable[ColdKey], within: float) -> None:
        """Wait, at most ``within`` seconds, until none of ``keys`` is still queued for,
        or being written to, the tiers below RAM."""
        wanted = list(keys)
        with anyio.move_on_after(within):
            while any(k in self._writing for k in wanted):
                if self._written is None:
                    self._written = anyio.Event()
                await self._written.wait()

    # -- reads (any task) --

    def peek(self, key: ColdKey) -> ColdEntry | None:
        """The entry under ``key`` in RAM, without counting or touching it."""
        return self.ram.get(key) or self._writing.get(key)

    def lookup(self, key: ColdKey) -> ColdEntry | None:
        """The entry under ``key`` in RAM (counted as a hit or a miss, and touched)."""
        entry = self.ram.get(key, touch=True) or self._writing.get(key)
        if entry is None:
            self._misses += 1
        else:
            self._hits += 1
        return entry

    async def fetch(self, key: ColdKey) -> Fetched | None:
        """The entry under ``key`` from the nearest tier holding it, counted; a disk or
        remote hit is read, verified and promoted into RAM (a damaged copy is a miss)."""
        tier = self.tier(key)
        if tier is not None and tier != "ram":
            entry = await self.promote(key)
            if entry is not None:
                self._hits += 1
                self._tier_hits[tier] += 1
                return Fetched(entry, tier)
        found = self.lookup(key)  # a miss, unless another task promoted it meanwhile
        return Fetched(found, "ram") if found is not None else None

    async def promote(self, key: ColdKey) -> ColdEntry | None:
        """Read the block under ``key`` from disk or the remote tier, verified, into RAM if
        there is room (a prefetch does this ahead of the call); None if no tier has it or
        it fails a check (a damaged file is then removed; both are counted)."""
        entry = self.peek(key)
        if entry is not None:
            return entry
        for tier in self.tiers:
            if entry is None and key in tier:
                entry = await tier.read(key)
        if entry is not None and await self.put(entry, wait=0, promote=True):
            self._promoted += 1
        return entry

    def similar(self, key: ColdKey, *, count: bool = True) -> ColdEntry | None:
        """An entry in RAM with ``key``'s model and tokens after a different prefix, if
        any: one computed at the same position first (no re-rotation), then the most
        recently used. ``count`` records it as an approximate hit."""
        entry = self.ram.similar(key)
        if entry is not None and count:
            self.count_approximate(entry.key)
        return entry

    def leading(
        self,
        fingerprint: str,
        prefix: str,
        start: int,
        tokens: Sequence[int],
        lone: Container[int] = (),
    ) -> tuple[ColdEntry, int] | None:
        """The entry in RAM at ``start`` after ``prefix`` (so computed with the same
        tokens before it) that shares the longest run of leading tokens with ``tokens``
        (computed alone at the same offsets, ``lone``), and that run's length; None when
        none shares any. Its first tokens' KV is exactly what computing them would give:
        a context that diverges inside a block restores them, then computes only from
        the divergence."""
        best: tuple[ColdEntry, int] | None = None
        for entry in self.ram.placed_at(fingerprint, prefix, start):
            held = entry.meta.tokens
            n = 0
            for i, (a, b) in enumerate(zip(held, tokens, strict=False)):
                if a != b or (i in entry.lone) != (i in lone):
                    break
                n += 1
            if n and (best is None or n > best[1]):
                best = (entry, n)
        if best is not None:
            self.ram.get(best[0].key, touch=True)
        return best

    def count_approximate(self, key: ColdKey) -> None:
        """Record the entry under ``key`` as used for an approximate hit (and touch it)."""
        if self.ram.get(key, touch=True) is not None:
            self._approx += 1

    async def discard(self, key: ColdKey) -> None:
        """The engine rejected the bytes under ``key`` (they passed every check of the tier
        they came from): gone from every tier, so the block is computed and stored again.
        Counted."""
        self._rejected += 1
        self.ram.remove(key)
        self._writing.pop(key, None)
        for tier in self.tiers:
            await tier.discard(key)

    # -- pins --

    @contextmanager
    def pinned(self, keys: Iterable[ColdKey]) -> Iterator[None]:
        """Keep the entries under ``keys`` (those in RAM) from being dropped meanwhile."""
        held = self.ram.pin(keys)
        try:
            yield
        finally:
            self.ram.unpin(held)
            if held:
                self._freed.set()
                self._freed = anyio.Event()

    def keep(self, key: ColdKey) -> None:
        """The entry under ``key`` is no longer a spare copy: its block left the session
        that held it hot, so this is the copy to keep (ranked by the victim policy as any
        other)."""
        self.ram.keep(key)

    # -- blocks being computed --

    def claim(self, keys: Iterable[ColdKey]) -> Callable[[], None]:
        """Announce that the blocks under ``keys`` are on their way to the store (being
        computed, or offered by a closing session) until the returned release is called:
        another session about to compute the same blocks may wait for them
        (:meth:`computed`) and restore them instead. Keys another claim holds stay its."""
        claimed = {k: anyio.Event() for k in keys if k not in self._computing}
        self._computing.update(claimed)

        def release() -> None:
            for k, done in claimed.items():
                if self._computing.get(k) is done:
                    del self._computing[k]
                done.set()
            claimed.clear()

        return release

    def computed(self, key: ColdKey) -> anyio.Event | None:
        """Set once the session computing (or offering) ``key``'s block is done with it;
        None if no session is on it now."""
        return self._computing.get(key)

    def stats(self) -> ColdStats:
        q = self._send.statistics()
        below = {t.name: t.stats() for t in self.tiers}
        disk, remote = below.get("disk"), below.get("remote")
        return ColdStats(
            entries=len(self.ram),
            bytes=self.ram.bytes,
            budget_bytes=self.budget_bytes,
            exact_hits=self._hits,
            approximate_hits=self._approx,
            misses=self._misses,
            puts=self.ram.puts,
            evictions=self.ram.evictions,
            refused=self.ram.refused,
            rejected=self._rejected,
            pinned=self.ram.pinned,
            full_waits=self._waits,
            full_failures=self._failures,
            disk_hits=self._tier_hits.get("disk", 0),
            demoted=self._demoted,
            promoted=self._promoted,
            disk=disk if isinstance(disk, DiskStats) else None,
            remote=remote if isinstance(remote, RemoteStats) else None,
            remote_hits=self._tier_hits.get("remote", 0),
            pending_writes=self.pending,
            queue={
                "buffered": q.current_buffer_used,
                "size": int(q.max_buffer_size),
                "waiting_senders": q.tasks_waiting_send,
            },
        )

    # -- writes (through the service task) --

    async def put(
        self,
        entry: ColdEntry,
        *,
        wait: float = math.inf,
        spare: bool = False,
        promote: bool = False,
    ) -> bool:
        """Commit ``entry``; True once it is in the store, False if it is larger than the
        whole budget (or, for a ``spare`` copy — a block still hot in its session, written
        through — if it does not fit in the free room: a spare copy never drops another
        entry).

        Waits while the way in is full, and up to ``wait`` seconds while the store is full
        of entries that cannot be dropped (pinned, or kept by the victim policy); then
        raises :class:`~kvrt.ColdStoreFullError`. If the caller is cancelled after sending,
        the entry may still be committed: readers check the store, not this result.
        ``promote`` (a block read back from disk) tries once and returns False when full.
        """
        deadline = anyio.current_time() + wait
        waited = False
        while True:
            if self.ram.get(entry.key, touch=True) is not None:
                return True
            freed = self._freed
            request = _Put(entry, spare)
            await self._send.send(request)
            await request.done.wait()
            if request.outcome != "full":
                return request.outcome in ("committed", "present")  # or too_large, no_room
            if promote:
                return False
            if not waited:
                waited = True
                self._waits += 1
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await freed.wait()
            if anyio.current_time() >= deadline:
                self._failures += 1
                raise ColdStoreFullError(
                    f"the cold store ({self.budget_bytes} bytes) stayed full for {wait:g} s: "
                    f"{self.ram.pinned} entries are in use by restores or prefetches and the "
                    f"victim policy may drop none of the others to fit {entry.n_bytes} bytes"
                )

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The store's service task: commits queued entries until :meth:`close`, feeding
        the disk writers; then finishes their queue, within ``flush_timeout``."""
        async with anyio.create_task_group() as tg:
            writers_done = anyio.Event()
            if self.tiers:
                tg.start_soon(self._writers_loop, writers_done)
            else:
                writers_done.set()
            task_status.started()
            async with self._receive:
                async for request in self._receive:
                    request.outcome = self._commit(request)
                    request.done.set()
                    if request.spill:
                        await self._spill_send.send(request.entry)
            self._spill_send.close()
            began, queued = time.perf_counter(), len(self._writing)
            with anyio.move_on_after(self.flush_timeout):
                await writers_done.wait()
            if writers_done.is_set():
                if queued:
                    self.flush_report = (
                        f"finished {queued} block writes to disk in "
                        f"{time.perf_counter() - began:.2f} s at close"
                    )
            else:
                self.flush_report = (
                    f"{len(self._writing)} block writes to disk unfinished after "
                    f"{self.flush_timeout:g} s at close: those blocks are not on disk"
                )
                log.warning("kvrt: %s", self.flush_report)
                tg.cancel_scope.cancel()
        for tier in self.tiers:
            tier.close()

    def close(self) -> None:
        self._send.close()

    # -- the writers feeding the tiers below RAM --

    async def _writers_loop(self, done: anyio.Event) -> None:
        try:
            async with self._spill_receive, anyio.create_task_group() as tg:
                for _ in range(self._writers):
                    tg.start_soon(self._writer, self._spill_receive.clone())
        finally:
            done.set()

    async def _writer(self, receive: anyio.abc.ObjectReceiveStream[ColdEntry]) -> None:
        async with receive:
            async for entry in receive:
                try:
                    for tier in self._lower(entry.key):
                        await tier.write(entry)  # a failure is counted by the tier
                    # Held nowhere now (every write failed, RAM dropped it meanwhile)? Back
                    # in as a spare copy if there is free room, else tokens only (counted).
                    if (
                        entry.key not in self.ram
                        and not self.lower_holds(entry.key)
                        and self.ram.admit(entry, spare=True) != "committed"
                    ):
                        self._left_ram(entry.key)
                finally:
                    self._writing.pop(entry.key, None)
                    self.pending -= 1
                    written, self._written = self._written, None
                    if written is not None:
                        written.set()

    # -- bookkeeping (synchronous) --

    def _commit(self, request: _Put) -> Outcome:
        """Admit a put to RAM, and queue a new entry for the tiers below that lack it."""
        entry = request.entry
        outcome = self.ram.admit(entry, spare=request.spare)
        if (
            outcome == "committed"
            and entry.key not in self._writing
            and self._needs_lower(entry.key)
        ):
            self._writing[entry.key] = entry
            self.pending += 1
            request.spill = True
        return outcome

    def needs_lower(self, key: ColdKey) -> bool:
        """Whether a tier below RAM lacks ``key`` and no write of it is under way."""
        return key not in self._writing and self._needs_lower(key)

    async def write_below(self, entry: ColdEntry) -> bool:
        """Write ``entry`` to each tier below RAM that lacks it, now, without going
        through RAM (a replica shares what it answered before it answers); whether every
        tier holds it after."""
        done = True
        for tier in self._lower(entry.key):
            if entry.key not in tier:
                done = await tier.write(entry) and done
        return done

    def _lower(self, key: ColdKey) -> tuple[ColdTier, ...]:
        """The tiers below RAM ``key`` may go to: every one; the disk tier alone for a
        long-context block; none for partial-window KV."""
        if not key.session_local:
            return self.tiers
        return tuple(t for t in self.tiers if key.spills and t.name == "disk")

    def _needs_lower(self, key: ColdKey) -> bool:
        """Whether a tier ``key`` may go to lacks it (so a commit writes it through)."""
        return any(key not in t for t in self._lower(key))

    def _dropped(self, key: ColdKey) -> None:
        """A RAM victim: demoted if a tier below holds it (or is about to), else lost to
        tokens only (its writes failed, or a tier's budget let the block go)."""
        if key in self._writing or self.lower_holds(key):
            self._demoted += 1
        else:
            self._left_ram(key)

    def _left_ram(self, key: ColdKey) -> None:
        for tier in self.tiers:
            tier.left_ram(key)
