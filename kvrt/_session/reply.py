"""A generation as its caller holds it: pieces to iterate, a :class:`Completion` to await."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from .._errors import KvrtError, detached
from .._reports import Completion, Piece, Timings, Usage
from .actor import Command, Pending
from .generation import Generated
from .mailbox import Mailbox, Stream

__all__ = ["Reply"]


class Reply:
    """A generation: ``async for piece in reply`` streams it; ``await reply`` (or
    :meth:`completion`) gives the :class:`~kvrt.Completion` — text, finish reason, usage,
    timings — reading whatever was not read yet.

    Nothing starts until the reply is first read or awaited. Leaving the loop early
    (``break``) or calling :meth:`aclose` stops generation where it is, keeping what was
    generated (finish reason ``closed``); it is not a cancelled call. Cancelling the task
    that reads it cancels the generation.
    """

    def __init__(
        self,
        command: Command,
        receive: MemoryObjectReceiveStream[Piece],
        mail: Mailbox,
    ) -> None:
        self._command = command
        self._receive = receive
        self._mail = mail
        self._call: Pending | None = None
        self._dropped = False
        self._stream: Stream | None = None
        self._sent = 0.0
        self._first: float | None = None
        self._result: Completion | None = None
        self._error: KvrtError | None = None

    def __aiter__(self) -> Reply:
        return self

    async def __anext__(self) -> Piece:
        call = await self._started()
        if call is None:
            raise StopAsyncIteration
        try:
            piece = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            await self._finish(call)
            raise StopAsyncIteration from None
        except BaseException:  # the reader was cancelled: so is the generation
            self._drop()
            if not call.done.is_set():
                await self._mail.abandon(call)
            raise
        assert self._stream is not None
        self._stream.reader = anyio.get_current_task().id
        if self._first is None:
            self._first = time.perf_counter()
        return piece

    def __await__(self) -> Generator[Any, None, Completion]:
        return self.completion().__await__()

    async def completion(self) -> Completion:
        """Read the rest of the reply; what the call produced."""
        async for _ in self:
            pass
        if self._error is not None:
            raise detached(self._error)
        if self._result is None:
            raise KvrtError("the reply was closed before it began")
        return self._result

    @property
    def result(self) -> Completion | None:
        """The :class:`~kvrt.Completion` once the reply has been read to its end."""
        return self._result

    async def aclose(self) -> None:
        """Stop reading: generation stops where it is, keeping what it generated."""
        self._drop()
        call = self._call
        if call is None or self._result is not None or self._error is not None:
            return
        if not self._mail.running(call) and not call.done.is_set():
            call.abandon()  # still queued: it never runs
            return
        with anyio.CancelScope(shield=True):
            await call.done.wait()  # the actor stops at its next piece
        await self._finish(call)

    def __del__(self) -> None:
        self._drop()  # dropped unread: the actor stops at its next piece

    # -- plumbing --

    async def _started(self) -> Pending | None:
        if self._call is None:
            if self._dropped:
                return None
            self._sent = time.perf_counter()
            self._call = await self._mail.submit(self._command)
            self._stream = Stream(self._receive)
            self._mail.streams.add(self._stream)
        return self._call

    def _drop(self) -> None:
        self._dropped = True
        self._receive.close()
        if self._stream is not None:
            self._mail.streams.discard(self._stream)

    async def _finish(self, call: Pending) -> None:
        self._drop()
        if self._result is not None or self._error is not None:
            return
        try:
            generated: Generated = await self._mail.outcome(call)
        except KvrtError as exc:
            self._error = detached(exc)
            raise
        self._result = _completion(generated, self._sent, time.perf_counter())


def _completion(g: Generated, sent: float, done: float) -> Completion:
    work = [s for s in (g.placed, g.status) if s is not None]
    prefilled = sum(s.prefilled_tokens for s in work)
    first = g.first_token_at
    decode = (g.ended - first) if first is not None else 0.0
    computed = g.prompt.prefilled  # of a long context, also what left its window since
    if g.placed is not None and g.placed.long is not None:
        computed = max(computed, g.placed.long.computed_tokens)
    return Completion(
        text=g.text,
        finish_reason=g.finish_reason,
        usage=Usage(
            prompt_tokens=g.prompt_tokens,
            completion_tokens=g.produced,
            total_tokens=g.prompt_tokens + g.produced,
            cached_tokens=g.prompt_tokens - computed,
            reused_tokens=sum(s.reused_tokens for s in work),
            restored_tokens=sum(s.restored_tokens for s in work),
            prefilled_tokens=prefilled,
            approximate_tokens=sum(s.approximate_tokens for s in work),
            visible_tokens=g.visible_tokens,
            prompt=g.prompt,
        ),
        timings=Timings(
            time_to_first_token=None if first is None else max(0.0, first - sent),
            prompt_seconds=g.placed_at - g.began,
            decode_seconds=decode,
            decode_tokens_per_second=(g.produced - 1) / decode
            if g.produced > 1 and decode
            else None,
            total_seconds=done - sent,
        ),
        tokens=g.tokens,
        invisible_segments=g.invisible_segments,
        context=g.status,
        tool_calls=g.tool_calls,
        raw_text=g.raw_text,
        logprobs=g.logprobs,
    )
