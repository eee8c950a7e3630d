"""The routes' state and work: the runtime, its session pool, the state store, and one
request answered from its body to its last byte, whatever API it speaks: its surface
reads it into an exchange (:mod:`kvrt.serve.exchanges`), the server lends the exchange's
turn a session, runs work off the event loop and streams the exchange's events."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import TypeVar, TypeVarTuple, Unpack

import anyio
import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

import kvrt

from .config import PIN_HEADER, ServeConfig, model_id, reuse_scope
from .exchanges import Exchange, Surface
from .pool import Pool, PoolFull, PoolSlot
from .protocol import Limits, RequestError, error_body, refusal, sse
from .reading import read_body, tenant_of
from .state import StateStore, open_state
from .state.threads import off_loop
from .streaming import EventStream, Started, until_gone

__all__ = ["Server"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class Server:
    """The routes' state: the runtime, its session pool, request and token counts."""

    def __init__(self, runtime: kvrt.Runtime, config: ServeConfig) -> None:
        self.runtime = runtime
        self.config = config
        self.model = model_id(runtime, config)
        self.pool = Pool(
            runtime,
            max_sessions=config.max_sessions,
            max_queue=config.max_queue,
            idle_sessions=config.idle_sessions,
            hot_tokens=config.hot_tokens,
        )
        self.requests: Counter[tuple[str, int]] = Counter()
        self.tokens: Counter[str] = Counter()
        self._state: StateStore | None = None
        self._opening = anyio.Lock()
        self.readers = anyio.CapacityLimiter(2)
        """Worker threads reading requests and compiling their grammars at once: a flood
        of heavy schemas queues here, not on the event loop."""
        self.gone: Counter[str] = Counter()
        """Requests whose client left before the answer: ``body`` (while sending it),
        ``queued`` (waiting for a session), ``answer`` (while it was computed), ``stalled``
        (a stream its client stopped reading, closed after ``stall_timeout``)."""

    # -- routes --

    async def state(self) -> StateStore:
        """The state store (what the API surfaces keep), opened on first use (or by
        :meth:`open`, as ``kvrt serve`` does before it listens)."""
        if self._state is None:
            async with self._opening:
                if self._state is None:
                    c = self.config
                    self._state = await open_state(self.runtime, c.state_path, c.bounds)
        return self._state

    async def open(self) -> None:
        """Check the settings against the runtime and open the state store now: a
        :class:`kvrt.ConfigError` (or :class:`~kvrt.serve.state.StateError`) says what
        cannot be served with, before a request comes."""
        if self.runtime.closed:
            raise kvrt.SessionClosedError(
                "the runtime is closed: serve it inside its `async with kvrt.open_runtime()`"
            )
        try:
            self.runtime.hot_window(self.config.hot_tokens)
        except kvrt.ConfigError as exc:
            raise kvrt.ConfigError(
                f"the sessions' hot window (--session-tokens, ServeConfig.hot_tokens): {exc}"
            ) from None
        await self.state()

    async def aclose(self) -> None:
        """Let the sessions and the state store go."""
        await self.pool.aclose()
        if self._state is not None:
            await self._state.aclose()
            self._state = None

    @property
    def limits(self) -> Limits:
        """What a request is checked against."""
        return Limits(
            model=self.model,
            context=self.runtime.model_info.capacity.planner_effective_context,
            n_vocab=self.runtime.engine.facts.n_vocab,
            default_max_tokens=self.config.default_max_tokens,
            max_grammar_bytes=self.config.max_grammar_bytes,
        )

    def endpoint(self, surface: Surface) -> Callable[[Request], Awaitable[Response]]:
        """The route of ``surface``: each request answered by :meth:`answer`."""

        async def route(request: Request) -> Response:
            return await self.answer(request, surface)

        return route

    async def answer(self, request: Request, surface: Surface) -> Response:
        """Answer one request of ``surface``: read it into an exchange, lend its turn a
        session, then reply with the exchange's body or stream its events."""
        route = surface.name
        try:
            exchange = await surface.open(await read_body(request), tenant_of(request), self)
        except RequestError as exc:
            return self.refuse(route, exc)
        except ClientDisconnect:
            self.gone["body"] += 1
            return Response(status_code=400)  # nobody reads it
        pin = request.headers.get(PIN_HEADER)
        if pin is not None and not (0 < len(pin) <= 100 and pin.isprintable()):
            refused = RequestError(
                f"{PIN_HEADER} must be 1 to 100 printable characters", param=PIN_HEADER
            )
            return self.refuse(route, refused)
        turn = exchange.turn
        wanted, stack = turn.history, AsyncExitStack()
        scope = reuse_scope(tenant_of(request), turn.cache_salt)
        # From here on a client that leaves stops the work: its place in the queue, or
        # the generation (a stream's own response notices, see EventStream).
        async with until_gone(request) as left:
            try:
                slot = await stack.enter_async_context(self.pool.lend(wanted, pin, scope))
            except PoolFull as exc:
                await stack.aclose()
                busy = RequestError(str(exc), status=429, code="busy", kind="rate_limit_exceeded")
                retry = {"Retry-After": str(self.config.retry_after)}
                return self.refuse(route, busy, headers=retry)
            except kvrt.KvrtError as exc:  # no session could open (the runtime closed)
                await stack.aclose()
                return self.refuse(route, refusal(exc))
        if left.gone:
            await stack.aclose()
            self.gone["queued"] += 1
            return Response(status_code=400)
        if turn.stream:
            return await self._stream(request, route, exchange, stack, slot)
        done = None
        async with stack, until_gone(request) as left:
            try:
                done = await (await self.off_loop(turn.start, _session(slot)))
            except kvrt.KvrtError as exc:
                return self.refuse(route, refusal(exc))
            except RequestError as exc:
                return self.refuse(route, exc)
            self._count(done)
            slot.answered(wanted, done)
        if left.gone:  # the generation stopped where it was, the session is free
            self.gone["answer"] += 1
            return Response(status_code=400)
        try:
            body = await exchange.reply(done)
        except RequestError as exc:
            return self.refuse(route, exc)
        self.requests[(route, 200)] += 1
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def _stream(
        self,
        request: Request,
        route: str,
        exchange: Exchange,
        stack: AsyncExitStack,
        slot: PoolSlot,
    ) -> Response:
        """The reply is built and its first piece read before the stream's 200 goes out:
        what is refused before any token (a grammar that accepts nothing, a context too
        large) is a 400 with the error body, not a stream's last event."""
        answer: kvrt.Reply | None = None
        first: kvrt.Piece | None = None
        async with until_gone(request) as left:
            try:
                answer = await self.off_loop(exchange.turn.start, _session(slot))
                first = await anext(answer, None)
            except (kvrt.KvrtError, RequestError) as exc:
                await stack.aclose()
                return self.refuse(route, exc if isinstance(exc, RequestError) else refusal(exc))
        if left.gone or answer is None:
            await stack.aclose()
            self.gone["answer"] += 1
            return Response(status_code=400)
        events = self._events(route, exchange, stack, slot, Started(answer, first))
        timeout = self.config.stall_timeout
        return EventStream(events, request.scope, timeout, self._stalled, self._left_stream)

    async def off_loop(self, fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
        """``fn(*args)`` in a worker thread, within ``grammar_timeout``: reading a request
        (a large body) and building its reply (compiling its tools' and response format's
        grammars) never stall the event loop for the other clients. Past the timeout the
        request is a 400 (the thread finishes on its own; what it compiled is kept)."""
        limit = self.config.grammar_timeout
        with anyio.move_on_after(limit) as waited:
            return await off_loop(partial(fn, *args), limiter=self.readers, abandon_on_cancel=True)
        assert waited.cancelled_caught
        raise RequestError(
            f"reading the request and compiling its grammars took more than {limit:g} s: "
            "simplify its schemas",
            code="grammar_timeout",
        )

    async def _events(
        self,
        route: str,
        exchange: Exchange,
        stack: AsyncExitStack,
        slot: PoolSlot,
        answer: Started,
    ) -> AsyncIterator[bytes]:
        """The exchange's events as server-sent event bytes, holding the session until
        they end; a refusal met on the way is the stream's last event."""
        closing = False  # the client has gone: nothing more may be sent
        async with stack:  # a client that goes away cancels this: generation stops
            try:
                async for event in exchange.events(answer):
                    try:
                        yield sse(event)
                    except GeneratorExit:
                        closing = True
                        raise
            except kvrt.KvrtError as exc:
                if not closing and not isinstance(exc, kvrt.OperationCancelledError):
                    refused = refusal(exc)
                    self.requests[(route, refused.status)] += 1
                    yield sse(error_body(refused), exchange.error_event)
                return
            done = await answer
            self._count(done)
            slot.answered(exchange.turn.history, done)
        self.requests[(route, 200)] += 1

    def _stalled(self) -> None:
        self.gone["stalled"] += 1

    def _left_stream(self) -> None:
        self.gone["answer"] += 1

    def _count(self, done: kvrt.Completion) -> None:
        u = done.usage
        self.tokens["reused"] += u.reused_tokens
        self.tokens["restored"] += u.restored_tokens
        self.tokens["prefilled"] += u.prefilled_tokens
        self.tokens["approximate"] += u.approximate_tokens
        self.tokens["generated"] += u.completion_tokens

    def refuse(
        self, route: str, exc: RequestError, headers: dict[str, str] | None = None
    ) -> Response:
        """``exc`` as ``route``'s answer, counted."""
        self.requests[(route, exc.status)] += 1
        body = msgspec.json.encode(error_body(exc))
        return Response(body, exc.status, headers, media_type="application/json")


def _session(slot: PoolSlot) -> kvrt.Session:
    assert slot.session is not None
    return slot.session
