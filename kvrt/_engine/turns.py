"""Turns on the engine: every engine call of every session of a runtime takes one of its
slots (``engine.parallel``) and runs in a worker thread; when calls wait, the engine-turn
policy (:class:`kvrt.policy.EngineTurn`) picks which goes next.

A session's command runs as many calls (a step per generated token), and its account
(:class:`Served`) adds up the engine time they take, so a policy can put a short request
before the next step of a long one. The bookkeeping here is synchronous: a slot changes
hands in ``release`` without an ``await``.

Calls that can run as one engine call (steps of several sessions' generations, where the
engine offers it: :class:`Join`) run together: when the policy picks one, the others
waiting join it as far as the policy's ``join`` admits, and the call it picked runs them
all in its slot. When a joint call ends, its slot waits a moment (:data:`GRACE`) for its
sessions' next steps, so that they run together again rather than the first back alone.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from .._threads import in_thread
from .._types import TurnView
from ..policy import EngineTurn, JoiningTurns

__all__ = ["EngineTurns", "Join", "Served"]

T = TypeVar("T")

_log = logging.getLogger("kvrt")


@dataclass(slots=True)
class Served:
    """What one session's current command has had of the engine, and what it may still
    ask (reset as a command begins)."""

    seconds: float = 0.0
    left: int = 0
    """Tokens the command may still generate (its ``max_tokens`` less those generated)."""


@dataclass(frozen=True, slots=True, eq=False)
class Join:
    """What a call brings to an engine call it may share: calls with the same ``key`` can
    run as one, ``run(items)`` giving each item's result, or the error its part raised,
    in order; at most ``most`` calls at once."""

    key: object
    item: Any
    run: Callable[[list[Any]], Sequence[Any]]
    most: int
    grace: float | None = None
    """How long a freed slot waits for the joint call's sessions to come back (None:
    :data:`GRACE`): longer where a session missing from the next joint call costs the
    engine more than the wait."""


@dataclass(slots=True, eq=False)
class _Group:
    """Calls running as one engine call: the first runs it, in its slot."""

    members: list[_Waiting]
    results: list[Any] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(slots=True, eq=False)
class _Waiting:
    served: Served
    arrived: int
    call: str
    join: Join | None = None
    granted: bool = False
    group: _Group | None = None
    wake: anyio.Event = field(default_factory=anyio.Event)
    """Set when the slot is this call's, or when a slot is kept for a returning session
    (the call then looks again once that grace is over)."""


@dataclass(slots=True)
class _Gathering:
    """A slot kept for the sessions of a joint call that just ended."""

    expected: set[int]
    """``id`` of each session's account not back yet."""
    deadline: float


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
        self._gathering: _Gathering | None = None
        """The slot kept for the sessions of the joint call that just ended."""
        self._running: dict[object, int] = {}
        """Joint calls running now, by their join's key: a call that could join one
        waits for the next rather than run beside it in another slot (the engine would
        run the two one after another, or pay for the windows split between them)."""
        self.joint = 0
        """Engine calls that ran two calls or more as one, so far."""
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
        self,
        served: Served | None,
        call: str,
        fn: Callable[[], T],
        *,
        light: bool = False,
        join: Join | None = None,
    ) -> T:
        """Run ``fn`` in a worker thread once a slot is this call's (at once when
        ``light``); its time counts to ``served`` (None: a call outside any session's
        command, such as opening one). With ``join``, the call runs as ``join.run`` of
        its item and those of the calls joining it (a share of the time counts to each),
        and ``fn`` is not called."""
        account = served if served is not None else Served()
        if light:
            began = time.perf_counter()
            try:
                return await in_thread(fn)
            finally:
                account.seconds += time.perf_counter() - began
        me = await self._acquire(account, call, join)
        if me.group is not None and me.group.members[0] is not me:
            return await self._follow(me, me.group)  # type: ignore[no-any-return]
        began = time.perf_counter()
        members = me.group.members if me.group is not None else [me]
        key = me.join.key if me.join is not None else None
        if key is not None:
            self._running[key] = self._running.get(key, 0) + 1
        try:
            if me.join is None:
                return await in_thread(fn, limiter=self._threads)
            return await self._lead(members)  # type: ignore[no-any-return]
        finally:
            share = (time.perf_counter() - began) / len(members)
            for m in members:
                m.served.seconds += share
            if key is not None:
                self._running[key] -= 1
                if not self._running[key]:
                    del self._running[key]
            if served is None:
                self._release(())
            else:
                self._release([m.served for m in members], me.join)

    async def _lead(self, members: list[_Waiting]) -> Any:
        """Run the joint call of ``members`` (this call first) and hand each its result.
        Shielded: the others' parts run whatever becomes of this call's command."""
        join, group = members[0].join, members[0].group
        assert join is not None
        results: list[Any] = []
        try:
            with anyio.CancelScope(shield=True):
                items = [m.join.item for m in members if m.join is not None]
                results = list(await in_thread(join.run, items, limiter=self._threads))
            if len(results) != len(members):
                raise RuntimeError(f"a joint call gave {len(results)} results for {len(members)}")
        except BaseException as exc:
            results = [exc] * len(members)
            raise
        finally:
            if group is not None:
                group.results = results
                group.done.set()
        if len(members) > 1:
            self.joint += 1
        return _result(results[0])

    async def _follow(self, me: _Waiting, group: _Group) -> Any:
        """The result of this call's part of the joint call another call runs."""
        with anyio.CancelScope(shield=True):  # its part runs: wait to know what it did
            await group.done.wait()
        return _result(group.results[group.members.index(me)])

    async def _acquire(self, served: Served, call: str, join: Join | None) -> _Waiting:
        self._clock += 1
        me = self._clock
        waiting = _Waiting(served, me, call, join)
        gathering = self._gathering
        for i, (held, _) in enumerate(self._held):
            if held is served:  # its slot was kept for it
                del self._held[i]
                return waiting
        queued = any(not self._deferred(w) for w in self._waiting.values())
        if gathering is None and self._free and not queued and not self._deferred(waiting):
            self._free -= 1
            return waiting
        self._waiting[me] = waiting
        if gathering is not None and id(served) in gathering.expected:
            gathering.expected.discard(id(served))
            if not gathering.expected:  # every session of the joint call is back
                self._gathering = None
                self._hand_on(None)
        try:
            while True:
                deadline = min((d for _, d in self._held), default=math.inf)
                if self._gathering is not None:
                    deadline = min(deadline, self._gathering.deadline)
                with anyio.move_on_after(max(0.0, deadline - time.perf_counter())):
                    await waiting.wake.wait()
                if waiting.granted:
                    return waiting
                waiting.wake = anyio.Event()
                self._expire()
        except BaseException:
            group = waiting.group
            if self._waiting.pop(me, None) is not None:
                raise  # cancelled while waiting
            if group is None:
                self._release(())  # granted as it was cancelled
            elif group.members[0] is waiting:  # it was to run a joint call: it does
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(Exception):
                        await self._lead(group.members)
                    self._release([m.served for m in group.members], group.members[0].join)
            else:
                with anyio.CancelScope(shield=True):  # its part runs: wait for it
                    await group.done.wait()
            raise

    def _expire(self) -> None:
        """Hand on the slots kept for sessions that did not come back in time."""
        now = time.perf_counter()
        for held in [h for h in self._held if h[1] <= now]:
            self._held.remove(held)
            self._release(())
        if self._gathering is not None and self._gathering.deadline <= now:
            self._gathering = None
            self._hand_on(None)

    def _release(self, returning: Sequence[Served], join: Join | None = None) -> None:
        """Hand the freed slot on. After a call that may run with others (``join``) and
        did, or that a waiting call could join, keep it for its sessions' next calls
        (see :data:`GRACE`; ``join.grace`` where it says): they then run together; after
        another, to the call the policy picks, or keep it for ``returning`` (the session
        whose call freed it) if the policy picks that one, or free it."""
        if join is not None and (
            len(returning) > 1
            or any(w.join is not None and w.join.key == join.key for w in self._waiting.values())
        ):
            grace = self.grace if join.grace is None else join.grace
            self._gathering = _Gathering({id(s) for s in returning}, time.perf_counter() + grace)
            for w in self._waiting.values():
                w.wake.set()  # each looks again once the gathering is over
            return
        self._hand_on(returning[0] if returning else None)

    def _deferred(self, waiting: _Waiting) -> bool:
        """``waiting`` could join a joint call running now: it waits for the next."""
        return waiting.join is not None and waiting.join.key in self._running

    def _hand_on(self, returning: Served | None) -> None:
        ready = {key: w for key, w in self._waiting.items() if not self._deferred(w)}
        if not ready:
            self._free += 1
            return
        views = [self._view(key, w) for key, w in ready.items()]
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
        if not isinstance(chosen, int) or chosen not in ready:
            if chosen is not None:
                _log.warning(
                    "the engine-turn policy picked %r, which is not waiting; "
                    "the longest-waiting call runs",
                    chosen,
                )
            chosen = min(ready)
        waiting = self._waiting.pop(chosen)
        members = [waiting, *self._joining(chosen, waiting)]
        if len(members) > 1:
            group = _Group(members)
            for m in members:
                m.group = group
        for m in members:
            m.granted = True
            m.wake.set()

    def _joining(self, chosen: int, waiting: _Waiting) -> list[_Waiting]:
        """The waiting calls that join ``waiting``'s engine call, as the policy admits
        (every one that can, where the policy says nothing), taken off the queue."""
        join = waiting.join
        if join is None or join.most < 2:
            return []
        can = [
            key for key, w in self._waiting.items() if w.join is not None and w.join.key == join.key
        ]
        if not can:
            return []
        picked = can
        if isinstance(self._policy, JoiningTurns):
            try:
                said = self._policy.join(
                    self._view(chosen, waiting), [self._view(k, self._waiting[k]) for k in can]
                )
                picked = [k for k in dict.fromkeys(said) if k in can]
            except Exception:
                _log.exception("the engine-turn policy's join failed; every step joins")
        return [self._waiting.pop(k) for k in picked[: join.most - 1]]

    @staticmethod
    def _view(key: int, w: _Waiting) -> TurnView:
        return TurnView(
            id=key, served=w.served.seconds, left=w.served.left, arrived=w.arrived, call=w.call
        )


def _result(outcome: Any) -> Any:
    """A joint call's result for one call: its value, or its error raised."""
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
