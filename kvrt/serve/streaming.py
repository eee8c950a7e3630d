"""A reply streamed as server-sent events to a client that must take what it is sent,
and a request's work stopped when its client leaves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Scope, Send

import kvrt

from .stall import PADDING, ClientWatch

__all__ = ["EventStream", "Left", "Started", "until_gone"]


class Started:
    """A reply whose first piece was read already: that piece, then the rest; awaited,
    the completion."""

    def __init__(self, reply: kvrt.Reply, first: kvrt.Piece | None) -> None:
        self._reply = reply
        self._first = first
        self._ended = first is None

    def __aiter__(self) -> Started:
        return self

    async def __anext__(self) -> kvrt.Piece:
        if self._first is not None:
            piece, self._first = self._first, None
            return piece
        if self._ended:
            raise StopAsyncIteration
        return await self._reply.__anext__()

    def __await__(self) -> Generator[Any, None, kvrt.Completion]:
        return self._reply.completion().__await__()

    async def aclose(self) -> None:
        await self._reply.aclose()


class Left:
    """Whether the client went away (set by :func:`until_gone`)."""

    gone = False


@asynccontextmanager
async def until_gone(request: Request) -> AsyncIterator[Left]:
    """Run the body until it is done or the client disconnects (its request body already
    read): then the body is cancelled and ``gone`` is set."""
    left = Left()
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            left.gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            yield left
        finally:
            tg.cancel_scope.cancel()


class EventStream(StreamingResponse):
    """Server-sent events whose client must take what it is sent: one that holds bytes it
    has not taken for ``stall_timeout`` seconds gets its stream ended (``on_stall``
    counts it) and the session it held is freed at once, however slow the engine (what
    the client has taken is read from its connection: :mod:`kvrt.serve.stall`; the
    stream opens with a padding comment so that one that never reads is seen at once).
    Chunks go to the client through a writer task, so the stream notices a stall even
    where the server's socket write cannot be interrupted (Hypercorn on trio shields it:
    that write then ends when the client reads or leaves); where the connection cannot
    be read, a write that waits past the timeout is the stall."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        scope: Scope,
        stall_timeout: float,
        on_stall: Callable[[], None],
        on_gone: Callable[[], None],
    ) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.scope = scope
        self.stall_timeout = stall_timeout
        self.on_stall = on_stall
        self.on_gone = on_gone
        """Called when the stream ends unfinished otherwise (its client left mid-stream)."""

    async def stream_response(self, send: Send) -> None:
        to_client, from_body = anyio.create_memory_object_stream[Message](1)
        watch = await anyio.to_thread.run_sync(ClientWatch.of, dict(self.scope), self.stall_timeout)
        stalled = False

        async def writer() -> None:
            async with from_body:
                async for message in from_body:
                    await send(message)

        watching = anyio.CancelScope()

        async def watcher(stream: anyio.CancelScope) -> None:
            nonlocal stalled
            assert watch is not None
            tick = min(0.5, self.stall_timeout / 4)
            with watching:
                # The kernel's connection state: nothing to wait on but time.
                while not watch.stalled():  # noqa: ASYNC110
                    await anyio.sleep(tick)
                stalled = True
                stream.cancel()

        put = partial(self._put, to_client, watched=watch is not None)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                if watch is not None:
                    tg.start_soon(watcher, tg.cancel_scope)
                try:
                    async with to_client:
                        start = {"type": "http.response.start", "status": self.status_code}
                        await put({**start, "headers": self.raw_headers})
                        if watch is not None:
                            await put(_body(_PADDING))
                        async for chunk in self.body_iterator:
                            body = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                            await put(_body(body))
                        await put({"type": "http.response.body", "body": b"", "more_body": False})
                    watching.cancel()  # done: the writer sends the rest
                except Stalled:
                    stalled = True
                    self.on_stall()
                    tg.cancel_scope.cancel()  # unfinished: the server closes the connection
                except BaseException:
                    if stalled:
                        self.on_stall()  # the watcher saw it
                    else:
                        self.on_gone()  # the client left (its connection's task was cancelled)
                    raise
                finally:
                    # The session goes back now, even where the writer's send cannot be
                    # interrupted (it ends when the client reads or leaves).
                    with anyio.CancelScope(shield=True):
                        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        finally:
            if watch is not None:
                watch.close()

    async def _put(
        self, to_client: MemoryObjectSendStream[Message], message: Message, *, watched: bool
    ) -> None:
        """Hand ``message`` to the writer. Where the connection is ``watched`` this waits
        as long as the client takes bytes (a slow reader is not a stalled one: the
        watcher ends the stream when it stops); elsewhere a wait past the timeout is the
        stall."""
        if watched:
            await to_client.send(message)
            return
        with anyio.move_on_after(self.stall_timeout) as waited:
            await to_client.send(message)
        if waited.cancelled_caught:
            raise Stalled


def _body(chunk: bytes) -> Message:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


_PADDING = (b":" + b" " * 1021 + b"\n") * (PADDING // 1023) + b"\n"
"""The comment a stream opens with (lines of a kilobyte: readers that bound a line's
length read it too), which every SSE reader skips."""


class Stalled(Exception):
    """A streamed chunk's client did not take it within the stall timeout."""
