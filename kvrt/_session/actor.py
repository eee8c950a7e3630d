"""A session's actor task: the only writer of its engine context.

Commands arrive over a bounded mailbox and run one at a time; whatever a cancelled
command leaves half-done (a partly prefilled block) is cleared in a shielded clean-up
before the next command runs. Generation streams back through a bounded channel.

After each command, before its caller hears back, the actor publishes an immutable view
of the session (:meth:`Actor.report`'s base): ``explain()`` never reads the engine
context's record while a worker thread may be changing it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskStatus

from .._cold import ColdKey
from .._errors import (
    InvalidRangeError,
    KvrtError,
    NotInColdStoreError,
    OperationCancelledError,
    SessionClosedError,
)
from .._paging.gate import EngineGate, SessionParts, Tally
from .._paging.long import LongContext
from .._paging.moves import Paging
from .._paging.placement import Placement
from .._paging.scoring import Scoring
from .._paging.segments import Segment
from .._paging.tokens import Prepared
from .._paging.window import Block
from .._reports import BlockReport, SessionReport, segment_reports
from .._types import CacheClass, Residency
from .generation import Generate, Generation

__all__ = [
    "Actor",
    "Admit",
    "Command",
    "Ensure",
    "Evict",
    "Generate",
    "NextLogits",
    "Pending",
    "Snapshot",
]

CLOSE_OFFER_SECONDS = 30.0
"""At most this long copying a closing session's hot blocks to the cold store."""


# -- commands --


@dataclass(frozen=True, slots=True)
class Ensure:
    segments: tuple[Segment, ...]
    prepared: Prepared | None = None
    require: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Evict:
    target: str | tuple[int, int]


@dataclass(frozen=True, slots=True)
class Admit:
    target: str | tuple[int, int]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Copy the hot blocks to the cold store (they stay hot) and describe the context."""


@dataclass(frozen=True, slots=True)
class NextLogits:
    """The logits after the context's last token."""


Command = Ensure | Generate | Evict | Admit | Snapshot | NextLogits


@dataclass(slots=True, eq=False)
class Pending:
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


class Actor:
    """Owns one engine context and one hot window; runs commands from its mailbox.

    Composed, not inherited: the engine gate (every engine call, the KV's provenance,
    the counters), paging (every block move), scoring, placement (the planner's steps
    run by paging) and generation, each handed the parts it uses."""

    def __init__(self, parts: SessionParts) -> None:
        self.gate = gate = EngineGate(parts)
        self.paging = Paging(gate)
        self.scoring = Scoring(gate)
        self.placement = Placement(gate, self.paging, self.scoring)
        self.contexts = LongContext(self.placement)
        self.generation = Generation(gate, self.paging, self.placement, self.contexts)
        self.engine, self.ctx, self.window = parts.engine, parts.ctx, parts.window
        self.cold, self.turns = parts.cold, parts.turns
        self.policies, self.config, self.replies = parts.policies, parts.config, parts.replies
        self.share = parts.share
        self.tokenize = self.placement.tokenize
        self.send, self.receive = anyio.create_memory_object_stream[Pending](parts.config.mailbox)
        self.finished = anyio.Event()
        self.current: Pending | None = None
        self._view = self._build_view()
        """What the session looked like after its last command (see :meth:`report`)."""
        self._closing = False
        self._offering: Callable[[], None] | None = None
        """Releases the claim on the blocks the close will offer (see :meth:`closing`)."""

    @property
    def fault(self) -> Callable[[str], None] | None:
        """Test hook, called with a label before every await point of a command."""
        return self.gate.fault

    @fault.setter
    def fault(self, hook: Callable[[str], None] | None) -> None:
        self.gate.fault = hook

    # -- the task --

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with self.receive:
                async for call in self.receive:
                    await self._run_one(call)
                    # An idle session holds nothing of its last call: its context may be
                    # a conversation of many megabytes.
                    del call
        finally:
            self._closing = True
            with anyio.CancelScope(shield=True):
                try:
                    await self._offer_on_close()
                finally:
                    self._release_offer()
                await self.turns.run(None, "close", self.ctx.close)
            self.finished.set()

    def closing(self) -> None:
        """The session is about to close while idle: claim in the cold store the blocks
        its close will offer (:meth:`.ColdStore.claim`), so a session placing the same
        context meanwhile waits for those copies and restores them rather than computing
        them again. Synchronous; released once the offer is done or given up."""
        if self.current is None and not self._closing and self._offering is None:
            self._offering = self.cold.claim(self.paging.offered(self.window.blocks))

    def _release_offer(self) -> None:
        release, self._offering = self._offering, None
        if release is not None:
            release()

    async def _offer_on_close(self) -> None:
        """Offer the hot blocks to the cold store before the KV is freed (as the cold
        admission policy allows), so the next session with this context restores it."""
        # A failed engine context's KV goes anyway: nothing else is at stake.
        with anyio.move_on_after(CLOSE_OFFER_SECONDS), suppress(KvrtError):
            await self.paging.write_back(self.window.blocks)

    async def _run_one(self, call: Pending) -> None:
        try:
            await self._run_call(call)
        finally:
            if isinstance(call.command, Generate):
                call.command.out.close()  # its reader never waits on a reply that won't come

    async def _run_call(self, call: Pending) -> None:
        self._release_offer()  # a call run after the close began may change the window
        if call.abandoned is not None:
            self.gate.counters.cancelled_calls += 1
            call.error = call.abandoned
            call.done.set()
            return
        self.current = call
        # What the engine-turn policy sees of this command: its engine time, its tokens left.
        self.gate.served.seconds, self.gate.served.left = 0.0, 0
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
                            await self.gate.tidy()
                        except KvrtError as exc:
                            call.error = call.error or exc
            if scope.cancelled_caught:
                self.gate.counters.cancelled_calls += 1
                call.error = call.abandoned or OperationCancelledError("the call was cancelled")
        finally:
            self.current = None
            self._view = self._build_view()
            call.done.set()

    async def _dispatch(self, command: Command) -> Any:
        match command:
            case Ensure(segments, prepared, require):
                status, _ = await self.contexts.ensure(segments, prepared, require=require)
                return status
            case Generate():
                return await self.generation.generate(command)
            case Evict(target):
                return await self._evict_target(target)
            case Admit(target):
                return await self._admit_target(target)
            case Snapshot():
                return await self._snapshot()
            case NextLogits():
                return await self._next_logits()

    async def _next_logits(self) -> npt.NDArray[np.float32]:
        self.generation.check_placed()
        await self.placement.last_logits()  # reported by no status: its tally goes
        held = self.gate.override
        logits = held if held is not None else await self.gate.logits()
        return np.array(logits, dtype=np.float32, copy=True)

    async def _snapshot(
        self,
    ) -> tuple[list[tuple[str, CacheClass, float | None, list[int], list[int]]], list[ColdKey]]:
        """The context as segments (name, class, score, tokens, offsets of the tokens
        computed alone) and its blocks' keys, once every hot block has a cold copy (as the
        cold admission policy allows)."""
        await self.paging.write_back(self.window.blocks, spare=True)
        segments: list[tuple[str, CacheClass, float | None, list[int], list[int]]] = []
        for b in self.window.blocks:
            if not segments or segments[-1][0] != b.segment:
                segments.append((b.segment, b.cache_class, b.score, [], []))
            tokens, lone = segments[-1][3], segments[-1][4]
            lone.extend(len(tokens) + i for i in sorted(b.lone))
            tokens.extend(b.tokens)
        return segments, [b.key(self.window.fingerprint) for b in self.window.blocks]

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
        tally = await self.paging.evict_blocks(blocks, strict=True)
        self.gate.record(tally)
        return tally.evicted

    async def _admit_target(self, target: str | tuple[int, int]) -> int:
        blocks = self._target_blocks(target)
        tally = Tally()
        for block in blocks:
            if self.gate.state(block) is Residency.DROPPED:
                raise NotInColdStoreError(
                    f"block {block.index} of {block.segment!r} has no KV bytes left; "
                    "send it again with ensure_context to recompute it"
                )
        runs: list[list[Block]] = []
        for block in blocks:
            if self.gate.state(block) is not Residency.COLD:
                continue
            if runs and runs[-1][-1].end == block.start:
                runs[-1].append(block)
            else:
                runs.append([block])
        for run in runs:
            tally += (await self.paging.restore_run(run, set()))[1]
        self.gate.record(tally)
        return tally.restored

    # -- explain --

    def report(self, name: str, *, closed: bool) -> SessionReport:
        """``Session.explain()``: the view the actor published after its last command, with
        the cold store's and the mailbox's figures as they are now (both live on the event
        loop, never in a worker thread)."""
        mb = self.send.statistics()
        return msgspec.structs.replace(
            self._view,
            name=name,
            closed=closed,
            cold_store=self.cold.stats(),
            mailbox={
                "queued": mb.current_buffer_used,
                "size": int(mb.max_buffer_size),
                "waiting_callers": mb.tasks_waiting_send,
                "in_flight": int(self.current is not None),
            },
        )

    def _build_view(self) -> SessionReport:
        """The session's state now, its counters copied: run by the actor between engine
        calls only."""
        window = self.window
        resident = self.gate.resident()
        protected = window.protected()
        states = {b.id: window.residency(b, resident, self.cold) for b in window.blocks}
        blocks = [
            BlockReport(
                segment=b.segment,
                index=b.index,
                start=b.start,
                n_tokens=b.n_tokens,
                cache_class=b.cache_class,
                residency=states[b.id],
                protected=b.id in protected,
                last_used=b.last_used,
                choice=self.gate.choices.get(b.id),
                approximate=states[b.id] is Residency.HOT and self.gate.is_approximate(b, resident),
                partial_window=(
                    self.gate.is_partial(b, resident)
                    if states[b.id] is Residency.HOT
                    else (key := self.paging.restorable_key(b)) is not None and key.session_local
                ),
                relevance=window.relevance.get(b.id),
                cold_tier=(
                    self.cold.tier(b.key(window.fingerprint))
                    if states[b.id] is Residency.COLD
                    else None
                ),
            )
            for b in window.blocks
        ]
        problems = []
        if self.ctx.n_resident > self.ctx.n_ctx:
            problems.append(
                f"{self.ctx.n_resident} resident tokens exceed the budget of {self.ctx.n_ctx}"
            )
        for start, end in window.strays(resident):
            problems.append(f"resident positions [{start}, {end}) belong to no whole block")
        expected = 0
        for b in window.blocks:
            if b.start != expected:
                problems.append(
                    f"block {b.segment}#{b.index} starts at {b.start}, expected {expected}"
                )
            expected = b.end
        return SessionReport(
            name="",
            closed=False,
            hot_budget=self.ctx.n_ctx,
            hot_tokens=self.ctx.n_resident,
            planner_context=window.planner_context,
            logical_tokens=window.length,
            blocks=blocks,
            segments=segment_reports(blocks, window.required),
            residency_tokens=self.gate.residency_tokens(),
            cold_store=self.cold.stats(),
            mailbox={},
            counters=copy.copy(self.gate.counters),
            engine=copy.copy(self.ctx.counters),
            capabilities=self.ctx.capabilities,
            exact_restores=self.ctx.capabilities.exact_in_place,
            approximate_tokens=self.gate.approximate_context_tokens(),
            partial_window_tokens=self.gate.partial_window_tokens(),
            consistent=not problems,
            problems=problems,
            relevance_scoring=window.relevance_scoring,
            recurrent_seen_tokens=(
                min(self.ctx.next_position, window.length)
                if self.ctx.capabilities.recurrent
                else None
            ),
        )
