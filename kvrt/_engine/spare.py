"""When an engine lets go of the context it keeps for the next session.

An engine may keep the context its last closed session used, for the next session to
start in (``release_spare`` frees it; :class:`~kvrt.adapters.llama.LlamaEngine` keeps
one). A program that stops opening sessions would hold it until the engine closes:
:class:`SpareRelease` has it freed once a runtime has had no session open for
:data:`SPARE_SECONDS`, while sessions opened in turn (``kvrt serve`` between requests)
keep starting in it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import anyio
from anyio.abc import TaskGroup

from .contract import Engine
from .turns import EngineTurns

__all__ = ["SPARE_SECONDS", "SpareRelease"]

SPARE_SECONDS = 10.0
"""Seconds with no session open before a runtime's engine frees its spare context."""


class SpareRelease:
    """One runtime's wait, while none of its sessions is open, before the engine's spare
    context goes (on an engine turn). Runs in the runtime's task group; ``sessions`` is
    the runtime's own set of open sessions. The bookkeeping is synchronous."""

    def __init__(
        self, engine: Engine, turns: EngineTurns, tg: TaskGroup, sessions: Collection[object]
    ) -> None:
        self._release: Callable[[], None] | None = getattr(engine, "release_spare", None)
        self._turns = turns
        self._tg = tg
        self._sessions = sessions
        self._waiting: anyio.CancelScope | None = None
        self._closed = False

    def opened(self) -> None:
        """A session opened: the spare stays (it may be starting in it)."""
        self._stop()

    def closed(self) -> None:
        """A session closed: with none left open, the wait begins."""
        if not self._sessions and not self._closed and self._release is not None:
            self._tg.start_soon(self._wait)

    def close(self) -> None:
        """The runtime is closing: nothing more waits (the engine frees its contexts)."""
        self._closed = True
        self._stop()

    def _stop(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None

    async def _wait(self) -> None:
        if self._sessions or self._closed or self._release is None:
            return  # a session opened, or the runtime closed, before this began
        self._stop()
        release = self._release
        with anyio.CancelScope() as scope:
            self._waiting = scope
            await anyio.sleep(SPARE_SECONDS)
            if not self._sessions:
                await self._turns.run(None, "release spare", release)
        if self._waiting is scope:
            self._waiting = None
