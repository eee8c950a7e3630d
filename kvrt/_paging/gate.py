"""The engine gate: every engine call goes through here, in a worker thread when the
runtime's engine turns give it a slot (:mod:`kvrt._engine.turns`); residency is derived from
what the engine holds (never stored); the tallies and the status of a call are counted
here.

The hot-window bookkeeping it consults (:mod:`.layout`) is synchronous and free of
``await``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, TypeVar

from .._chat.replies import ReplyMemory
from .._cold import ColdKey, ColdStore
from .._config import SessionConfig
from .._engine.contract import (
    Engine,
    EngineContext,
    EvictMode,
    Logits,
    ModelFacts,
    StepsTogether,
)
from .._engine.turns import EngineTurns, Join, Served
from .._reports import ContextStatus, SessionCounters, TokenOrigins
from .._types import CheckpointView, Residency
from ..policy import (
    Approximate,
    Calibrating,
    Checkpoints,
    ColdAdmission,
    HotEviction,
    MessageClass,
    PartialWindow,
    Restore,
    WriteThrough,
)
from .provenance import APPROXIMATE, Place, Provenance, is_approximate, partial_key
from .window import Block, HotWindow, runs_of

__all__ = ["EngineGate", "SessionParts", "SessionPolicies", "Tally", "Written"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SessionPolicies:
    """The policy instances one session consults (the runtime's, one per name)."""

    hot_eviction: HotEviction
    cold_admission: ColdAdmission
    restore: Restore
    approximate: Approximate
    partial_window: PartialWindow
    write_through: WriteThrough
    message_class: MessageClass
    checkpoint: Checkpoints
    long_approximate: Approximate
    """What the window of a long context shown for a question follows instead of
    ``approximate`` (``allow``, where a long session names no approximate policy: its
    blocks come back from their copies); everything else the session places follows
    ``approximate``."""
    runtime: Iterable[object] = ()
    """Every policy instance of the runtime (a live view): those that calibrate themselves
    learn from every session's measured restores and prefills."""

    def checkpointed(self, blocks: Sequence[Block], facts: ModelFacts) -> list[int]:
        """The ends of ``blocks`` after which the checkpoint policy keeps the recurrent
        state, on a model that has one."""
        if not facts.checkpoint_bytes:
            return []
        return [
            b.end
            for b in blocks
            if self.checkpoint.keep(
                CheckpointView(
                    cache_class=b.cache_class,
                    n_tokens=b.n_tokens,
                    kv_bytes=b.n_tokens * facts.kv_bytes_per_token,
                    checkpoint_bytes=facts.checkpoint_bytes,
                )
            )
        ]

    def learners(self) -> list[Calibrating]:
        found = [p for p in self.runtime if isinstance(p, Calibrating)]
        if isinstance(self.restore, Calibrating) and self.restore not in found:
            found.append(self.restore)
        return found


@dataclass(frozen=True, slots=True)
class SessionParts:
    """What a session's actor is built from (the runtime assembles it)."""

    engine: Engine
    ctx: EngineContext
    window: HotWindow
    cold: ColdStore
    turns: EngineTurns
    config: SessionConfig
    policies: SessionPolicies
    replies: ReplyMemory
    """The runtime's memory of generated replies, shared by its sessions."""
    share: bool = False
    """Replicas share a remote server: before a generation returns, the context's blocks
    and the reply reach it (so another replica continues exactly as this one would)."""


@dataclass(slots=True)
class Tally:
    """What a move, a step or a whole command did, in tokens (work: a block computed,
    pushed out and brought back counts twice), and where the KV of each position it wrote
    came from.

    Every move of the executor (:mod:`.paging`) returns the tally of what it did; a
    command adds up the tallies of its moves (``tally += moved``) and reports the sum.
    Nothing else writes one."""

    reused: int = 0
    restored: int = 0
    approximate: int = 0
    prefilled: int = 0
    evicted: int = 0
    sources: dict[int, str] = field(default_factory=dict)
    """Position -> ``prefilled``, ``restored``, ``approximate`` or ``generated``: the last
    engine call that wrote its KV."""

    def __iadd__(self, later: Tally) -> Tally:
        """Add what ``later`` did (its sources win where both wrote a position)."""
        self.reused += later.reused
        self.restored += later.restored
        self.approximate += later.approximate
        self.prefilled += later.prefilled
        self.evicted += later.evicted
        self.sources.update(later.sources)
        return self

    def wrote(self, writes: Iterable[Written]) -> None:
        """Record where the KV of the positions an engine call wrote came from."""
        for w in writes:
            self.sources.update(dict.fromkeys(range(w.start, w.end), w.source))


class Written(NamedTuple):
    """Positions an engine call makes resident: the provenance mark their KV gets (see
    :mod:`.provenance`; None: exact), where it comes from (a :class:`Tally` source),
    where no block of the layout holds them yet (a generated token), the place of the
    block that will (start, prefix), and which of them are computed alone (a generated
    token, a replayed one, or restored bytes of such tokens)."""

    start: int
    end: int
    mark: str | None
    source: str
    place: tuple[int, str] | None = None
    lone: frozenset[int] = frozenset()


class EngineGate:
    """One session's engine context, hot window and cold store, and the state the
    session's components (paging, scoring, placement, generation; see :mod:`.actor`) share
    through it: policies, choices, the KV's provenance, counters."""

    def __init__(self, parts: SessionParts) -> None:
        self.engine = parts.engine
        self.ctx = parts.ctx
        self.window = parts.window
        self.cold = parts.cold
        self.turns = parts.turns
        self.served = Served()
        """Engine time of the command under way (the actor resets it for each one)."""
        self.policies = parts.policies
        self.config = parts.config
        self.replies = parts.replies
        self.share = parts.share
        self.choices: dict[int, str] = {}
        """The last residency decision per block id, for ``explain()``."""
        self.provenance = Provenance()
        """Which resident tokens hold approximate or partial-window KV (see
        :mod:`.provenance`)."""
        self.held: tuple[ColdKey, int, Logits] | None = None
        self.override: Logits | None = None
        self.counters = SessionCounters()
        self.placed = True
        """False from the moment an ``ensure_context`` adopts its layout until the
        context is in place: a cancelled or failed placement leaves it False, and
        generating from such a layout is refused."""
        self.fault: Callable[[str], None] | None = None
        """Test hook, called with a label before every await point of a command."""
        self._resident: dict[int, int] | None = None

    # -- engine access --

    async def call(
        self,
        label: str,
        fn: Callable[..., T],
        *args: Any,
        writes: Sequence[Written] = (),
        light: bool = False,
        join: Join | None = None,
        **kwargs: Any,
    ) -> T:
        """Run ``fn`` in a worker thread on the engine's next turn for this session (its
        time counts to the command's :attr:`served`). ``writes`` are the positions
        the call makes resident: their marks are set right before it runs (see
        :mod:`.provenance`); the caller's tally records their sources
        (:meth:`Tally.wrote`). A ``light`` call computes nothing (:meth:`drop`,
        :meth:`logits`) and waits for no turn. With ``join``, the call may run in one
        engine call with other sessions' (see :meth:`joint_step`)."""
        if self.fault is not None:
            self.fault(label)
        for w in writes:
            self.provenance.set(w.start, w.end, w.mark)
            if w.place is not None:
                self.provenance.attend(w.start, w.end, [(w.start, w.end, w.place)])
            else:
                self.provenance.attend(w.start, w.end, [p[:3] for p in self._places()])
            self.provenance.lineage(w.start, w.end, w.lone)
        self._resident = None
        try:
            return await self.turns.run(
                self.served, label, partial(fn, *args, **kwargs), light=light, join=join
            )
        finally:
            self._resident = None  # the engine's record may have changed

    def joint_step(self, token: int) -> Join | None:
        """How a step of ``token`` may join other sessions' steps in one engine call,
        where the engine offers it for this window (None: it steps alone)."""
        engine = self.engine
        if not isinstance(engine, StepsTogether) or not engine.joins(self.ctx):
            return None
        return Join(
            engine, (self.ctx, token), engine.step_together, engine.streams, engine.gather_seconds
        )

    async def settle(self) -> None:
        """Bring the window back from where windows step together, where a reply took it:
        its place there is free for other sessions' replies."""
        engine = self.engine
        if isinstance(engine, StepsTogether) and engine.away(self.ctx):
            await self.call("settle", engine.settle, self.ctx)

    def observed_restore(self, began: float, n_bytes: int) -> None:
        """Hand a restore measured since ``began`` to every policy that calibrates itself."""
        seconds = time.perf_counter() - began
        for policy in self.policies.learners():
            policy.observe_restore(n_bytes, seconds)

    def observed_prefill(self, began: float, start: int, n_tokens: int) -> None:
        """Hand a prefill measured since ``began`` to every policy that calibrates itself."""
        seconds = time.perf_counter() - began
        for policy in self.policies.learners():
            policy.observe_prefill(start, n_tokens, seconds)

    def resident(self, layout: Sequence[Block] | None = None) -> dict[int, int]:
        """Position -> token of what the engine holds (rebuilt after every engine call),
        as the blocks of the window (or of ``layout``) see it: a position whose KV was
        computed in another place than the block there shows
        :data:`~.provenance.FOREIGN`, which matches no token (see :mod:`.provenance`)."""
        if layout is not None:
            raw = HotWindow.resident_map(self.ctx.positions, self.ctx.tokens)
            return self.provenance.screen(raw, self._places(layout))
        if self._resident is None:
            raw = HotWindow.resident_map(self.ctx.positions, self.ctx.tokens)
            self._resident = self.provenance.screen(raw, self._places())
        return self._resident

    def _places(
        self, layout: Sequence[Block] | None = None
    ) -> list[tuple[int, int, Place, set[int]]]:
        blocks = self.window.blocks if layout is None else layout
        return [(b.start, b.end, (b.start, b.prefix), b.lone_positions()) for b in blocks]

    def state(self, block: Block, resident: dict[int, int] | None = None) -> Residency:
        """Where ``block``'s KV is now."""
        return self.window.residency(
            block, self.resident() if resident is None else resident, self.cold
        )

    # -- what the KV attended to --

    def _missing_before(self, position: int, resident: dict[int, int]) -> int:
        """Context tokens before ``position`` that are not hot."""
        missing = 0
        for b in self.window.blocks:
            if b.start >= position:
                break
            for i, t in enumerate(b.tokens[: position - b.start]):
                if resident.get(b.start + i) != t:
                    missing += 1
        return missing

    def label_at(self, position: int) -> tuple[str | None, int]:
        """The provenance KV computed at ``position`` gets now (None: exact), and how many
        earlier context tokens are not hot."""
        resident = self.resident()
        missing = self._missing_before(position, resident)
        labels = self.provenance.labels(0, position, resident)
        if any(is_approximate(label) for label in labels):
            return APPROXIMATE, missing
        if missing or labels:
            return self.provenance.new_label(), missing
        return None, 0

    async def drop(self, start: int, end: int) -> Tally:
        """Drop the resident tokens in [start, end), leaving a gap: no computation, but on
        a model with recurrent layers a dropped tail puts the state back to a checkpoint
        and computes the resident tokens from there again (see
        :class:`~kvrt.backend.Recompute`; resident tokens after a gap before the range go
        too: their KV is computed again, or restored, when the context needs them). Then
        the call takes a turn, the tokens computed again are marked with what they attend
        to now (the window may have lost tokens before them since they were first
        computed) and counted as prefilled."""
        redo = self.ctx.recomputed_by_evict(start, end)
        if redo is None:
            await self.call("evict", self.ctx.evict, start, end, EvictMode.GAP, light=True)
            return Tally()
        label, _ = self.label_at(redo.end)
        positions = [p for p in self.ctx.positions if redo.first <= p < redo.end]
        marks = [Written(a, b, label, "prefilled") for a, b in runs_of(positions)]
        await self.call("evict", self.ctx.evict, start, end, EvictMode.GAP, writes=marks)
        moved = Tally(prefilled=len(positions))
        moved.wrote(marks)
        return moved

    async def logits(self) -> Logits:
        """The engine's logits after the last decoded token (copied out, no computation)."""
        return await self.call("logits", self.ctx.logits, light=True)

    async def logits_after(self, block: Block) -> Logits | None:
        """The engine's logits after ``block``'s last token, if it holds them and they were
        computed with exact KV (as that token's mark says), else None."""
        held = self.ctx.logits_position
        if held is None or held != block.end - 1:
            return None
        if self.provenance.inexact(held, held + 1, self.resident()):
            return None
        return await self.logits()

    def is_approximate(self, block: Block, resident: dict[int, int] | None = None) -> bool:
        """Whether resident tokens of ``block`` hold approximate KV."""
        resident = self.resident() if resident is None else resident
        return self.provenance.approximate(block.start, block.end, resident)

    def is_partial(self, block: Block, resident: dict[int, int] | None = None) -> bool:
        """Whether resident tokens of ``block`` hold partial-window KV."""
        resident = self.resident() if resident is None else resident
        return self.provenance.partial(block.start, block.end, resident)

    def stored_key(self, block: Block) -> ColdKey | None:
        """The key ``block``'s resident KV is stored under: its exact key when the KV is
        exact, a key of its own when it is partial-window (:func:`partial_key`), None when
        it is approximate (never stored) — except in a long context, where the key the
        session gave it (:attr:`.HotWindow.long_copies`), or the key of the long-context
        copy it was restored from, in place."""
        resident = self.resident()
        labels = self.provenance.labels(block.start, block.end, resident)
        exact = block.key(self.window.fingerprint)
        if not labels:
            return exact
        if any(is_approximate(label) for label in labels):
            if len(labels) == 1 and APPROXIMATE not in labels:
                return partial_key(exact, labels)  # the long copy it came from
            return self.window.long_copies.get(exact)
        return partial_key(exact, labels)

    async def tidy(self) -> Tally:
        """Remove resident tokens that belong to no whole block (half-done work); on an
        engine that can remove only the window's tail (a recurrent model), everything
        from the first of them on."""
        strays = self.window.strays(self.resident())
        if strays and not self.ctx.capabilities.remove_middle:
            strays = [(strays[0][0], self.ctx.next_position)]
        moved = Tally()
        for start, end in strays:
            moved += await self.drop(start, end)
        return moved

    # -- what the context holds (derived) --

    def record(self, tally: Tally) -> None:
        """Add what a command did to the session's counters (once per command)."""
        c = self.counters
        c.reused_tokens += tally.reused
        c.restored_tokens += tally.restored
        c.approximate_tokens += tally.approximate
        c.prefilled_tokens += tally.prefilled
        c.evicted_tokens += tally.evicted

    def status(self, tally: Tally) -> ContextStatus:
        """What a command did (``tally``) and the context it left."""
        sizes = self.residency_tokens()
        exact_restores = self.ctx.capabilities.exact_in_place
        approximate_context = self.approximate_context_tokens()
        partial_context = self.partial_window_tokens()
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
            exact=self.ctx.capabilities.exact_compute
            and not approximate_context
            and not partial_context
            and not tally.approximate
            and (exact_restores or not tally.restored),
            visible_tokens=sizes[Residency.HOT],
            invisible_segments=self.invisible_segments(),
            approximate_context_tokens=approximate_context,
            origins=self.origins([tally]),
            partial_window_tokens=partial_context,
        )

    def origins(self, tallies: Sequence[Tally], end: int | None = None) -> TokenOrigins:
        """Where the KV of each context token before ``end`` (all of them by default)
        came from, by the engine calls of ``tallies`` (later ones win)."""
        sources: dict[int, str] = {}
        for tally in tallies:
            sources.update(tally.sources)
        resident = self.resident()
        end = self.window.length if end is None else end
        counts = dict.fromkeys(("reused", "restored", "prefilled", "approximate", "generated"), 0)
        not_hot = 0
        for b in self.window.blocks:
            for i, token in enumerate(b.tokens[: max(0, end - b.start)]):
                p = b.start + i
                if resident.get(p) == token:
                    counts[sources.get(p, "reused")] += 1
                else:
                    not_hot += 1
        return TokenOrigins(**counts, not_hot=not_hot)

    def invisible_segments(self) -> tuple[str, ...]:
        """Names of segments with any block not hot, in context order."""
        resident = self.resident()
        return tuple(
            dict.fromkeys(
                b.segment
                for b in self.window.blocks
                if self.window.residency(b, resident, ()) is not Residency.HOT
            )
        )

    def approximate_context_tokens(self) -> int:
        """Tokens of hot blocks whose KV derives from an approximate restore."""
        resident = self.resident()
        return sum(
            b.n_tokens
            for b in self.window.blocks
            if self.window.residency(b, resident, ()) is Residency.HOT
            and self.is_approximate(b, resident)
        )

    def partial_window_tokens(self) -> int:
        """Tokens of hot blocks whose KV was computed under a partial window."""
        resident = self.resident()
        return sum(
            b.n_tokens
            for b in self.window.blocks
            if self.window.residency(b, resident, ()) is Residency.HOT
            and self.is_partial(b, resident)
        )

    def residency_tokens(self) -> dict[str, int]:
        resident = self.resident()
        sizes = dict.fromkeys(Residency, 0)
        for b in self.window.blocks:
            sizes[self.window.residency(b, resident, self.cold)] += b.n_tokens
        return {str(k): v for k, v in sizes.items()}
