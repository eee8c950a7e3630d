"""The routes' state and work: the runtime, its session pool, the state store, and one
request answered from its body to its last byte. What each API's bytes mean is
:mod:`kvrt.serve.protocol`; this lends sessions, runs work off the event loop and streams."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

import kvrt

from . import kept
from .config import PIN_HEADER, ServeConfig, model_id, reuse_scope
from .metrics import exposition
from .pool import History, Pool, PoolFull, PoolSlot
from .protocol import (
    Call,
    Limits,
    RequestError,
    chat,
    conversations,
    error_body,
    refusal,
    responses,
)
from .reading import read_body, tenant_of
from .state import KeptResponse, StateError, StateStats, StateStore, open_state
from .state import refusal as state_refusal
from .state.threads import off_loop
from .streaming import EventStream, Started, until_gone

__all__ = ["Server"]

T = TypeVar("T")


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
        self.kept = kept.ResponseRoutes(self.state, partial(self._error, "responses"))
        self.conversation_routes = kept.ConversationRoutes(
            self.state, partial(self._error, "conversations")
        )
        self.readers = anyio.CapacityLimiter(2)
        """Worker threads reading requests and compiling their grammars at once: a flood
        of heavy schemas queues here, not on the event loop."""
        self.gone: Counter[str] = Counter()
        """Requests whose client left before the answer: ``body`` (while sending it),
        ``queued`` (waiting for a session), ``answer`` (while it was computed), ``stalled``
        (a stream its client stopped reading, closed after ``stall_timeout``)."""

    # -- routes --

    async def state(self) -> StateStore:
        """The state store (kept responses, conversations), opened on first use (or by
        :meth:`open`, as ``kvrt serve`` does before it listens)."""
        if self._state is None:
            async with self._opening:
                if self._state is None:
                    c = self.config
                    bounds = msgspec.structs.replace(
                        c.state_bounds,
                        response_bytes=c.response_store_bytes,
                        conversation_bytes=c.conversation_store_bytes,
                    )
                    self._state = await open_state(self.runtime, c.state_path, bounds)
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

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model,
                "sessions": len(self.pool.slots),
                "busy": self.pool.busy,
                "waiting": self.pool.waiting,
            }
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "kvrt"}],
            }
        )

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

    async def metrics(self, request: Request) -> Response:
        try:
            state = await (await self.state()).stats()
        except StateError:
            state = StateStats(
                where="",
                responses=0,
                response_bytes=0,
                conversations=0,
                conversation_bytes=0,
                refused=0,
                failures=1,
            )
        text = exposition(
            requests=self.requests,
            tokens=self.tokens,
            gone=self.gone,
            cold=self.runtime.cold_stats(),
            pool=self.pool,
            state=state,
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions`` (:func:`kvrt.serve.protocol.chat.read_chat`)."""

        async def start() -> Call:
            return await self._off_loop(chat.read_chat, await read_body(request), self.limits)

        return await self._answer(request, "chat", start)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""

        async def start() -> Call:
            body = await read_body(request)
            return await self._off_loop(chat.read_completion, body, self.limits)

        return await self._answer(request, "completions", start)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` (:mod:`kvrt.serve.protocol.responses`): what it continues
        is read from the state store, and what it adds kept there."""
        created, tenant = time.time(), tenant_of(request)
        asked: list[responses.ResponsesRequest] = []
        conversation: list[str] = []  # the conversation it continues, if any
        before: list[kvrt.Message] = []  # what the request continues
        given: list[kvrt.Message] = []  # what its input adds

        async def start() -> Call:
            body = await read_body(request)
            req = await self._off_loop(responses.read_request, body, self.limits)
            cid = conversations.conversation_id(req.conversation)
            req.conversation = cid
            if cid is not None and req.previous_response_id:
                raise RequestError(
                    "give conversation or previous_response_id, not both", param="conversation"
                )
            state = await self.state()
            try:
                if cid is not None:
                    conversation.append(cid)
                    items = await kept.items_in(state, tenant, cid, "conversation")
                    before.extend(await self._off_loop(conversations.messages, items))
                elif req.previous_response_id:
                    found = await kept.kept_response(
                        state, tenant, req.previous_response_id, "previous_response_id"
                    )
                    before.extend(found.messages)
            except StateError as exc:
                where = "conversation" if cid is not None else "previous_response_id"
                raise state_refusal(exc, where) from None
            call, added = await self._off_loop(responses.responses_call, req, before, self.limits)
            asked.append(req)
            given.extend(added)
            return call

        async def store(rid: str, done: kvrt.Completion, body: dict[str, Any]) -> None:
            """Keep what the response added, whole or not at all: a :class:`StateError`
            when it cannot be kept, the conversation's 404 when it went meanwhile."""
            req, state = asked[0], await self.state()
            cid = conversation[0] if conversation else None
            added = []
            if cid is not None:
                added = [i for m in given for i in conversations.items_of(m)]
                added += conversations.conversation_items(body["output"])
            response = None
            if req.store is not False:
                messages = (*before, *given, *responses.output_messages(done))
                span = (len(before), len(before) + len(given))
                response = (rid, KeptResponse(messages, span, msgspec.json.encode(body)))
            if (cid is not None or response is not None) and not await state.keep_turn(
                tenant, response, cid, added
            ):
                raise conversations.not_kept(cid or "", "conversation")

        async def finish(rid: str, done: kvrt.Completion) -> dict[str, Any]:
            output = responses.output_items(done, {})
            body = responses.response_body(
                rid,
                self.model,
                asked[0],
                created=created,
                status="completed",
                output=output,
                done=done,
            )
            try:
                await store(rid, done, body)
            except StateError as exc:
                raise state_refusal(exc) from None
            return body

        async def stream(
            rid: str, answer: Started, finished: Callable[[kvrt.Completion], None]
        ) -> AsyncIterator[bytes]:
            events = responses.ResponseEvents(rid, self.model, asked[0], created)
            for event in events.start():
                yield _sse(event)
            async for piece in answer:
                for event in events.piece(piece):
                    yield _sse(event)
            done = await answer
            finished(done)
            ended, body = events.finish(done)
            for event in ended:
                yield _sse(event)
            try:
                await store(rid, done, body)
            except StateError as exc:
                yield _sse(events.failed(body, f"state_{exc.kind}", str(exc)))
                return
            except RequestError as exc:  # its conversation was deleted meanwhile
                yield _sse(events.failed(body, exc.code or "not_kept", str(exc)))
                return
            yield _sse(events.completed(body))

        return await self._answer(request, "responses", start, finish=finish, stream=stream)

    # -- plumbing --

    async def _answer(
        self,
        request: Request,
        route: str,
        start: Callable[[], Awaitable[Call]],
        *,
        finish: Callable[[str, kvrt.Completion], Awaitable[dict[str, Any]]] | None = None,
        stream: StreamBody | None = None,
    ) -> Response:
        """Answer one request: read it into a call (``start``), lend it a session, then
        reply with the JSON ``finish`` makes of the completion, or with ``stream``'s events
        (chat and completions by default)."""
        is_chat = route == "chat"
        prefix = {"chat": "chatcmpl", "completions": "cmpl", "responses": "resp"}[route]
        rid = chat.completion_id(prefix) if route != "responses" else responses.object_id(prefix)
        stack = AsyncExitStack()
        try:
            call = await start()
        except RequestError as exc:
            return self._error(route, exc)
        except ClientDisconnect:
            self.gone["body"] += 1
            return Response(status_code=400)  # nobody reads it
        pin = request.headers.get(PIN_HEADER)
        if pin is not None and not (0 < len(pin) <= 100 and pin.isprintable()):
            return self._error(
                route,
                RequestError(
                    f"{PIN_HEADER} must be 1 to 100 printable characters", param=PIN_HEADER
                ),
            )
        wanted = call.history
        scope = reuse_scope(tenant_of(request), call.cache_salt)
        # From here on a client that leaves stops the work: its place in the queue, or
        # the generation (a stream's own response notices, see EventStream).
        async with until_gone(request) as left:
            try:
                slot = await stack.enter_async_context(self.pool.lend(wanted, pin, scope))
            except PoolFull as exc:
                await stack.aclose()
                return self._error(
                    route,
                    RequestError(str(exc), status=429, code="busy", kind="rate_limit_exceeded"),
                    headers={"Retry-After": str(self.config.retry_after)},
                )
            except kvrt.KvrtError as exc:  # no session could open (the runtime closed)
                await stack.aclose()
                return self._error(route, refusal(exc))
        if left.gone:
            await stack.aclose()
            self.gone["queued"] += 1
            return Response(status_code=400)
        if call.stream:
            # The reply is built and its first piece read before the stream's 200 goes
            # out: what is refused before any token (a grammar that accepts nothing, a
            # context too large) is a 400 with the error body, not a stream's last event.
            answer: kvrt.Reply | None = None
            first: kvrt.Piece | None = None
            async with until_gone(request) as left:
                try:
                    answer = await self._off_loop(call.start, _session(slot))
                    first = await anext(answer, None)
                except (kvrt.KvrtError, RequestError) as exc:
                    await stack.aclose()
                    refused = exc if isinstance(exc, RequestError) else refusal(exc)
                    return self._error(route, refused)
            if left.gone or answer is None:
                await stack.aclose()
                self.gone["answer"] += 1
                return Response(status_code=400)
            started = Started(answer, first)
            if stream is None:
                body = self._stream(
                    route,
                    rid,
                    stack,
                    slot,
                    wanted,
                    started,
                    call.include_usage,
                    legacy=call.legacy_functions,
                )
            else:
                body = self._streamed(route, stack, slot, wanted, partial(stream, rid, started))
            return EventStream(
                body, request.scope, self.config.stall_timeout, self._stalled, self._left_stream
            )
        done = None
        async with stack, until_gone(request) as left:
            try:
                done = await (await self._off_loop(call.start, _session(slot)))
            except kvrt.KvrtError as exc:
                return self._error(route, refusal(exc))
            except RequestError as exc:
                return self._error(route, exc)
            self._count(done)
            slot.history = _held(wanted, done)
        if left.gone:  # the generation stopped where it was, the session is free
            self.gone["answer"] += 1
            return Response(status_code=400)
        if finish is not None:
            try:
                answered = await finish(rid, done)
            except RequestError as exc:
                return self._error(route, exc)
            self.requests[(route, 200)] += 1
            return JSONResponse(answered)
        self.requests[(route, 200)] += 1
        if not is_chat:
            return JSONResponse(chat.completion_response(rid, self.model, done))
        answered = chat.chat_response(rid, self.model, done)
        return JSONResponse(chat.as_legacy(answered) if call.legacy_functions else answered)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, within ``grammar_timeout``: reading a request
        (a large body) and building its reply (compiling its tools' and response format's
        grammars) never stall the event loop for the other clients. Past the timeout the
        request is a 400 (the thread finishes on its own; what it compiled is kept)."""
        limit = self.config.grammar_timeout
        with anyio.move_on_after(limit) as waited:
            return await off_loop(partial(fn, *args), limiter=self.readers, abandon_on_cancel=True)
        assert waited.cancelled_caught
        raise RequestError(
            f"reading the request and compiling its grammars took more than {limit:g} s "
            "(its tools' parameters or response_format): simplify the schema",
            code="grammar_timeout",
        )

    async def _streamed(
        self,
        route: str,
        stack: AsyncExitStack,
        slot: PoolSlot,
        wanted: History,
        events: Callable[[Callable[[kvrt.Completion], None]], AsyncIterator[bytes]],
    ) -> AsyncIterator[bytes]:
        """A stream of ``events`` (given what to call with the completion), holding the
        session until it ends."""
        closing = False

        def finished(done: kvrt.Completion) -> None:
            self._count(done)
            slot.history = _held(wanted, done)

        async with stack:
            try:
                async for chunk in events(finished):
                    try:
                        yield chunk
                    except GeneratorExit:
                        closing = True
                        raise
            except kvrt.KvrtError as exc:
                if not closing and not isinstance(exc, kvrt.OperationCancelledError):
                    yield self._stream_error(route, exc, event=b"event: error\n")
                return
        self.requests[(route, 200)] += 1

    def _stream_error(self, route: str, exc: kvrt.KvrtError, *, event: bytes = b"") -> bytes:
        """A refusal met mid-stream, counted, as the stream's last event."""
        refused = refusal(exc)
        self.requests[(route, refused.status)] += 1
        body = error_body(str(refused), kind=refused.kind, param=refused.param, code=refused.code)
        return event + b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _stalled(self) -> None:
        self.gone["stalled"] += 1

    def _left_stream(self) -> None:
        self.gone["answer"] += 1

    async def _stream(
        self,
        route: str,
        rid: str,
        stack: AsyncExitStack,
        slot: PoolSlot,
        wanted: History,
        answer: Started,
        include_usage: bool,
        *,
        legacy: bool = False,
    ) -> AsyncIterator[bytes]:
        is_chat = route == "chat"
        closing = False  # the client has gone: nothing more may be sent
        async with stack:  # a client that goes away cancels this: generation stops
            try:
                if is_chat:
                    yield chat.chunk(rid, self.model, chat=True, role=True, text="")
                async for piece in answer:
                    if piece.text or piece.tool_calls or piece.logprob is not None:
                        for event in chat.piece_chunks(
                            rid, self.model, piece, chat=is_chat, legacy=legacy
                        ):
                            yield event
                done = await answer
            except GeneratorExit:
                closing = True
                raise
            except kvrt.KvrtError as exc:
                if not closing and not isinstance(exc, kvrt.OperationCancelledError):
                    yield self._stream_error(route, exc)
                return
            self._count(done)
            slot.history = _held(wanted, done)
            finish = chat.FINISH[done.finish_reason]
            yield chat.chunk(rid, self.model, chat=is_chat, finish=finish, legacy=legacy)
            if include_usage:
                yield chat.chunk(rid, self.model, chat=is_chat, done=done)
            yield b"data: [DONE]\n\n"
        self.requests[(route, 200)] += 1

    def _count(self, done: kvrt.Completion) -> None:
        u = done.usage
        self.tokens["reused"] += u.reused_tokens
        self.tokens["restored"] += u.restored_tokens
        self.tokens["prefilled"] += u.prefilled_tokens
        self.tokens["approximate"] += u.approximate_tokens
        self.tokens["generated"] += u.completion_tokens

    def _error(
        self, route: str, exc: RequestError, headers: dict[str, str] | None = None
    ) -> Response:
        self.requests[(route, exc.status)] += 1
        body = error_body(str(exc), kind=exc.kind, param=exc.param, code=exc.code)
        return JSONResponse(body, status_code=exc.status, headers=headers)


StreamBody = Callable[..., AsyncIterator[bytes]]
"""A route's own stream: given the response id, the reply (started) and the callback for
the completion, the bytes of its events."""


def _sse(event: dict[str, Any]) -> bytes:
    """One Responses API event as server-sent event bytes."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def _session(slot: PoolSlot) -> kvrt.Session:
    assert slot.session is not None
    return slot.session


def _held(wanted: History, done: kvrt.Completion) -> History:
    """What the session holds after answering ``wanted`` with ``done``: the reply as the
    client will send it back (its content, or its tool calls)."""
    if isinstance(wanted, str):
        return wanted + done.text
    calls = tuple((c.id, c.name, c.arguments) for c in done.tool_calls)
    return (*wanted, kvrt.Message(role="assistant", content=done.text, tool_calls=calls))
