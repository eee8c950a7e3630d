"""What an API surface is to the server: a :class:`Surface` reads a request into an
:class:`Exchange` (the turn it asks of a session, and how its answer is written), using
only what a :class:`Desk` lends it. The server drives every surface alike and names
none."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar, TypeVarTuple, Unpack

import msgspec
from starlette.responses import Response

import kvrt

from ..protocol import Limits, RequestError, Turn
from ..state import StateError, StateStore, refusal
from ..streaming import Started

__all__ = ["Desk", "Exchange", "StateRoutes", "Surface"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class Desk(Protocol):
    """What an exchange may use of the server."""

    @property
    def limits(self) -> Limits:
        """What a request is checked against."""
        ...

    async def state(self) -> StateStore:
        """The state store (kept responses, conversations)."""
        ...

    async def off_loop(self, fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
        """``fn(*args)`` in a worker thread, within the server's grammar timeout."""
        ...


class Exchange(Protocol):
    """One request of an API surface, read: the turn it asks of a session, then its
    answer, a typed body (:meth:`reply`) or a stream of typed events (:meth:`events`).
    What either raises as a :class:`~kvrt.serve.protocol.RequestError` is the request's
    refusal."""

    @property
    def turn(self) -> Turn: ...

    @property
    def error_event(self) -> str | None:
        """The name of the server-sent event that carries a refusal met mid-stream
        (None: an unnamed ``data:`` event)."""
        ...

    async def reply(self, done: kvrt.Completion) -> msgspec.Struct:
        """The body answering ``done`` (what the request adds is kept first)."""
        ...

    def events(self, answer: Started) -> AsyncIterator[msgspec.Struct]:
        """The events answering ``answer``, a reply whose first piece is read."""
        ...


class Surface(Protocol):
    """An API surface: its name (the route's label in ``/metrics``) and how a request
    body is read into an exchange."""

    @property
    def name(self) -> str: ...

    async def open(self, body: bytes, tenant: str | None, desk: Desk) -> Exchange:
        """The exchange ``body`` asks for, or a :class:`~kvrt.serve.protocol.RequestError`
        naming what is wrong."""
        ...


class StateRoutes:
    """Routes over the state store alone (kept responses read back, the Conversations
    API): ``store`` opens it, ``error`` makes a refusal's response (the server's, which
    counts it)."""

    def __init__(
        self,
        store: Callable[[], Awaitable[StateStore]],
        error: Callable[[RequestError], Response],
    ) -> None:
        self.state, self.error = store, error

    async def answered(self, work: Callable[[], Awaitable[Response]]) -> Response:
        """What ``work`` answers, or the refusal of what it raised."""
        try:
            return await work()
        except RequestError as exc:
            return self.error(exc)
        except StateError as exc:
            return self.error(refusal(exc))
