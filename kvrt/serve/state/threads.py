"""Work off the event loop whose refusals leave nothing behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

import anyio
import msgspec

import kvrt

from ..protocol.errors import RequestError

__all__ = ["off_loop"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

REFUSALS = (kvrt.KvrtError, RequestError, msgspec.MsgspecError)
"""What a worker raises for what it was given (a request, a row): expected, its message
says why."""


async def off_loop(
    fn: Callable[[*Ts], T],
    *args: *Ts,
    limiter: anyio.CapacityLimiter | None = None,
    abandon_on_cancel: bool = False,
) -> T:
    """``fn(*args)`` in a worker thread (``anyio.to_thread.run_sync``). A refusal comes back
    without the worker's part of its traceback: the thread's future (asyncio) or outcome
    (trio) holds the error, whose traceback holds frames that hold ``fn``'s arguments (a
    refused request of many megabytes) and the future, a reference cycle the garbage
    collector would free only when it next looks. Any other exception keeps its whole
    traceback."""
    try:
        return await anyio.to_thread.run_sync(
            fn, *args, limiter=limiter, abandon_on_cancel=abandon_on_cancel
        )
    except REFUSALS as exc:
        _forget_tracebacks(exc)
        raise


def _forget_tracebacks(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of the errors it was raised from or during (a
    decoding error a refusal was raised in the handling of holds the same frames)."""
    pending, seen = [exc], set()
    while pending:
        err = pending.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        err.__traceback__ = None
        pending += [e for e in (err.__cause__, err.__context__) if e is not None]
