"""Turns on the engine: every engine call of every session of a runtime takes one of its
slots (``engine.parallel``) and runs in a worker thread; when calls wait, the engine-turn
policy (:class:`kvrt.policy.EngineTurn`) picks which goes next.

A session's command runs as many calls (a step per generated token), and its account
(:class:`Served`) adds up the engine time they take, so a policy can put a short request
before the next step of a long one. The bookkeeping here is synchronous: a slot changes
hands in ``release`` without an ``await``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio

from .._threads import in_thread
from .._types import TurnView
from ..policy import EngineTurn

__all__ = ["EngineTurns", "Served"]

T = TypeVar("T")

_log = logging.getLogger("kvrt")


@dataclass(slots=True)
class Served:
    """What one session's current command has had of the engine, and what it may still
    ask (reset as a command begins)."""

    seconds: float = 0.0
    left: int = 0
    """Tokens the command may still generate (its ``max_tokens`` less those generated)."""


@dataclass(slots=True)
class _Waiting:
    served: Served
    arrived: int
    call: str
    granted: bool = False
    wake: anyio.Event = field(default_factory=anyio.Event)
    """Set when the slot is this call's, or when a slot is kept for a returning session
    (the call then looks again once that grace is over)."""


GRACE = 0.003
"""Seconds a freed slot waits for the session whose call just ended, when the policy
would pick that session's next call over every call waiting: a generation's next step
comes back within a millisecond or two (its token is sampled between), and would
otherwise queue behind a step of every other session."""

RETURNING = 0
"""The id, in the policy's view, of the session whose call just ended (see :data:`GRACE`);
waiting calls have positive ids."""


class EngineTurns:
    """The runtime's engine slots, handed out by the engine-turn policy.

    A light call (dropping a KV range, copying the logits out: no computation) takes no
    slot: it runs beside the call computing, and only a computation waits for a turn."""

    def __init__(self, slots: int, policy: EngineTurn, *, grace: float = GRACE) -> None:
        self.slots = slots
        self.grace = grace
        self._free = slots
        self._policy = policy
        self._waiting: dict[int, _Waiting] = {}
        self._clock = 0
        self._held: list[tuple[Served, float]] = []
        """Slots kept for a returning session (see :data:`GRACE`), with their deadlines."""
        self._threads = anyio.CapacityLimiter(slots)
        """Worker threads for engine calls alone (a slot holder never waits on it): a
        burst of other threaded work cannot delay the engine."""

    @property
    def busy(self) -> int:
        """Slots taken now (by a call, or kept for a returning session)."""
        return self.slots - self._free

    @property
    def waiting(self) -> int:
        """Calls waiting for a slot now."""
        return len(self._waiting)

    async def run(
        self, served: Served | None, call: str, fn: Callable[[], T], *, light: bool = False
    ) -> T:
        """Run ``fn`` in a worker thread once a slot is this call's (at once when
        ``light``); its time counts to ``served`` (None: a call outside any session's
        command, such as opening one)."""
        account = served if served is not None else Served()
        if light:
            began = time.perf_counter()
            try:
                return await in_thread(fn)
            finally:
                account.seconds += time.perf_counter() - began
        await self._acquire(account, call)
        began = time.perf_counter()
        try:
            return await in_thread(fn, limiter=self._threads)
        finally:
            account.seconds += time.perf_counter() - began
            self._release(account if served is not None else None)

    async def _acquire(self, served: Served, call: str) -> None:
        self._clock += 1
        for i, (held, _) in enumerate(self._held):
            if held is served:  # its slot was kept for it
                del self._held[i]
                return
        if self._free and not self._waiting:
            self._free -= 1
            return
        me = self._clock
        waiting = self._waiting[me] = _Waiting(served, me, call)
        try:
            while True:
                deadline = min((d for _, d in self._held), default=math.inf)
                with anyio.move_on_after(max(0.0, deadline - time.perf_counter())):
                    await waiting.wake.wait()
                if waiting.granted:
                    return
                waiting.wake = anyio.Event()
                self._expire()
        except BaseException:
            if self._waiting.pop(me, None) is None:  # granted as it was cancelled
                self._release(None)
            raise

    def _expire(self) -> None:
        """Hand on the slots kept for sessions that did not come back in time."""
        now = time.perf_counter()
        for held in [h for h in self._held if h[1] <= now]:
            self._held.remove(held)
            self._release(None)

    def _release(self, returning: Served | None) -> None:
        """Hand the freed slot to the call the policy picks, keep it for ``returning``
        (the session whose call freed it) if the policy picks that one, or free it."""
        if not self._waiting:
            self._free += 1
            return
        views = [
            TurnView(
                id=key, served=w.served.seconds, left=w.served.left, arrived=w.arrived, call=w.call
            )
            for key, w in self._waiting.items()
        ]
        if returning is not None:
            views.append(
                TurnView(
                    id=RETURNING,
                    served=returning.seconds,
                    left=returning.left,
                    arrived=self._clock + 1,
                    call="next",
                )
            )
        try:
            chosen = self._policy.pick(views)
        except Exception:  # a policy's error must not leave a slot lost
            _log.exception("the engine-turn policy failed; the longest-waiting call runs")
            chosen = None
        if chosen == RETURNING and returning is not None:
            self._held.append((returning, time.perf_counter() + self.grace))
            for w in self._waiting.values():
                w.wake.set()  # each looks again once the grace is over
            return
        if not isinstance(chosen, int) or chosen not in self._waiting:
            if chosen is not None:
                _log.warning(
                    "the engine-turn policy picked %r, which is not waiting; "
                    "the longest-waiting call runs",
                    chosen,
                )
            chosen = min(self._waiting)
        waiting = self._waiting.pop(chosen)
        waiting.granted = True
        waiting.wake.set()
