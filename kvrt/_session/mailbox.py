"""The one way a caller's commands reach a session's actor, shared by the handle and its
replies: submit, wait for the outcome, give up (shielded while the actor settles it)."""

from __future__ import annotations

import traceback
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from .._errors import KvrtError, SessionClosedError, detached
from .._reports import Piece
from .actor import Actor, Command, Pending

__all__ = ["Mailbox", "Stream"]


class Stream:
    """An open reply's stream and the task that last read from it."""

    def __init__(self, receive: MemoryObjectReceiveStream[Piece]) -> None:
        self.receive = receive
        self.reader = anyio.get_current_task().id

    def close(self) -> None:
        self.receive.close()


class Mailbox:
    """The calls of one session in flight: every command goes through :meth:`submit`, and
    every caller waits in :meth:`outcome`, so closing the mailbox reaches all of them."""

    def __init__(self, actor: Actor, name: str) -> None:
        self.actor = actor
        self.name = name
        self.closed = False
        self.pending: set[Pending] = set()
        self.streams: set[Stream] = set()

    async def submit(self, command: Command) -> Pending:
        if self.closed:
            raise SessionClosedError(f"session {self.name!r} is closed")
        # A stream this task left open (a loop that called the session, a generator kept
        # half-read) would wait for this task to read it while this call waits behind it:
        # close it first. Its generation stops where it is, keeping what it generated.
        me = anyio.get_current_task().id
        for stream in list(self.streams):
            if stream.reader == me:
                stream.close()
                self.streams.discard(stream)
        for settled in [c for c in self.pending if c.done.is_set()]:
            self.pending.discard(settled)  # replies dropped unread leave theirs behind
        call = Pending(command)
        self.pending.add(call)
        try:
            await self.actor.send.send(call)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.pending.discard(call)
            raise SessionClosedError(f"session {self.name!r} is closed") from None
        except BaseException:
            self.pending.discard(call)
            raise
        return call

    def running(self, call: Pending) -> bool:
        return self.actor.current is call

    async def abandon(self, call: Pending) -> None:
        """Give up on ``call``; if it is running, wait (shielded) until the actor has
        settled it, so the caller sees the session consistent again. A queued call is
        skipped by the actor without touching anything, so there is nothing to wait for."""
        call.abandon()
        if self.running(call):
            with anyio.CancelScope(shield=True):
                await call.done.wait()

    async def outcome(self, call: Pending) -> Any:
        try:
            await call.done.wait()
        except BaseException:
            await self.abandon(call)
            raise
        finally:
            if call.done.is_set():
                self.pending.discard(call)
        # The call keeps neither, the actor's frames the error passed (all finished) keep
        # no locals, and a kvrt error goes on as a copy (its cause the actor's): a worker
        # thread's future or outcome holds the error, whose traceback holds the frame
        # holding that (cycles that would keep the call's segments, and the caller's
        # frames the error went on through, until the garbage collector next looks).
        error, result, call.error, call.result = call.error, call.result, None, None
        if error is not None:
            traceback.clear_frames(error.__traceback__)
            try:
                if isinstance(error, KvrtError):
                    raise detached(error) from error
                raise error
            finally:
                del error
        return result

    async def request(self, command: Command) -> Any:
        return await self.outcome(await self.submit(command))

    def close(self) -> None:
        """Refuse new calls, fail the pending ones; the actor drains its queue, then stops."""
        self.closed = True
        for call in list(self.pending):
            call.abandon(
                SessionClosedError(f"session {self.name!r} closed before the call finished")
            )
        self.actor.send.close()
