"""The public session handle: sends commands to the session's actor and awaits replies."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import ExitStack
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._actor import Actor, Admit, Call, Command, Ensure, Evict, Generate
from ._backend import SamplingParams
from ._errors import SessionClosedError
from ._reports import BlockReport, ContextStatus, Piece, PrefetchReport, SessionReport
from ._residency import Segment
from ._types import CacheClass, Residency
from ._util import NoPublicConstructor

__all__ = ["Prefetch", "Session"]


class Prefetch:
    """A prefetch running in the background for a session's next ``ensure_context``.

    It tokenizes the segments and pins their exact cold hits, so they are still in the
    store (and need no tokenizing) when the call comes. The pins go when that call has
    placed the context, when :meth:`cancel` is called, when a newer prefetch replaces this
    one, when the session closes, or after ``hold`` seconds.
    """

    def __init__(self) -> None:
        self._scope = anyio.CancelScope()
        self._ready = anyio.Event()
        self._released = anyio.Event()
        self._pins = ExitStack()
        self._report: PrefetchReport | None = None
        self._error: BaseException | None = None

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


class Session(metaclass=NoPublicConstructor):
    """One conversation's context on a shared model: a hot window backed by the cold store.

    Sessions come only from :meth:`kvrt.Runtime.open_session`::

        async with rt.open_session(hot_tokens=512) as session:
            status = await session.ensure_context([kvrt.Segment("user", "Hello")])
            async for piece in session.generate(max_tokens=32):
                print(piece.text, end="")

    Calls run one at a time, in the order they were made. Cancelling a call leaves the
    session consistent and usable, and loses no KV that had left the hot window: a running
    call is stopped at its next await point (at most one engine chunk away) and settled
    before the cancellation reaches the caller.
    """

    def __init__(self, actor: Actor, name: str, tg: TaskGroup) -> None:
        self._actor = actor
        self.name = name
        self._tg = tg
        self._closed = False
        self._pending: set[Call] = set()
        self._prefetches: set[Prefetch] = set()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- plumbing --

    async def _submit(self, command: Command) -> Call:
        if self._closed:
            raise SessionClosedError(f"session {self.name!r} is closed")
        call = Call(command)
        self._pending.add(call)
        try:
            await self._actor.send.send(call)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._pending.discard(call)
            raise SessionClosedError(f"session {self.name!r} is closed") from None
        except BaseException:
            self._pending.discard(call)
            raise
        return call

    async def _abandon(self, call: Call) -> None:
        """Give up on ``call``; if it is running, wait (shielded) until the actor has
        settled it, so the caller sees the session consistent again. A queued call is
        skipped by the actor without touching anything, so there is nothing to wait for."""
        call.abandon()
        if self._actor.current is call:
            with anyio.CancelScope(shield=True):
                await call.done.wait()

    async def _outcome(self, call: Call) -> Any:
        try:
            await call.done.wait()
        except BaseException:
            await self._abandon(call)
            raise
        finally:
            if call.done.is_set():
                self._pending.discard(call)
        if call.error is not None:
            raise call.error
        return call.result

    async def _request(self, command: Command) -> Any:
        return await self._outcome(await self._submit(command))

    # -- the API --

    async def ensure_context(self, segments: Sequence[Segment]) -> ContextStatus:
        """Make the session's context exactly ``segments``, in order.

        The resident prefix is reused, blocks with an exact cold-store hit are restored
        without compute, the rest is prefilled, and the hot window is kept within budget
        by the eviction policy. Returns what was reused, restored, prefilled and evicted.
        """
        result: ContextStatus = await self._request(Ensure(tuple(segments)))
        return result

    def prefetch(self, segments: Sequence[Segment], *, hold: float = 60.0) -> Prefetch:
        """Start preparing the context the next :meth:`ensure_context` will ask for.

        Returns at once; the work runs as a background task of the runtime. Call
        ``cancel()`` on the result to stop it, or ``await result.wait()`` for what it found.
        Prefetching never changes the session's context.
        """
        if self._closed:
            raise SessionClosedError(f"session {self.name!r} is closed")
        job = Prefetch()
        for older in self._prefetches:
            older.cancel()  # the newest prefetch describes the next call
        self._prefetches.add(job)
        self._tg.start_soon(self._prefetch, tuple(segments), job, hold)
        return job

    async def _prefetch(self, segments: tuple[Segment, ...], job: Prefetch, hold: float) -> None:
        a = self._actor
        calls = a.counters.ensure_calls
        try:
            with job._scope:
                tokens: dict[tuple[str, bool, bool], list[int]] = {}
                try:
                    tokenized = await anyio.to_thread.run_sync(a.tokenize, segments, tokens)
                except Exception as exc:
                    job._error = exc
                    return
                keys = a.window.keys_for(tokenized)
                hits = [e for e in map(a.cold.peek, keys) if e is not None]
                job._pins.enter_context(a.cold.pinned(e.key for e in hits))
                job._report = PrefetchReport(
                    blocks=len(keys),
                    tokens=sum(len(t) for _, t in tokenized),
                    cold_blocks=len(hits),
                    cold_tokens=sum(e.meta.n_tokens for e in hits),
                    cold_bytes=sum(e.n_bytes for e in hits),
                )
                job._ready.set()
                if a.counters.ensure_calls != calls:
                    return  # the call it prepared for has already begun
                a.token_cache = tokens
                a.prefetched = job.release
                with anyio.move_on_after(hold):
                    await job._released.wait()
        finally:
            job._pins.close()
            if a.prefetched == job.release:
                a.prefetched = None
                a.token_cache = {}
            self._prefetches.discard(job)
            job._ready.set()

    async def generate(
        self,
        max_tokens: int = 256,
        *,
        sampling: SamplingParams | None = None,
        segment: str = "assistant",
        cache_class: CacheClass = CacheClass.VOLATILE,
        stop_at_end: bool = True,
        buffer: int | None = None,
    ) -> AsyncIterator[Piece]:
        """Stream the continuation of the context, one :class:`Piece` per token.

        Generated tokens join the context (as blocks of ``segment``). Generation goes on
        past the hot budget by evicting under policy, up to the planner context. Stopping
        early (``break``, cancellation) keeps what was generated so far.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        size = buffer or self._actor.config.stream_buffer
        send, receive = anyio.create_memory_object_stream[Piece](size)
        command = Generate(
            max_tokens, sampling or SamplingParams(), segment, cache_class, stop_at_end, send
        )
        try:
            call = await self._submit(command)
        except BaseException:
            send.close()
            receive.close()
            raise
        try:
            async with receive:
                async for piece in receive:
                    yield piece
            await self._outcome(call)
        finally:
            receive.close()
            if not call.done.is_set():
                await self._abandon(call)

    async def generate_text(self, max_tokens: int = 256, **kwargs: Any) -> str:
        """The whole continuation as one string (see :meth:`generate`)."""
        parts = [piece.text async for piece in self.generate(max_tokens, **kwargs)]
        return "".join(parts)

    async def evict(self, target: str | tuple[int, int]) -> int:
        """Move a segment (by name) or the blocks inside a position range to the cold store.

        Returns the number of tokens that left the hot window.
        """
        result: int = await self._request(Evict(target))
        return result

    async def admit(self, target: str | tuple[int, int]) -> int:
        """Restore a segment's (or range's) cold blocks into the hot window, in place."""
        result: int = await self._request(Admit(target))
        return result

    def explain(self) -> SessionReport:
        """Sizes, every block with its class and residency, cold-store and mailbox figures."""
        a = self._actor
        window = a.window
        resident = a.resident()
        protected = window.protected()
        states = {b.id: window.residency(b, resident, a.cold) for b in window.blocks}
        blocks = [
            BlockReport(
                segment=b.segment,
                index=b.index,
                start=b.start,
                n_tokens=b.n_tokens,
                cache_class=b.cache_class,
                residency=states[b.id],
                protected=b.id in protected,
                last_used=b.last_used,
                choice=a.choices.get(b.id),
                approximate=b.id in a.tainted and states[b.id] is Residency.HOT,
            )
            for b in window.blocks
        ]
        problems = []
        if a.ctx.n_resident > window.budget:
            problems.append(
                f"{a.ctx.n_resident} resident tokens exceed the budget of {window.budget}"
            )
        for start, end in window.strays(resident):
            problems.append(f"resident positions [{start}, {end}) belong to no whole block")
        expected = 0
        for b in window.blocks:
            if b.start != expected:
                problems.append(
                    f"block {b.segment}#{b.index} starts at {b.start}, expected {expected}"
                )
            expected = b.end
        mb = a.send.statistics()
        return SessionReport(
            name=self.name,
            closed=self._closed,
            hot_budget=window.budget,
            hot_tokens=a.ctx.n_resident,
            planner_context=window.planner_context,
            logical_tokens=window.length,
            blocks=blocks,
            residency_tokens=a.residency_tokens(),
            cold_store=a.cold.stats(),
            mailbox={
                "queued": mb.current_buffer_used,
                "size": int(mb.max_buffer_size),
                "waiting_callers": mb.tasks_waiting_send,
                "in_flight": int(a.current is not None),
            },
            counters=a.counters,
            engine=a.ctx.counters,
            capabilities=a.ctx.capabilities,
            exact_restores=a.ctx.capabilities.exact_in_place,
            approximate_tokens=a.approximate_context_tokens(),
            consistent=not problems,
            problems=problems,
        )

    async def aclose(self) -> None:
        """Stop the session: pending calls fail, the engine context is freed."""
        if self._closed:
            await self._actor.finished.wait()
            return
        self._closed = True
        for job in list(self._prefetches):
            job.cancel()
        for call in list(self._pending):
            call.abandon(
                SessionClosedError(f"session {self.name!r} closed before the call finished")
            )
        self._actor.send.close()  # the actor drains what is queued, then stops
        await self._actor.finished.wait()
