"""The server's sessions: a bounded pool, each request matched to the session that holds
the most of its conversation.

A session is lent to one request at a time. A request whose messages extend what a live
session holds (its earlier messages and reply, or all of them but that reply, sent back
in other words) gets that session, so only what is new is computed; otherwise it gets a
new session while there is room, and else the idle session used longest ago (its blocks
go to the cold store, where later requests find them). With ``idle_sessions`` set, when
a request takes a session and no other is being served, idle sessions past that many (the
least recently used) close the same way: conversations taking turns then hold one
session's engine memory, concurrent ones as many as they use. Set, a session is also
never taken over by another conversation: it closes, and the request opens its own. A
closing session claims the blocks it offers the cold store as its close begins, so its
conversation's next request, if already here, waits for them and restores them.
``X-Session-Id`` pins a conversation to a session of its own. Past ``max_sessions`` busy
and ``max_queue`` waiting, a request is refused at once.

Every request comes with a scope (its tenant and cache salt, or None) and is matched only
with sessions of its scope, which are opened with it as their cache salt: nothing one
scope computed, hot or cold, is reused by another.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import anyio

import kvrt

__all__ = ["History", "Pool", "PoolFull"]

History = tuple[kvrt.Message, ...] | str
"""What a session holds: chat messages (the reply last), or a completion's text."""


class PoolFull(kvrt.KvrtError):
    """Every session is busy and the queue of waiting requests is full."""


@dataclass(eq=False)
class PoolSlot:
    pin: str | None
    scope: str | None = None
    """The tenant and salt the session serves (its cache salt), or None."""
    history: History = ()
    busy: bool = True
    last_used: float = field(default_factory=time.monotonic)
    session: kvrt.Session | None = None
    stack: AsyncExitStack = field(default_factory=AsyncExitStack)
    closes: list[PoolSlot] = field(default_factory=list)
    """Idle sessions this one's request closes first (the one it takes the place of, those
    past ``idle_sessions``)."""

    def answered(self, wanted: History, done: kvrt.Completion) -> None:
        """The session answered ``wanted`` with ``done``: it holds them both now, the
        reply as the client will send it back (its content, or its tool calls)."""
        if isinstance(wanted, str):
            self.history = wanted + done.text
            return
        calls = tuple((c.id, c.name, c.arguments) for c in done.tool_calls)
        reply = kvrt.Message(role="assistant", content=done.text, tool_calls=calls)
        self.history = (*wanted, reply)


def shared(history: History, wanted: History) -> int:
    """How many of ``wanted``'s messages a session holding ``history`` already has: all of
    ``history`` where ``wanted`` begins with it, all but its last reply where ``wanted``
    sends that reply back changed, else 0."""
    if isinstance(history, str) or isinstance(wanted, str):
        if isinstance(history, str) and isinstance(wanted, str) and wanted.startswith(history):
            return len(history)
        return 0
    if len(history) <= len(wanted) and wanted[: len(history)] == history:
        return len(history)
    # The conversation sent back with its last reply in other words (a framework that
    # keeps a tool call as JSON content, a reply the user edited): the session still holds
    # everything before that reply, and only the reply is computed anew.
    last = len(history) - 1
    if (
        last > 0
        and len(wanted) > last
        and history[last].role == wanted[last].role == "assistant"
        and wanted[:last] == history[:last]
    ):
        return last
    return 0


class Pool:
    """Sessions of one runtime, lent to requests."""

    def __init__(
        self,
        runtime: kvrt.Runtime,
        *,
        max_sessions: int,
        max_queue: int,
        hot_tokens: int | None,
        idle_sessions: int | None = None,
    ) -> None:
        if idle_sessions is not None and idle_sessions < 0:
            raise kvrt.ConfigError(f"idle_sessions must be 0 or more, got {idle_sessions}")
        self.runtime = runtime
        self.max_sessions = max_sessions
        self.max_queue = max_queue
        self.idle_sessions = idle_sessions
        self.hot_tokens = hot_tokens
        self.slots: list[PoolSlot] = []
        self.waiting = 0
        self._changed = anyio.Event()
        self._names = itertools.count(1)

    @property
    def busy(self) -> int:
        return sum(s.busy for s in self.slots)

    @asynccontextmanager
    async def lend(
        self, wanted: History, pin: str | None, scope: str | None = None
    ) -> AsyncIterator[PoolSlot]:
        """A session of ``scope`` for a request whose context is ``wanted``; set
        ``slot.history`` to what it holds afterwards. Raises :class:`PoolFull` when nothing
        is free and the queue is full."""
        slot = await self._acquire(wanted, pin, scope)
        try:
            await self._ready(slot)
            if slot.session is None:
                await self._open(slot)
            yield slot
        except BaseException:
            slot.history = ()  # unknown after a failure: match nothing
            raise
        finally:
            slot.busy = False
            slot.last_used = time.monotonic()
            if slot.session is None or slot.session.closed:
                self.slots.remove(slot)
            self._signal()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for slot in list(self.slots):
                await slot.stack.aclose()
            self.slots.clear()

    # -- choosing --

    async def _acquire(self, wanted: History, pin: str | None, scope: str | None) -> PoolSlot:
        slot = self._choose(wanted, pin, scope)
        if slot is not None:
            return slot
        if self.waiting >= self.max_queue:
            raise PoolFull(
                f"all {self.max_sessions} sessions are busy and {self.waiting} requests are "
                "already waiting"
            )
        self.waiting += 1
        try:
            while slot is None:
                changed = self._changed
                await changed.wait()
                slot = self._choose(wanted, pin, scope)
        finally:
            self.waiting -= 1
        return slot

    def _choose(self, wanted: History, pin: str | None, scope: str | None) -> PoolSlot | None:
        """The slot to lend now (marked busy, with the idle sessions past
        ``idle_sessions`` to close), or None to wait. Synchronous: no other request can
        choose between the look and the mark."""
        slot = self._pick(wanted, pin, scope)
        # Only when this request is the only one served: idle sessions then belong to
        # conversations taking turns, while beside busy ones they are likelier to be sent
        # again at once (concurrent chats), and closing them would wait on engine turns.
        if slot is not None and self.idle_sessions is not None and self.busy == 1:
            idle = sorted(
                (s for s in self.slots if not s.busy and s.session is not None),
                key=lambda s: s.last_used,
                reverse=True,
            )
            for old in idle[self.idle_sessions :]:
                self.slots.remove(old)
                slot.closes.append(old)
        return slot

    def _pick(self, wanted: History, pin: str | None, scope: str | None) -> PoolSlot | None:
        idle = [s for s in self.slots if not s.busy]
        if pin is not None:
            mine = next((s for s in self.slots if s.pin == pin and s.scope == scope), None)
            if mine is not None:
                return self._take(mine) if not mine.busy else None
            return self._new(pin, scope, idle)
        free = [s for s in idle if s.pin is None]
        ours = [s for s in free if s.scope == scope]
        best = max(ours, key=lambda s: (shared(s.history, wanted), s.last_used), default=None)
        if best is not None and shared(best.history, wanted):
            return self._take(best)
        if len(self.slots) < self.max_sessions:
            return self._new(None, scope, idle)
        if ours and self.idle_sessions is None:
            return self._take(min(ours, key=lambda s: s.last_used))
        if ours:
            # Parking idle sessions: the one used longest ago closes (its blocks, claimed
            # at once, go to the cold store for its conversation's next request) rather
            # than holding them while this request takes it over.
            return self._new(None, scope, ours)
        if idle:  # another scope's (or a pinned) idle session gives way
            return self._new(None, scope, idle)
        return None

    def _take(self, slot: PoolSlot) -> PoolSlot:
        slot.busy = True
        return slot

    def _new(self, pin: str | None, scope: str | None, idle: Sequence[PoolSlot]) -> PoolSlot | None:
        slot = PoolSlot(pin=pin, scope=scope)
        if len(self.slots) >= self.max_sessions:
            if not idle:
                return None
            replaced = min(idle, key=lambda s: s.last_used)
            self.slots.remove(replaced)
            slot.closes.append(replaced)
        self.slots.append(slot)
        return slot

    async def _ready(self, slot: PoolSlot) -> None:
        """Close the idle sessions the slot's request closes (their hot blocks go to the
        cold store), before its own opens or is used. They close side by side: each claims
        the blocks it offers as its close begins, so a request placing one of their
        conversations meanwhile waits for those copies instead of computing them again."""
        closing, slot.closes = slot.closes, []
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for old in closing:
                    tg.start_soon(old.stack.aclose)

    async def _open(self, slot: PoolSlot) -> None:
        name = f"serve-{next(self._names)}" if slot.pin is None else f"serve-{slot.pin}"
        slot.session = await slot.stack.enter_async_context(
            self.runtime.open_session(
                hot_tokens=self.hot_tokens, name=name[:100], cache_salt=slot.scope
            )
        )

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
