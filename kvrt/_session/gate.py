"""The engine gate: every engine call goes through here, in a worker thread behind the
runtime's limiter; residency is derived from what the engine holds (never stored); the
tallies and the status of a call are counted here.

The hot-window bookkeeping it consults (:mod:`.layout`) is synchronous and free of
``await``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio

from .._backend import Engine, EngineContext, EvictMode, Logits
from .._cold import ColdKey, ColdStore
from .._config import SessionConfig
from .._replies import ReplyMemory
from .._reports import ContextStatus, SessionCounters
from .._types import Residency
from ..policy import (
    Approximate,
    Calibrating,
    ColdAdmission,
    HotEviction,
    Restore,
)
from .layout import Block, HotWindow

__all__ = ["EngineGate", "SessionParts", "SessionPolicies", "Tally"]

T = TypeVar("T")


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


@dataclass(frozen=True, slots=True)
class SessionParts:
    """What a session's actor is built from (the runtime assembles it)."""

    engine: Engine
    ctx: EngineContext
    window: HotWindow
    cold: ColdStore
    limiter: anyio.CapacityLimiter
    config: SessionConfig
    policies: SessionPolicies
    replies: ReplyMemory
    """The runtime's memory of generated replies, shared by its sessions."""


@dataclass(slots=True)
class Tally:
    reused: int = 0
    restored: int = 0
    approximate: int = 0
    prefilled: int = 0
    evicted: int = 0


class EngineGate:
    """One session's engine context, hot window and cold store, and the state the layers
    above share: policies, choices, tainted blocks, counters, tallies."""

    def __init__(self, parts: SessionParts) -> None:
        self.engine = parts.engine
        self.ctx = parts.ctx
        self.window = parts.window
        self.cold = parts.cold
        self.limiter = parts.limiter
        self.policies = parts.policies
        self.config = parts.config
        self.replies = parts.replies
        self.choices: dict[int, str] = {}
        """The last residency decision per block id, for ``explain()``."""
        self.tainted: set[int] = set()
        """Blocks whose KV derives from an approximate restore: the restored blocks and
        every block computed while one of them was resident before it. Their KV never
        enters the cold store."""
        self._recompute: set[int] = set()
        self._approximate_runs: dict[int, tuple[int, int]] = {}
        """While a context is placed: block id -> (start, tokens) of its run of
        approximate-hit candidates."""
        self._held: tuple[ColdKey, int, Logits] | None = None
        self._override: Logits | None = None
        self.counters = SessionCounters()
        self.fault: Callable[[str], None] | None = None
        """Test hook, called with a label before every await point of a command."""
        self._tally = Tally()
        self._resident: dict[int, int] | None = None

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

    # -- what the context holds (derived) --

    def _status(self, tally: Tally) -> ContextStatus:
        c = self.counters
        c.reused_tokens += tally.reused
        c.restored_tokens += tally.restored
        c.approximate_tokens += tally.approximate
        c.prefilled_tokens += tally.prefilled
        c.evicted_tokens += tally.evicted
        sizes = self.residency_tokens()
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
            invisible_segments=self.invisible_segments(),
            approximate_context_tokens=approximate_context,
        )

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
