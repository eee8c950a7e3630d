"""A prefetch: the background job that prepares a session's next ``ensure_context``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from functools import partial

import anyio

from .._paging.segments import Placed, Segment
from .._paging.tokens import Prepared, TokenKey
from .._reports import PrefetchReport
from .._threads import in_thread
from .actor import Actor

__all__ = ["Prefetch"]


class Prefetch:
    """A prefetch running in the background for a session's next ``ensure_context``.

    It tokenizes the segments, reads their exact cold hits on disk or in the remote tier
    back into RAM, and pins them, so they are still in RAM (and need no tokenizing) when
    the call comes. The pins go when that call has placed the context, when
    :meth:`cancel` is called, when a newer prefetch replaces this one, when the session
    closes, or after ``hold`` seconds.
    """

    def __init__(self) -> None:
        self._scope = anyio.CancelScope()
        self._ready = anyio.Event()
        self._released = anyio.Event()
        self._pins = ExitStack()
        self._report: PrefetchReport | None = None
        self._error: BaseException | None = None
        self._prepared = Prepared(self.cancel)

    def cancel(self) -> None:
        """Stop the prefetch and release what it holds at once (harmless once finished)."""
        self._scope.cancel()
        self.release()

    def release(self) -> None:
        self._pins.close()
        self._released.set()

    async def wait(self) -> PrefetchReport | None:
        """Wait until the blocks are pinned; what was found (None if cancelled first)."""
        await self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._report

    @property
    def cancelled(self) -> bool:
        return self._scope.cancel_called

    def prepared(self) -> Prepared:
        """What the job found, for the ``Ensure`` command it prepares (its only way to the
        actor: a prefetch never writes the actor's state)."""
        return self._prepared

    async def run(
        self,
        actor: Actor,
        segments: tuple[Segment, ...],
        hold: float,
        done: Callable[[Prefetch], None],
    ) -> None:
        """Tokenize and pin, then hold the pins until released; ``done(self)`` at the end.

        The tokenizing and the cold store's reads run here, in the runtime's task group;
        only what ``prepared()`` carries reaches the actor, inside the next ``Ensure``."""
        try:
            with self._scope:
                tokens: dict[TokenKey, Placed] = {}
                try:
                    tokenized = await in_thread(partial(actor.tokenize, segments, remember=tokens))
                    keys = actor.window.keys_for(tokenized)
                except Exception as exc:  # the caller's problem, never the runtime's
                    self._error = exc
                    return
                hits = []  # disk and remote hits are read back into RAM ahead of the call
                cold = actor.cold
                await cold.discover(keys)
                for key in keys:
                    entry = await cold.promote(key) if cold.tier(key) else None
                    if entry is not None:
                        hits.append(entry)
                self._pins.enter_context(cold.pinned(e.key for e in hits))
                self._report = PrefetchReport(
                    blocks=len(keys),
                    tokens=sum(len(p.tokens) for p in tokenized),
                    cold_blocks=len(hits),
                    cold_tokens=sum(e.meta.n_tokens for e in hits),
                    cold_bytes=sum(e.n_bytes for e in hits),
                )
                self._prepared.tokens = tokens
                self._ready.set()
                with anyio.move_on_after(hold):
                    await self._released.wait()
        finally:
            self._pins.close()
            done(self)
            self._ready.set()
