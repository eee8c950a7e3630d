"""The ASGI application: OpenAI-compatible routes over a runtime's session pool."""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvrt

from . import conversations, openai, responses
from .openai import ChatRequest, CompletionRequest, RequestError
from .pool import History, Pool, PoolFull, Slot
from .reading import read_body, tenant_of
from .responses import Answer
from .stall import PADDING, ClientWatch
from .state import (
    Bounds,
    KeptResponse,
    StateError,
    StateStats,
    StateStore,
    open_state,
    refusal,
)

__all__ = ["ServeConfig", "Server", "create_app", "model_id"]


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How ``kvrt serve`` serves a runtime."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    max_sessions: int = 4
    """Sessions kept live at once (each holds a hot window)."""
    max_queue: int = 16
    """Requests that may wait for a session; past it a request gets 429."""
    hot_tokens: int | None = None
    """Each session's hot window (default: the runtime's)."""
    model_name: str | None = None
    """The model id clients send (default: the model file's name)."""
    default_max_tokens: int = 512
    """Tokens generated when a request gives no ``max_tokens``."""
    retry_after: int = 1
    """Seconds a refused (429) request is told to wait."""
    stall_timeout: float = 30.0
    """Seconds a streaming client may hold bytes it has not taken; past it the stream is
    closed and the session goes back to the pool, however slow the engine (what the client
    has taken is read from its connection on Linux; elsewhere, once the send buffer and
    the client's receive buffer are full)."""
    send_buffer: int = 65536
    """Bytes of each connection's socket send buffer (``SO_SNDBUF``; the kernel may
    double it)."""
    api_key: str | None = None
    """When set, every route but ``/health`` requires ``Authorization: Bearer <key>``
    (compared in constant time); others get a 401. One key is one tenant (``default``)."""
    response_store_bytes: int = 64 * 2**20
    """What a tenant's kept responses (for ``previous_response_id``) may take, in bytes;
    the least recently used go first (also past ``state_bounds.responses`` of them, or
    unused for ``state_bounds.response_age``)."""
    conversation_store_bytes: int = 256 * 2**20
    """What a tenant's conversations may take, in bytes; past it items are refused
    (a 507 naming the bound) until some are deleted."""
    state_path: str | None = None
    """The SQLite database of kept responses and conversations, so they outlive restarts
    (``kvrt serve``'s default: ``$KVRT_CACHE_DIR/state.sqlite3``, beside the disk tier's
    blocks); None keeps them in this process's memory. With the runtime's ``remote.url``
    they live on that server instead, shared by every replica."""
    state_bounds: Bounds = msgspec.field(default_factory=Bounds)
    """Per-tenant counts and ages of kept responses and conversations (their bytes are
    ``response_store_bytes`` and ``conversation_store_bytes``)."""
    max_grammar_bytes: int = 256 * 1024
    """The largest JSON Schema (a response format, a tool's parameters) compiled for a
    request, in bytes of JSON; larger ones are a 400 before anything is compiled."""
    grammar_timeout: float = 10.0
    """Seconds reading a request and compiling its grammars may take (in a worker thread,
    never on the event loop); past them the request is a 400."""
    api_keys: dict[str, str] = msgspec.field(default_factory=dict)
    """Keys accepted, each with the tenant it names (``{key: tenant}``; several keys may
    name one tenant). Reuse of every kind (a session's hot KV, cold blocks in RAM, on disk
    and in Redis, remembered replies, stored responses) happens only within a tenant, and
    a request's ``cache_salt`` narrows it further. No key and no salt: everything is
    shared (one user's machine)."""

    def tenants(self) -> dict[str, str]:
        """Every key accepted, with its tenant."""
        keys = dict(self.api_keys)
        if self.api_key:
            keys.setdefault(self.api_key, "default")
        return keys


PIN_HEADER = "x-session-id"


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
            hot_tokens=config.hot_tokens,
        )
        self.requests: Counter[tuple[str, int]] = Counter()
        self.tokens: Counter[str] = Counter()
        self._state: StateStore | None = None
        self._opening = anyio.Lock()
        self.kept = responses.KeptRoutes(self.state, partial(self._error, "responses"))
        self.conversation_routes = conversations.Routes(
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

    async def metrics(self, request: Request) -> Response:
        cold = self.runtime.cold_stats()
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
        lines = [
            "# HELP kvrt_requests_total Requests answered, by route and status.",
            "# TYPE kvrt_requests_total counter",
            *(
                f'kvrt_requests_total{{route="{route}",status="{status}"}} {n}'
                for (route, status), n in sorted(self.requests.items())
            ),
            "# HELP kvrt_tokens_total Tokens by what kvrt did with them.",
            "# TYPE kvrt_tokens_total counter",
            *(
                f'kvrt_tokens_total{{kind="{kind}"}} {self.tokens[kind]}'
                for kind in ("reused", "restored", "prefilled", "approximate", "generated")
            ),
            "# HELP kvrt_cold_store_bytes KV bytes held by the cold store.",
            "# TYPE kvrt_cold_store_bytes gauge",
            f"kvrt_cold_store_bytes {cold.bytes}",
            "# HELP kvrt_cold_store_budget_bytes The cold store's budget.",
            "# TYPE kvrt_cold_store_budget_bytes gauge",
            f"kvrt_cold_store_budget_bytes {cold.budget_bytes}",
            "# HELP kvrt_cold_store_entries Blocks held by the cold store.",
            "# TYPE kvrt_cold_store_entries gauge",
            f"kvrt_cold_store_entries {cold.entries}",
            "# HELP kvrt_cold_blocks_refused_total Stored blocks never used, by why: a "
            "shared tier's value whose tag fails (forged), that fails its checks (damaged) "
            "or is larger than any block (oversized); bytes the engine rejected (rejected).",
            "# TYPE kvrt_cold_blocks_refused_total counter",
            *(
                f'kvrt_cold_blocks_refused_total{{why="{why}"}} {n}'
                for why, n in _refused(cold).items()
            ),
            "# HELP kvrt_sessions Live sessions.",
            "# TYPE kvrt_sessions gauge",
            f"kvrt_sessions {len(self.pool.slots)}",
            "# HELP kvrt_sessions_busy Sessions serving a request.",
            "# TYPE kvrt_sessions_busy gauge",
            f"kvrt_sessions_busy {self.pool.busy}",
            "# HELP kvrt_queue_depth Requests waiting for a session.",
            "# TYPE kvrt_queue_depth gauge",
            f"kvrt_queue_depth {self.pool.waiting}",
            "# HELP kvrt_responses_stored Responses kept for previous_response_id (in a "
            "shared state server: 0, the server holds the count).",
            "# TYPE kvrt_responses_stored gauge",
            f"kvrt_responses_stored {state.responses}",
            "# HELP kvrt_responses_stored_bytes Bytes of the conversations they keep.",
            "# TYPE kvrt_responses_stored_bytes gauge",
            f"kvrt_responses_stored_bytes {state.response_bytes}",
            "# HELP kvrt_conversations_stored Conversations kept.",
            "# TYPE kvrt_conversations_stored gauge",
            f"kvrt_conversations_stored {state.conversations}",
            "# HELP kvrt_conversations_stored_bytes Bytes of their items.",
            "# TYPE kvrt_conversations_stored_bytes gauge",
            f"kvrt_conversations_stored_bytes {state.conversation_bytes}",
            "# HELP kvrt_state_refused_total Kept rows or values refused as damaged or forged.",
            "# TYPE kvrt_state_refused_total counter",
            f"kvrt_state_refused_total {state.refused}",
            "# HELP kvrt_state_failures_total Writes the state store could not make.",
            "# TYPE kvrt_state_failures_total counter",
            f"kvrt_state_failures_total {state.failures}",
            "# HELP kvrt_clients_gone_total Requests whose client left before the answer, by "
            "when (stalled: a stream closed after its client stopped reading).",
            "# TYPE kvrt_clients_gone_total counter",
            *(
                f'kvrt_clients_gone_total{{when="{when}"}} {self.gone[when]}'
                for when in ("body", "queued", "answer", "stalled")
            ),
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Response:
        async def start() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
            body = await read_body(request)

            def parse() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
                openai.check_schema_bytes(body, self.config.max_grammar_bytes)
                req = openai.read(body, ChatRequest)
                self._check_model(req.model)
                request.state.legacy_functions = openai.legacy_functions(req)
                try:
                    messages = tuple(kvrt.read_messages(openai.legacy_messages(req.messages)))
                except kvrt.KvrtError as exc:
                    raise RequestError(str(exc), param="messages") from None
                openai.check_tool_turns(messages)
                options = self._options(req)
                options.update(self._chat_options(req))

                def reply(session: kvrt.Session) -> kvrt.Reply:
                    return session.chat(messages, **options)

                return req, messages, reply

            return await self._off_loop(parse)

        return await self._answer(request, "chat", start)

    async def completions(self, request: Request) -> Response:
        async def start() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
            body = await read_body(request)

            def parse() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
                req = openai.read(body, CompletionRequest)
                self._check_model(req.model)
                prompt = req.prompt
                if isinstance(prompt, list):
                    if len(prompt) != 1:
                        raise RequestError("prompt must be one string", param="prompt")
                    prompt = prompt[0]
                if not prompt:
                    raise RequestError("prompt is empty", param="prompt")
                options = self._options(req, default=16)

                def reply(session: kvrt.Session) -> kvrt.Reply:
                    return session.complete(prompt, **options)

                return req, prompt, reply

            return await self._off_loop(parse)

        return await self._answer(request, "completions", start)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` (see :mod:`kvrt.serve.responses`)."""
        created = time.time()
        kept: list[kvrt.Message] = []
        span = [0, 0]  # where the request's own input lies in kept

        async def start() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
            body = await read_body(request)
            tenant = tenant_of(request)

            def parse() -> Any:
                openai.check_schema_bytes(body, self.config.max_grammar_bytes, responses_api=True)
                req = responses.read(body)
                self._check_model(req.model)
                conversation = conversations.conversation_id(req.conversation)
                if conversation is not None and req.previous_response_id:
                    raise RequestError(
                        "give conversation or previous_response_id, not both",
                        param="conversation",
                    )
                req.conversation = conversation
                return req

            req = await self._off_loop(parse)
            state = await self.state()
            try:
                if req.conversation is not None:
                    items = await conversations.items_in(
                        state, tenant, req.conversation, param="conversation"
                    )
                    before = await self._off_loop(conversations.messages, items)
                elif req.previous_response_id:
                    found = await responses.kept_response(
                        state, tenant, req.previous_response_id, param="previous_response_id"
                    )
                    before = list(found.messages)
                else:
                    before = []
            except StateError as exc:
                raise refusal(
                    exc, "conversation" if req.conversation else "previous_response_id"
                ) from None

            def build() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
                given = responses.to_messages(req.input)
                span[:] = [len(before), len(before) + len(given)]
                kept.extend(before + given)
                head = (
                    [kvrt.Message(role="system", content=req.instructions)]
                    if req.instructions
                    else []
                )
                messages = tuple(head + kept)
                if not messages:
                    raise RequestError("input is empty: give at least one item", param="input")
                openai.check_tool_turns(kept, param="input")
                options = self._options(_AsChat(req))
                options.update(self._chat_options(_AsChat(req), responses_api=True))

                def reply(session: kvrt.Session) -> kvrt.Reply:
                    return session.chat(messages, **options)

                return req, messages, reply

            return await self._off_loop(build)

        async def store(rid: str, req: Any, done: kvrt.Completion, body: dict[str, Any]) -> None:
            """Keep what the response added (a :class:`StateError` when it cannot be)."""
            state, tenant = await self.state(), tenant_of(request)
            if req.conversation is not None:
                added = [i for m in kept[span[0] : span[1]] for i in conversations.items_of(m)]
                added += conversations.output_items(body["output"])
                await conversations.add(state, tenant, req.conversation, added)
            if req.store is not False:
                messages = tuple(kept + responses.output_messages(done))
                encoded = msgspec.json.encode(body)
                answer = KeptResponse(messages, (span[0], span[1]), encoded)
                await state.keep_response(tenant, rid, answer)

        async def finish(rid: str, done: kvrt.Completion) -> dict[str, Any]:
            req = request.state.responses_request
            output = responses.output_items(done, {})
            body = responses.response_body(
                rid, self.model, req, created=created, status="completed", output=output, done=done
            )
            try:
                await store(rid, req, done, body)
            except StateError as exc:
                raise refusal(exc) from None
            return body

        async def stream(
            rid: str, answer: kvrt.Reply, finished: Callable[[kvrt.Completion], None]
        ) -> AsyncIterator[bytes]:
            req = request.state.responses_request

            async def answered(completion: kvrt.Completion, body: dict[str, Any]) -> None:
                await store(rid, req, completion, body)

            async for ev in responses.events(
                answer, rid, self.model, req, created, finished, answered
            ):
                yield (
                    b"event: "
                    + ev["type"].encode()
                    + b"\ndata: "
                    + msgspec.json.encode(ev)
                    + b"\n\n"
                )

        async def reading() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
            req, wanted, reply = await start()
            request.state.responses_request = req
            return req, wanted, reply

        return await self._answer(request, "responses", reading, finish=finish, stream=stream)

    # -- plumbing --

    async def _answer(
        self,
        request: Request,
        route: str,
        start: Callable[[], Awaitable[tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]]],
        *,
        finish: Callable[[str, kvrt.Completion], Awaitable[dict[str, Any]]] | None = None,
        stream: StreamBody | None = None,
    ) -> Response:
        """Answer one request: read it (``start``), lend it a session, then reply with the
        JSON ``finish`` makes of the completion, or with ``stream``'s events (chat and
        completions by default)."""
        chat = route == "chat"
        prefix = {"chat": "chatcmpl", "completions": "cmpl", "responses": "resp"}[route]
        rid = openai.new_id(prefix) if route != "responses" else responses.new_id(prefix)
        stack = AsyncExitStack()
        try:
            req, wanted, reply = await start()
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
        scope = reuse_scope(tenant_of(request), getattr(req, "cache_salt", None))
        legacy = getattr(request.state, "legacy_functions", False)
        # From here on a client that leaves stops the work: its place in the queue, or
        # the generation (a stream's own response notices, see _Stream).
        async with _until_gone(request) as left:
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
                return self._error(route, _refusal(exc))
        if left.gone:
            await stack.aclose()
            self.gone["queued"] += 1
            return Response(status_code=400)
        if req.stream:
            # The reply is built and its first piece read before the stream's 200 goes
            # out: what is refused before any token (a grammar that accepts nothing, a
            # context too large) is a 400 with the error body, not a stream's last event.
            answer: kvrt.Reply | None = None
            first: kvrt.Piece | None = None
            async with _until_gone(request) as left:
                try:
                    answer = await self._off_loop(reply, _session(slot))
                    first = await anext(answer, None)
                except (kvrt.KvrtError, RequestError) as exc:
                    await stack.aclose()
                    refusal = exc if isinstance(exc, RequestError) else _refusal(exc)
                    return self._error(route, refusal)
            if left.gone or answer is None:
                await stack.aclose()
                self.gone["answer"] += 1
                return Response(status_code=400)
            started = _Started(answer, first)
            if stream is None:
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                body = self._stream(
                    route, rid, stack, slot, wanted, started, include_usage, legacy=legacy
                )
            else:
                body = self._streamed(route, stack, slot, wanted, partial(stream, rid, started))
            return _Stream(
                body, request.scope, self.config.stall_timeout, self._stalled, self._left_stream
            )
        done = None
        async with stack, _until_gone(request) as left:
            try:
                done = await (await self._off_loop(reply, _session(slot)))
            except kvrt.KvrtError as exc:
                return self._error(route, _refusal(exc))
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
        if not chat:
            return JSONResponse(openai.completion_response(rid, self.model, done))
        answered = openai.chat_response(rid, self.model, done)
        return JSONResponse(openai.as_legacy(answered) if legacy else answered)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, within ``grammar_timeout``: reading a request
        (a large body) and building its reply (compiling its tools' and response format's
        grammars) never stall the event loop for the other clients. Past the timeout the
        request is a 400 (the thread finishes on its own; what it compiled is kept)."""
        limit = self.config.grammar_timeout
        with anyio.move_on_after(limit) as waited:
            try:
                return await anyio.to_thread.run_sync(
                    partial(fn, *args), limiter=self.readers, abandon_on_cancel=True
                )
            except RequestError as exc:
                # Raised afresh, the worker's traceback dropped: its frames (and the request
                # body in them) sit in a reference cycle with the error, which would keep
                # them until the garbage collector next looks (a 20 MB body stayed a while).
                exc.__traceback__ = None
                raise RequestError(
                    str(exc), status=exc.status, param=exc.param, code=exc.code, kind=exc.kind
                ) from None
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
        slot: Slot,
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
        refusal = _refusal(exc)
        self.requests[(route, refusal.status)] += 1
        body = openai.error_body(
            str(refusal), kind=refusal.kind, param=refusal.param, code=refusal.code
        )
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
        slot: Slot,
        wanted: History,
        answer: Answer,
        include_usage: bool,
        *,
        legacy: bool = False,
    ) -> AsyncIterator[bytes]:
        chat = route == "chat"
        closing = False  # the client has gone: nothing more may be sent
        async with stack:  # a client that goes away cancels this: generation stops
            try:
                if chat:
                    yield openai.chunk(rid, self.model, chat=True, role=True, text="")
                async for piece in answer:
                    if piece.text or piece.tool_calls or piece.logprob is not None:
                        yield openai.chunk(
                            rid,
                            self.model,
                            chat=chat,
                            text=piece.text or None,
                            piece=piece,
                            legacy=legacy,
                        )
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
            finish = openai.FINISH[done.finish_reason]
            yield openai.chunk(rid, self.model, chat=chat, finish=finish, legacy=legacy)
            if include_usage:
                yield openai.chunk(rid, self.model, chat=chat, done=done)
            yield b"data: [DONE]\n\n"
        self.requests[(route, 200)] += 1

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise RequestError(
                f"unknown model {model!r}: this server serves {self.model!r}",
                param="model",
                code="model_not_found",
            )

    def _options(self, req: Any, *, default: int | None = None) -> dict[str, Any]:
        limit = self.runtime.model_info.capacity.planner_effective_context
        options = {
            "max_tokens": openai.max_tokens(
                req, default=default or self.config.default_max_tokens, limit=limit
            ),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "stop": req.stop,
        }
        for name in ("temperature", "top_p"):
            value = options[name]
            if value is not None and not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number", param=name)
        sampling = ("temperature", "top_p", "top_k", "seed")
        bias = openai.logit_bias(req)
        try:  # checked now (the bias against the vocabulary too), a 400 before any work
            params = kvrt.SamplingParams(
                **{k: options[k] for k in sampling if options[k] is not None}, logit_bias=bias
            )
            kvrt.Sampler(params, self.runtime.engine.facts.n_vocab)
        except kvrt.KvrtError as exc:
            param = next((k for k in (*sampling, "logit_bias") if k in str(exc)), None)
            raise RequestError(str(exc), param=param) from None
        if bias is not None:
            options["sampling"] = {"logit_bias": bias}
        options["logprobs"] = openai.logprobs(req)
        return options

    def _chat_options(self, req: Any, *, responses_api: bool = False) -> dict[str, Any]:
        """Tools and structured output, checked now: a bad one is a 400 naming it as the
        client sent it (``text.format`` and ``tools[0].parameters`` on the Responses API).
        Schemas past ``max_grammar_bytes`` are refused before they are compiled, and tool
        schemas a request cannot use (``tool_choice: "none"``) are not compiled."""
        fmt_param = "text.format" if responses_api else "response_format"
        limit = self.config.max_grammar_bytes

        def named(text: str) -> str:
            return text.replace(".function.parameters", ".parameters") if responses_api else text

        for i, tool in enumerate(req.tools or ()):
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            size = len(msgspec.json.encode(fn.get("parameters"))) if isinstance(fn, dict) else 0
            if size > limit:
                where = named(f"tools[{i}].function.parameters")
                raise RequestError(
                    f"{where} is a {size:,}-byte schema; this server compiles at most "
                    f"{limit:,} bytes (max_grammar_bytes)",
                    param=where,
                )
        if req.response_format is not None:
            size = len(msgspec.json.encode(req.response_format))
            if size > limit:
                raise RequestError(
                    f"{fmt_param} is {size:,} bytes; this server compiles at most {limit:,} "
                    "(max_grammar_bytes)",
                    param=fmt_param,
                )
        options: dict[str, Any] = {}
        try:
            tools = kvrt.read_tools(req.tools, check_schemas=False)
        except kvrt.KvrtError as exc:
            raise RequestError(named(str(exc)), param="tools") from None
        try:
            choice = kvrt.read_tool_choice(req.tool_choice, tools)
        except kvrt.KvrtError as exc:
            raise RequestError(str(exc), param="tool_choice") from None
        if tools and choice != "none":
            try:
                kvrt.read_tools(req.tools)  # their grammars, compiled (and kept) now
            except kvrt.KvrtError as exc:
                raise RequestError(named(str(exc)), param="tools") from None
        if tools:
            options["tools"] = tools
            options["tool_choice"] = req.tool_choice
            options["parallel_tool_calls"] = req.parallel_tool_calls is not False
        if req.response_format is not None:
            try:
                kvrt.read_response_format(req.response_format)
            except kvrt.KvrtError as exc:
                message = str(exc).replace("response_format", fmt_param)
                if responses_api:
                    message = message.replace(
                        "text.format.json_schema.schema", "text.format.schema"
                    )
                raise RequestError(message, param=fmt_param) from None
            options["response_format"] = req.response_format
        return options

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
        body = openai.error_body(str(exc), kind=exc.kind, param=exc.param, code=exc.code)
        return JSONResponse(body, status_code=exc.status, headers=headers)


StreamBody = Callable[..., AsyncIterator[bytes]]
"""A route's own stream: given the response id, the reply (started) and the callback for
the completion, the bytes of its events."""

T = TypeVar("T")


class _Started:
    """A reply whose first piece was read already: that piece, then the rest; awaited,
    the completion."""

    def __init__(self, reply: kvrt.Reply, first: kvrt.Piece | None) -> None:
        self._reply = reply
        self._first = first
        self._ended = first is None

    def __aiter__(self) -> _Started:
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


class _AsChat:
    """A Responses request seen as the chat options it asks for."""

    def __init__(self, req: responses.ResponsesRequest) -> None:
        self.max_tokens = req.max_output_tokens
        self.max_completion_tokens = None
        self.temperature = req.temperature
        self.top_p = req.top_p
        self.top_k = None
        self.seed = None
        self.stop = None
        self.tools = responses.tools_of(req)
        self.tool_choice = responses.tool_choice_of(req)
        self.parallel_tool_calls = req.parallel_tool_calls
        self.response_format = responses.response_format(req)
        wanted = "message.output_text.logprobs" in (req.include or ())
        self.logprobs = req.top_logprobs is not None or wanted
        self.top_logprobs = req.top_logprobs


def reuse_scope(tenant: str | None, salt: str | None) -> str | None:
    """What a request may reuse with: requests of its tenant and cache salt alone, as the
    cache salt of the sessions serving them (a digest: any tenant name and salt make a
    valid one). None where there is neither: everything is shared."""
    if tenant is None and salt is None:
        return None
    h = hashlib.blake2b(msgspec.json.encode([tenant, salt]), digest_size=16)
    return h.hexdigest()


def model_id(runtime: kvrt.Runtime, config: ServeConfig) -> str:
    """The model id the server serves (``/v1/models``) and clients send."""
    return config.model_name or Path(runtime.model_info.model.path).stem


class _Left:
    """Whether the client went away (set by :func:`_until_gone`)."""

    gone = False


@asynccontextmanager
async def _until_gone(request: Request) -> AsyncIterator[_Left]:
    """Run the body until it is done or the client disconnects (its request body already
    read): then the body is cancelled and ``gone`` is set."""
    left = _Left()
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


class _Stream(StreamingResponse):
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

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                if watch is not None:
                    tg.start_soon(watcher, tg.cancel_scope)
                try:
                    async with to_client:
                        start = {"type": "http.response.start", "status": self.status_code}
                        await self._put(to_client, {**start, "headers": self.raw_headers})
                        if watch is not None:
                            await self._put(to_client, _body(_PADDING))
                        async for chunk in self.body_iterator:
                            body = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                            await self._put(to_client, _body(body))
                        await self._put(
                            to_client,
                            {"type": "http.response.body", "body": b"", "more_body": False},
                        )
                    watching.cancel()  # done: the writer sends the rest
                except _Stalled:
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

    async def _put(self, to_client: MemoryObjectSendStream[Message], message: Message) -> None:
        with anyio.move_on_after(self.stall_timeout) as waited:
            await to_client.send(message)
        if waited.cancelled_caught:
            raise _Stalled


def _body(chunk: bytes) -> Message:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


_PADDING = (b":" + b" " * 1021 + b"\n") * (PADDING // 1023) + b"\n"
"""The comment a stream opens with (lines of a kilobyte: readers that bound a line's
length read it too), which every SSE reader skips."""


class _Stalled(Exception):
    """A streamed chunk's client did not take it within the stall timeout."""


def _refused(cold: kvrt.ColdStats) -> dict[str, int]:
    remote = cold.remote
    return {
        "forged": remote.forged if remote is not None else 0,
        "damaged": (remote.refused if remote is not None else 0)
        + (cold.disk.corrupt if cold.disk is not None else 0),
        "oversized": remote.oversized if remote is not None else 0,
        "rejected": cold.rejected,
    }


def _session(slot: Slot) -> kvrt.Session:
    assert slot.session is not None
    return slot.session


def _held(wanted: History, done: kvrt.Completion) -> History:
    """What the session holds after answering ``wanted`` with ``done``: the reply as the
    client will send it back (its content, or its tool calls)."""
    if isinstance(wanted, str):
        return wanted + done.text
    calls = tuple((c.id, c.name, c.arguments) for c in done.tool_calls)
    return (*wanted, kvrt.Message(role="assistant", content=done.text, tool_calls=calls))


def _refusal(exc: kvrt.KvrtError) -> RequestError:
    if isinstance(exc, kvrt.SessionClosedError):
        return RequestError(
            f"this server's runtime is closed: {exc}",
            status=503,
            code="runtime_closed",
            kind="server_error",
        )
    if isinstance(exc, kvrt.ContextTooLargeError):
        return RequestError(str(exc), code="context_length_exceeded")
    if isinstance(exc, kvrt.ArgumentTypeError | kvrt.InvalidArgumentError):
        return RequestError(str(exc))
    if isinstance(exc, kvrt.InvalidArgumentError):
        return RequestError(str(exc))
    return RequestError(str(exc), status=500, kind="server_error")


def create_app(runtime: kvrt.Runtime, config: ServeConfig | None = None) -> Starlette:
    """The OpenAI-compatible ASGI app for ``runtime`` (mount it in your own server, or
    run it with :func:`kvrt.serve.serve`)."""
    config = config or ServeConfig()
    server = Server(runtime, config)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/responses", server.responses, methods=["POST"]),
            Route("/v1/responses/{rid}", server.kept.one, methods=["GET", "DELETE"]),
            Route("/v1/responses/{rid}/input_items", server.kept.inputs, methods=["GET"]),
            Route("/v1/conversations", server.conversation_routes.create, methods=["POST"]),
            Route(
                "/v1/conversations/{cid}",
                server.conversation_routes.one,
                methods=["GET", "POST", "DELETE"],
            ),
            Route(
                "/v1/conversations/{cid}/items",
                server.conversation_routes.items,
                methods=["GET", "POST"],
            ),
            Route(
                "/v1/conversations/{cid}/items/{iid}",
                server.conversation_routes.item,
                methods=["GET", "DELETE"],
            ),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics, methods=["GET"]),
        ],
        middleware=[Middleware(_KeyRequired, keys=config.tenants(), server=server)]
        if config.tenants()
        else [],
    )
    app.state.server = server
    return app


class _KeyRequired:
    """Refuses (401, OpenAI-style) a request without ``Authorization: Bearer <key>`` of
    a known key, but for ``/health``, and one with two such headers (a proxy and a client
    disagreeing must not pick the tenant); every key is compared in constant time. The
    request carries its key's tenant on (``request.state.kvrt_tenant``)."""

    def __init__(self, app: ASGIApp, *, keys: dict[str, str], server: Server) -> None:
        self.app = app
        self.keys = [(key.encode(), tenant) for key, tenant in keys.items()]
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") == "/health":
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope.get("headers", ()) if name == b"authorization"]
        if len(given) > 1:
            await self._refuse(
                scope, receive, send, "send one Authorization header, not several", 400, None
            )
            return
        scheme, _, token = (given[0] if given else b"").partition(b" ")
        tenant = None
        if scheme.lower() == b"bearer":
            for key, name in self.keys:  # every key compared: the time says nothing
                if hmac.compare_digest(token.strip(), key) and tenant is None:
                    tenant = name
        if tenant is not None:
            scope.setdefault("state", {})["kvrt_tenant"] = tenant
            await self.app(scope, receive, send)
            return
        await self._refuse(
            scope,
            receive,
            send,
            "a valid API key is required: send it as 'Authorization: Bearer <key>'",
            401,
            "invalid_api_key",
        )

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        message: str,
        status: int,
        code: str | None,
    ) -> None:
        self.server.requests[("auth", status)] += 1
        body = openai.error_body(message, kind="invalid_request_error", param=None, code=code)
        await JSONResponse(body, status_code=status)(scope, receive, send)
