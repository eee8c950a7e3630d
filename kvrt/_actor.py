"""A session's actor task: the only writer of its engine context.

Commands arrive over a bounded mailbox and run one at a time. Engine work runs in worker
threads behind the runtime's limiter; between engine calls the actor consults the
synchronous :class:`~kvrt._residency.HotWindow`. Ordering rules that make cancellation safe:

- a block leaves the hot window only after its cold copy is committed (or the cold store
  refused it, which makes it "dropped": tokens kept, KV to be recomputed);
- a restore lands whole or not at all (the adapter's admit is all-or-nothing);
- whatever a cancelled command leaves half-done (a partly prefilled block) is cleared in
  a shielded clean-up before the next command runs.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from ._backend import AdmitMode, Engine, EngineContext, EvictMode, Logits, SamplingParams
from ._cold_store import ColdEntry, ColdKey, ColdStore
from ._config import SessionConfig
from ._errors import (
    ColdStoreFullError,
    HotWindowFullError,
    InvalidContextError,
    InvalidRangeError,
    KvrtError,
    OperationCancelledError,
    SessionClosedError,
)
from ._reports import ContextStatus, Piece, SessionCounters
from ._residency import Block, HotWindow, Segment
from ._sampling import Sampler
from ._types import ApproximateQuery, BlockView, CacheClass, Residency, RestoreQuery
from .policy import (
    Approximate,
    Calibrating,
    ColdAdmission,
    Estimating,
    HotEviction,
    Restore,
)

__all__ = [
    "Actor",
    "Admit",
    "Call",
    "Command",
    "Ensure",
    "Evict",
    "Generate",
    "SessionPolicies",
    "context_tokens",
    "segment_tokens",
]

T = TypeVar("T")
TokenKey = tuple[str, bool, bool, tuple[tuple[int, int], ...]]
"""A segment's tokenization key: text, first in the context, parse_special, markup."""
Order = Callable[[Sequence[BlockView]], list[int]]


def segment_tokens(engine: Engine, segment: Segment, *, first: bool) -> list[int]:
    """A segment's tokens as a session places them: special tokens (BOS) only before the
    context's first segment; special-token markup read only where the segment says so."""
    out: list[int] = []
    for text, special in segment.pieces():
        out += engine.tokenize(text, add_special=first and not out, parse_special=special)
    return out


def context_tokens(engine: Engine, segments: Sequence[Segment]) -> list[int]:
    """The tokens of a whole context, as a session lays them out."""
    return [t for i, seg in enumerate(segments) for t in segment_tokens(engine, seg, first=i == 0)]


# -- commands --


@dataclass(frozen=True, slots=True)
class Ensure:
    segments: tuple[Segment, ...]


@dataclass(frozen=True, slots=True)
class Generate:
    max_tokens: int
    sampling: SamplingParams
    segment: str
    cache_class: CacheClass
    stop_at_end: bool
    out: MemoryObjectSendStream[Piece]


@dataclass(frozen=True, slots=True)
class Evict:
    target: str | tuple[int, int]


@dataclass(frozen=True, slots=True)
class Admit:
    target: str | tuple[int, int]


Command = Ensure | Generate | Evict | Admit


@dataclass(slots=True, eq=False)
class Call:
    """A command in flight and the caller's side of its reply."""

    command: Command
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None
    scope: anyio.CancelScope | None = None
    abandoned: KvrtError | None = None

    def abandon(self, reason: KvrtError | None = None) -> None:
        """The caller gave up (or the session closed): skip the command, or cancel it."""
        self.abandoned = reason or OperationCancelledError("the call was cancelled")
        if self.scope is not None:
            self.scope.cancel()


@dataclass(frozen=True, slots=True)
class SessionPolicies:
    """The policy instances one session consults (the runtime's, one per name)."""

    hot_eviction: HotEviction
    cold_admission: ColdAdmission
    restore: Restore
    approximate: Approximate
    runtime: Iterable[object] = ()
    """Every policy instance of the runtime (a live view): those that calibrate themselves
    learn from every session's measured restores and prefills."""

    def learners(self) -> list[Calibrating]:
        found = [p for p in self.runtime if isinstance(p, Calibrating)]
        if isinstance(self.restore, Calibrating) and self.restore not in found:
            found.append(self.restore)
        return found


@dataclass(slots=True)
class _Tally:
    reused: int = 0
    restored: int = 0
    approximate: int = 0
    prefilled: int = 0
    evicted: int = 0


class Actor:
    """Owns one engine context and one hot window; runs commands from its mailbox."""

    def __init__(
        self,
        *,
        engine: Engine,
        ctx: EngineContext,
        window: HotWindow,
        cold: ColdStore,
        limiter: anyio.CapacityLimiter,
        config: SessionConfig,
        policies: SessionPolicies,
    ) -> None:
        self.engine = engine
        self.ctx = ctx
        self.window = window
        self.cold = cold
        self.limiter = limiter
        self.policies = policies
        self.choices: dict[int, str] = {}
        """The last residency decision per block id, for ``explain()``."""
        self.tainted: set[int] = set()
        """Blocks whose KV derives from an approximate restore: the restored blocks and
        every block computed while one of them was resident before it. Their KV never
        enters the cold store."""
        self._recompute: set[int] = set()
        self.prefetched: Callable[[], None] | None = None
        """Releases what the last prefetch holds; called when the next context is placed."""
        self.token_cache: dict[TokenKey, list[int]] = {}
        """Tokenizations a prefetch did ahead of the call that needs them."""
        self._held: tuple[ColdKey, int, Logits] | None = None
        self._override: Logits | None = None
        self.config = config
        self.counters = SessionCounters()
        self.send, self.receive = anyio.create_memory_object_stream[Call](config.mailbox)
        self.finished = anyio.Event()
        self.current: Call | None = None
        self.fault: Callable[[str], None] | None = None
        """Test hook, called with a label before every await point of a command."""
        self._tally = _Tally()
        self._resident: dict[int, int] | None = None

    # -- the task --

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with self.receive:
                async for call in self.receive:
                    await self._run_one(call)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.ctx.close, limiter=self.limiter)
            self.finished.set()

    async def _run_one(self, call: Call) -> None:
        try:
            await self._run_call(call)
        finally:
            if isinstance(call.command, Generate):
                call.command.out.close()  # its reader never waits on a reply that won't come

    async def _run_call(self, call: Call) -> None:
        if call.abandoned is not None:
            self.counters.cancelled_calls += 1
            call.error = call.abandoned
            call.done.set()
            return
        self.current = call
        # Stays the answer only if something outside this call stops the actor midway.
        call.error = SessionClosedError("the session stopped before the call finished")
        try:
            with anyio.CancelScope() as scope:
                call.scope = scope
                try:
                    call.result = await self._dispatch(call.command)
                    call.error = None
                except Exception as exc:
                    call.error = exc
                finally:
                    with anyio.CancelScope(shield=True):
                        try:
                            await self._tidy()
                        except KvrtError as exc:
                            call.error = call.error or exc
            if scope.cancelled_caught:
                self.counters.cancelled_calls += 1
                call.error = call.abandoned or OperationCancelledError("the call was cancelled")
        finally:
            self.current = None
            call.done.set()

    async def _dispatch(self, command: Command) -> Any:
        match command:
            case Ensure(segments):
                return await self._ensure(segments)
            case Generate():
                return await self._generate(command)
            case Evict(target):
                return await self._evict_target(target)
            case Admit(target):
                return await self._admit_target(target)

    # -- engine access --

    async def _engine(self, label: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.fault is not None:
            self.fault(label)
        self._resident = None
        try:
            return await anyio.to_thread.run_sync(
                partial(fn, *args, **kwargs), limiter=self.limiter
            )
        finally:
            self._resident = None  # the engine's record may have changed

    def resident(self) -> dict[int, int]:
        """Position -> token of what the engine holds (rebuilt after every engine call)."""
        if self._resident is None:
            self._resident = HotWindow.resident_map(self.ctx.positions, self.ctx.tokens)
        return self._resident

    def state(self, block: Block, resident: dict[int, int] | None = None) -> Residency:
        found = self.window.residency(
            block, self.resident() if resident is None else resident, self.cold
        )
        if found is Residency.COLD and block.id in self._recompute:
            return Residency.DROPPED  # the restore policy chose to compute it again
        return found

    async def _tidy(self) -> None:
        """Remove resident tokens that belong to no whole block (half-done work)."""
        for start, end in self.window.strays(self.resident()):
            try:
                await anyio.to_thread.run_sync(
                    partial(self.ctx.evict, start, end, EvictMode.GAP), limiter=self.limiter
                )
            finally:
                self._resident = None

    # -- moving single blocks --

    async def _evict_block(self, block: Block, *, strict: bool = False) -> None:
        await self._evict_blocks([block], strict=strict)

    def _needs_export(self, block: Block) -> bool:
        return (
            block.key(self.window.fingerprint) not in self.cold
            and block.id not in self.tainted
            and self.policies.cold_admission.admit(self.window.view(block))
        )

    async def _evict_blocks(self, blocks: Sequence[Block], *, strict: bool = False) -> None:
        """Evict ``blocks`` (in order); adjacent hot blocks that all need a cold copy are
        exported in one engine call and leave the window in one."""
        resident = self.resident()
        runs: list[list[Block]] = []
        for block in blocks:
            if self.state(block, resident) is not Residency.HOT:
                continue
            last = runs[-1][-1] if runs else None
            if (
                last is not None
                and last.end == block.start
                and self._needs_export(last)
                and self._needs_export(block)
            ):
                runs[-1].append(block)
            else:
                runs.append([block])
        for run in runs:
            await self._evict_run(run, strict=strict)

    async def _evict_run(self, run: list[Block], *, strict: bool) -> None:
        """Commit the run's KV to the cold store, then drop it from the window.

        A cold store that stays full for ``session.cold_wait`` seconds leaves a block with
        its tokens only, or, when ``strict`` (an explicit evict), raises and keeps it hot.
        """
        fingerprint = self.window.fingerprint
        held = self.ctx.logits_position
        for block in run:
            if (
                held is not None
                and block.start <= held < block.end
                and block.id not in self.tainted
            ):
                # Keep the logits after the block's last computed token: restoring the block
                # later then needs no recompute, and the continuation stays bit-exact.
                logits = await self._engine("logits", self.ctx.logits)
                self._held = (block.key(fingerprint), held, logits)
        wanted = [b for b in run if self._needs_export(b)]
        exported = {}
        if wanted:
            ranges = [(b.start, b.end) for b in wanted]
            cold_blocks = await self._engine("export", self.ctx.export_run, ranges)
            exported = {b.id: c for b, c in zip(wanted, cold_blocks, strict=True)}
        for block in run:
            key = block.key(fingerprint)
            if block.id in exported:
                if self.fault is not None:
                    self.fault("cold put")
                entry = ColdEntry(key, block.cache_class, exported[block.id])
                try:
                    committed = await self.cold.put(entry, wait=self.config.cold_wait)
                except ColdStoreFullError:
                    if strict:
                        raise
                    self.choices[block.id] = (
                        f"evicted, tokens only (cold store full for {self.config.cold_wait:g} s)"
                    )
                else:
                    self.choices[block.id] = (
                        "evicted to cold" if committed else "evicted: too large for the cold store"
                    )
            elif key in self.cold:
                self.choices[block.id] = "evicted: cold copy already held"
            elif block.id in self.tainted:
                self.choices[block.id] = "evicted, tokens only (approximate KV is never stored)"
            else:
                self.choices[block.id] = "evicted, tokens only (cold admission policy)"
        await self._engine("evict", self.ctx.evict, run[0].start, run[-1].end, EvictMode.GAP)
        self._tally.evicted += sum(b.n_tokens for b in run)

    def _room(self, keep: set[int]) -> int:
        """Tokens the window can hold besides what may not be evicted (protected, ``keep``)."""
        resident = self.resident()
        shielded = self.window.protected() | keep
        evictable = sum(
            b.n_tokens
            for b in self.window.blocks
            if b.id not in shielded and self.state(b, resident) is Residency.HOT
        )
        return self.window.budget - (self.ctx.n_resident - evictable)

    async def _make_room(self, need: int, keep: set[int]) -> None:
        """Evict by policy until ``need`` more tokens fit; never touches ``keep`` or protected blocks."""
        while self.window.budget - self.ctx.n_resident < need:
            resident = self.resident()
            shielded = self.window.protected() | keep
            candidates = [
                b
                for b in self.window.blocks
                if b.id not in shielded and self.state(b, resident) is Residency.HOT
            ]
            if not candidates:
                raise HotWindowFullError(
                    f"the hot window ({self.window.budget} tokens) cannot make room for {need} more: "
                    "every resident block is protected (sinks, the recent window or in use)"
                )
            await self._evict_block(
                self.window.eviction_order(candidates, self.policies.hot_eviction.order)[0]
            )

    async def _restore(self, block: Block, keep: set[int]) -> bool:
        return await self._restore_run([block], keep) > 0

    async def _restore_run(self, blocks: list[Block], keep: set[int]) -> int:
        """Restore adjacent cold blocks in place in one engine call; how many came back.

        Stops at the first block the store no longer holds.
        """
        entries = []
        for block in blocks:
            entry = self.cold.lookup(block.key(self.window.fingerprint))
            if entry is None:
                break
            entries.append(entry)
        if not entries:
            return 0
        run = blocks[: len(entries)]
        room = self._room(keep)
        while len(run) > 1 and sum(b.n_tokens for b in run) > room:
            run.pop()  # the rest come back in a later run, once earlier blocks can go
        entries = entries[: len(run)]
        with self.cold.pinned(e.key for e in entries):
            await self._make_room(sum(b.n_tokens for b in run), keep | {b.id for b in run})
            began = time.perf_counter()
            await self._engine("admit", self.ctx.admit_run, [e.block for e in entries])
            self._observed_restore(began, sum(e.n_bytes for e in entries))
        self._tally.restored += sum(b.n_tokens for b in run)
        for block, entry in zip(run, entries, strict=False):
            why = self._estimate(block, entry.n_bytes)
            self.choices[block.id] = f"restored from cold ({why})" if why else "restored from cold"
            self.tainted.discard(block.id)
        return len(run)

    def _observed_restore(self, began: float, n_bytes: int) -> None:
        """Hand a restore measured since ``began`` to every policy that calibrates itself."""
        seconds = time.perf_counter() - began
        for policy in self.policies.learners():
            policy.observe_restore(n_bytes, seconds)

    def _observed_prefill(self, began: float, start: int, n_tokens: int) -> None:
        """Hand a prefill measured since ``began`` to every policy that calibrates itself."""
        seconds = time.perf_counter() - began
        for policy in self.policies.learners():
            policy.observe_prefill(start, n_tokens, seconds)

    def _query(self, block: Block, n_bytes: int) -> RestoreQuery:
        return RestoreQuery(
            cache_class=block.cache_class,
            start=block.start,
            n_tokens=block.n_tokens,
            n_bytes=n_bytes,
        )

    def _estimate(self, block: Block, n_bytes: int) -> str:
        """The restore policy's cost estimates for ``block``, as text ("" if it has none)."""
        restorer = self.policies.restore
        if not isinstance(restorer, Estimating):
            return ""
        restore_s, recompute_s = restorer.estimate(self._query(block, n_bytes))
        return (
            f"est. {restore_s * 1e3:.2f} ms to restore vs {recompute_s * 1e3:.1f} ms to recompute"
        )

    def _approximate_entry(self, block: Block) -> ColdEntry | None:
        """The cold copy of ``block``'s tokens after another prefix that the session's
        approximate-hit policy accepts, if any."""
        entry = self.cold.similar(block.key(self.window.fingerprint), count=False)
        if entry is None:
            return None
        query = ApproximateQuery(
            cache_class=block.cache_class,
            start=block.start,
            source_start=entry.key.start,
            n_tokens=block.n_tokens,
            n_bytes=entry.n_bytes,
        )
        if query.shift and not self.ctx.capabilities.position_shift:
            return None
        return entry if self.policies.approximate.accept(query) else None

    async def _approximate_hit(self, block: Block, keep: set[int]) -> bool:
        """Restore ``block`` from a cold copy of its tokens after another prefix, if the
        approximate-hit policy accepts it; the window must end right before the block."""
        if self.ctx.next_position != block.start:
            return False
        entry = self._approximate_entry(block)
        if entry is None:
            return False
        self.cold.count_approximate(entry.key)
        with self.cold.pinned([entry.key]):
            await self._make_room(block.n_tokens, keep | {block.id})
            if self.ctx.next_position != block.start:
                return False
            began = time.perf_counter()
            await self._engine("admit", self.ctx.admit, entry.block, AdmitMode.TAIL)
            self._observed_restore(began, entry.n_bytes)
        self.tainted.add(block.id)
        self._tally.approximate += block.n_tokens
        shift = block.start - entry.key.start
        self.choices[block.id] = (
            f"restored approximately (same tokens after another prefix; keys re-rotated by {shift:+d})"
            if shift
            else "restored approximately (same tokens after another prefix)"
        )
        return True

    async def _prefill(self, blocks: list[Block], keep: set[int]) -> None:
        """Compute adjacent blocks in one engine call (batched: many small segments cost
        one call, not one each)."""
        ids = {b.id for b in blocks}
        await self._make_room(sum(b.n_tokens for b in blocks), keep | ids)
        began = time.perf_counter()
        await self._engine(
            "prefill",
            self.ctx.prefill,
            [t for b in blocks for t in b.tokens],
            start=blocks[0].start,
            checkpoint=anyio.from_thread.check_cancelled,
        )
        self._observed_prefill(began, blocks[0].start, sum(b.n_tokens for b in blocks))
        for block in blocks:
            self._tally.prefilled += block.n_tokens
            self._taint_if_after_approximate(block)
            if block.id in self._recompute:
                entry = self.cold.peek(block.key(self.window.fingerprint))
                why = self._estimate(block, entry.n_bytes) if entry is not None else ""
                self.choices[block.id] = (
                    f"recomputed (restore policy: {why})" if why else "recomputed (restore policy)"
                )
            else:
                self.choices[block.id] = "prefilled"

    def _taint_if_after_approximate(self, block: Block) -> None:
        """``block`` was just computed: tainted iff an approximate block is resident before it."""
        if not self.tainted:
            return
        resident = self.resident()
        if any(
            b.id in self.tainted
            and b.end <= block.start
            and self.window.residency(b, resident, ()) is Residency.HOT
            for b in self.window.blocks
        ):
            self.tainted.add(block.id)
        else:
            self.tainted.discard(block.id)

    async def _truncate_from(self, position: int) -> None:
        """Clear every resident token at ``position`` or later, committing whole blocks first."""
        await self._evict_blocks([b for b in self.window.blocks if b.start >= position])
        await self._tidy()
        tail = [p for p in self.ctx.positions if p >= position]
        if tail:
            await self._engine("evict", self.ctx.evict, tail[0], tail[-1] + 1, EvictMode.GAP)

    # -- commands --

    def tokenize(
        self,
        segments: Sequence[Segment],
        remember: dict[TokenKey, list[int]] | None = None,
    ) -> list[tuple[Segment, list[int]]]:
        """Each segment with its tokens (empty segments left out); safe from any thread.

        Uses what a prefetch tokenized; ``remember`` receives every tokenization made.
        """
        out = []
        cache = self.token_cache
        for i, seg in enumerate(segments):  # Segments, checked by the session handle
            key = (seg.text, i == 0, seg.parse_special, seg.markup)
            toks = cache.get(key)
            if toks is None:
                toks = segment_tokens(self.engine, seg, first=i == 0)
            if remember is not None:
                remember[key] = toks
            out.append((seg, toks))
        if not any(toks for _, toks in out):
            raise InvalidContextError("the context is empty: every segment's text is empty")
        return [(seg, toks) for seg, toks in out if toks]

    async def _ensure(self, segments: Sequence[Segment]) -> ContextStatus:
        self.counters.ensure_calls += 1
        self._tally = tally = _Tally()
        try:
            return await self._ensure_placed(segments, tally)
        finally:
            # A prefetch held its blocks for this call: whatever it did not use may go now.
            release, self.prefetched = self.prefetched, None
            self.token_cache = {}
            if release is not None:
                release()

    async def _ensure_placed(self, segments: Sequence[Segment], tally: _Tally) -> ContextStatus:
        tokenized = await anyio.to_thread.run_sync(self.tokenize, segments)
        layout, stale = self.window.plan_layout(tokenized)
        resident = self.resident()
        tally.reused = sum(
            b.n_tokens for b in layout if self.window.residency(b, resident, ()) is Residency.HOT
        )
        await self._evict_blocks(sorted(stale, key=lambda b: b.start))
        self.window.adopt(layout)
        self.tainted &= {b.id for b in layout}
        await self._tidy()
        await self._place(layout)
        await self._last_logits()
        return self._status(tally)

    async def _place(self, layout: list[Block]) -> None:
        """Bring the layout's blocks in, left to right, keeping the window within budget.

        Cold blocks come back when the plan (the policy applied to the whole context) keeps
        them hot. llama.cpp computes only at the tail of the window, so from the first block
        that must be computed on, blocks are placed in order and a computed block's
        predecessor is made resident first.
        """
        planned = self.window.plan_hot(self.policies.hot_eviction.order)
        self._recompute = set()
        resident = self.resident()
        for block in layout:
            if self.window.residency(block, resident, self.cold) is Residency.COLD:
                entry = self.cold.peek(block.key(self.window.fingerprint))
                query = self._query(block, entry.n_bytes if entry is not None else 0)
                if not self.policies.restore.restore(query):
                    self._recompute.add(block.id)
        try:
            await self._place_blocks(layout, planned)
            await self._converge(layout, planned)
        finally:
            self._recompute = set()

    async def _converge(self, layout: list[Block], planned: set[int]) -> None:
        """Bring back planned blocks that computing later ones pushed out, in exchange for
        unplanned ones, so the window ends as the eviction policy chose."""
        for block in layout:
            if block.id in planned and self.state(block) is Residency.COLD:
                try:
                    await self._restore_run([block], planned)
                except HotWindowFullError:
                    return  # only planned or protected blocks left to evict

    async def _place_blocks(self, layout: list[Block], planned: set[int]) -> None:
        i, computing = 0, False
        while i < len(layout):
            block = layout[i]
            pred = {layout[i - 1].id} if i else set()
            state = self.state(block)
            if state is Residency.HOT:
                i += 1
                continue
            if state is Residency.COLD:
                # Restore what the plan keeps hot, and a block the next one is computed after;
                # adjacent planned cold blocks come back in one go.
                after = layout[i + 1] if i + 1 < len(layout) else None
                feeds = computing and after is not None and self.state(after) is Residency.DROPPED
                if block.id not in planned and not feeds:
                    i += 1
                    continue
                run = [block]
                while (
                    i + len(run) < len(layout)
                    and layout[i + len(run)].id in planned
                    and self.state(layout[i + len(run)]) is Residency.COLD
                ):
                    run.append(layout[i + len(run)])
                restored = await self._restore_run(run, pred)
                if not restored:
                    continue  # dropped from the store meanwhile: look again
                i += restored
                continue
            if not computing:
                j = i
                while j > 0 and self.state(layout[j - 1]) is Residency.DROPPED:
                    j -= 1
                await self._truncate_from(layout[j].start)
                if j > 0 and self.state(layout[j - 1]) is Residency.COLD:
                    await self._restore(layout[j - 1], set())
                computing, i = True, j
                continue
            if i and self.state(layout[i - 1]) is not Residency.HOT:
                await self._restore(layout[i - 1], set())  # the tail must end right before it
            if await self._approximate_hit(block, pred):
                i += 1
                continue
            run, room = [block], self._room(pred)
            while i + len(run) < len(layout):
                after = layout[i + len(run)]
                if (
                    self.state(after) is not Residency.DROPPED
                    or sum(b.n_tokens for b in run) + after.n_tokens > room
                    or self._approximate_entry(after) is not None
                ):
                    break
                run.append(after)
            await self._prefill(run, pred)
            i += len(run)

    async def _last_logits(self) -> None:
        """Make sure logits follow the context's last token.

        They are the engine's own when it computed that token last; the ones kept when its
        block was evicted, if that exact block came back; otherwise the token is computed
        again.
        """
        self._override = None
        last = self.window.length - 1
        if last < 0 or self.ctx.logits_position == last:
            return
        token = self.window.blocks[-1].tokens[-1]
        held = self._held
        tail = self.window.blocks[-1]
        if (
            held is not None
            and held[0] == tail.key(self.window.fingerprint)
            and held[1] == last
            and self.resident().get(last) == token
        ):
            self._override = held[2]
            return
        if self.resident().get(last) == token:
            await self._engine("evict", self.ctx.evict, last, last + 1, EvictMode.GAP)
        await self._make_room(1, {self.window.blocks[-1].id})
        await self._engine("prefill", self.ctx.prefill, [token], start=last)
        self._tally.prefilled += 1

    def _status(self, tally: _Tally) -> ContextStatus:
        c = self.counters
        c.reused_tokens += tally.reused
        c.restored_tokens += tally.restored
        c.approximate_tokens += tally.approximate
        c.prefilled_tokens += tally.prefilled
        c.evicted_tokens += tally.evicted
        sizes = self.residency_tokens()
        resident = self.resident()
        invisible = dict.fromkeys(
            b.segment
            for b in self.window.blocks
            if self.window.residency(b, resident, ()) is not Residency.HOT
        )
        exact_restores = self.ctx.capabilities.exact_in_place
        approximate_context = self.approximate_context_tokens()
        return ContextStatus(
            reused_tokens=tally.reused,
            restored_tokens=tally.restored,
            approximate_tokens=tally.approximate,
            prefilled_tokens=tally.prefilled,
            evicted_tokens=tally.evicted,
            hot_tokens=self.ctx.n_resident,
            logical_tokens=self.window.length,
            cold_tokens=sizes[Residency.COLD],
            dropped_tokens=sizes[Residency.DROPPED],
            exact_restores=exact_restores,
            exact=not approximate_context
            and not tally.approximate
            and (exact_restores or not tally.restored),
            visible_tokens=sizes[Residency.HOT],
            invisible_segments=tuple(invisible),
            approximate_context_tokens=approximate_context,
        )

    def approximate_context_tokens(self) -> int:
        """Resident tokens whose KV derives from an approximate restore."""
        resident = self.resident()
        return sum(
            b.n_tokens
            for b in self.window.blocks
            if b.id in self.tainted and self.window.residency(b, resident, ()) is Residency.HOT
        )

    def residency_tokens(self) -> dict[str, int]:
        resident = self.resident()
        sizes = dict.fromkeys(Residency, 0)
        for b in self.window.blocks:
            sizes[self.window.residency(b, resident, self.cold)] += b.n_tokens
        return {str(k): v for k, v in sizes.items()}

    async def _generate(self, cmd: Generate) -> int:
        self.counters.generate_calls += 1
        self._tally = tally = _Tally()
        sampler = Sampler(cmd.sampling)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        produced = 0
        async with cmd.out:
            if self.window.length == 0:
                raise InvalidRangeError("nothing to continue: call ensure_context first")
            await self._last_logits()
            resident = self.resident()
            after_approximate = any(
                b.id in self.tainted and self.window.residency(b, resident, ()) is Residency.HOT
                for b in self.window.blocks
            )
            if self._override is not None:
                logits: Logits = self._override
            else:
                logits = await self._engine("logits", self.ctx.logits)
            self._override = None
            while produced < cmd.max_tokens:
                token = sampler.choose(logits)
                if cmd.stop_at_end and self.engine.is_end_of_generation(token):
                    break
                if self.window.length >= self.window.planner_context:
                    break
                last = self.window.blocks[-1]
                await self._make_room(1, {last.id})
                logits = await self._engine("step", self.ctx.step, token)
                grown = self.window.append_token(token, cmd.segment, cmd.cache_class)
                if after_approximate:
                    self.tainted.add(grown.id)
                produced += 1
                self.counters.generated_tokens += 1
                text = decoder.decode(self.engine.token_bytes(token))
                if self.fault is not None:
                    self.fault("stream")
                try:
                    await cmd.out.send(Piece(text=text, token=token, index=produced - 1))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    break  # the reader went away: stop, keeping what was generated
        self._status(tally)
        return produced

    # -- explicit control --

    def _target_blocks(self, target: str | tuple[int, int]) -> list[Block]:
        if isinstance(target, str):
            return self.window.segment_blocks(target)
        start, end = target
        blocks = self.window.range_blocks(start, end)
        if not blocks:
            raise InvalidRangeError(f"range [{start}, {end}) covers no whole block of this session")
        return blocks

    async def _evict_target(self, target: str | tuple[int, int]) -> int:
        blocks = self._target_blocks(target)
        if blocks[-1] is self.window.blocks[-1]:
            raise InvalidRangeError(
                f"{target!r} holds the context's last token, which generation continues from; "
                "it stays hot"
            )
        self._tally = tally = _Tally()
        await self._evict_blocks(blocks, strict=True)
        self._status(tally)
        return tally.evicted

    async def _admit_target(self, target: str | tuple[int, int]) -> int:
        blocks = self._target_blocks(target)
        self._tally = tally = _Tally()
        for block in blocks:
            if self.state(block) is Residency.DROPPED:
                raise KvrtError(
                    f"block {block.index} of {block.segment!r} has no KV bytes left; "
                    "send it again with ensure_context to recompute it"
                )
        runs: list[list[Block]] = []
        for block in blocks:
            if self.state(block) is not Residency.COLD:
                continue
            if runs and runs[-1][-1].end == block.start:
                runs[-1].append(block)
            else:
                runs.append([block])
        for run in runs:
            await self._restore_run(run, set())
        self._status(tally)
        return tally.restored
