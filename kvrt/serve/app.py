"""The ASGI application: OpenAI-compatible routes over a runtime's session pool."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import kvrt

from . import openai
from .openai import ChatRequest, CompletionRequest, RequestError
from .pool import History, Pool, PoolFull, Slot

__all__ = ["ServeConfig", "Server", "create_app"]


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


PIN_HEADER = "x-session-id"


class Server:
    """The routes' state: the runtime, its session pool, request and token counts."""

    def __init__(self, runtime: kvrt.Runtime, config: ServeConfig) -> None:
        self.runtime = runtime
        self.config = config
        self.model = config.model_name or Path(runtime.model_info.model.path).stem
        self.pool = Pool(
            runtime,
            max_sessions=config.max_sessions,
            max_queue=config.max_queue,
            hot_tokens=config.hot_tokens,
        )
        self.requests: Counter[tuple[str, int]] = Counter()
        self.tokens: Counter[str] = Counter()

    # -- routes --

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
            "# HELP kvrt_sessions Live sessions.",
            "# TYPE kvrt_sessions gauge",
            f"kvrt_sessions {len(self.pool.slots)}",
            "# HELP kvrt_sessions_busy Sessions serving a request.",
            "# TYPE kvrt_sessions_busy gauge",
            f"kvrt_sessions_busy {self.pool.busy}",
            "# HELP kvrt_queue_depth Requests waiting for a session.",
            "# TYPE kvrt_queue_depth gauge",
            f"kvrt_queue_depth {self.pool.waiting}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Response:
        async def start() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
            req = openai.read(await request.body(), ChatRequest)
            self._check_model(req.model)
            try:
                messages = tuple(kvrt.read_messages(req.messages))
            except kvrt.KvrtError as exc:
                raise RequestError(str(exc), param="messages") from None
            options = self._options(req)

            def reply(session: kvrt.Session) -> kvrt.Reply:
                return session.chat(messages, **options)

            return req, messages, reply

        return await self._answer(request, "chat", start)

    async def completions(self, request: Request) -> Response:
        async def start() -> tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]:
            req = openai.read(await request.body(), CompletionRequest)
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

        return await self._answer(request, "completions", start)

    # -- plumbing --

    async def _answer(
        self,
        request: Request,
        route: str,
        start: Callable[[], Awaitable[tuple[Any, History, Callable[[kvrt.Session], kvrt.Reply]]]],
    ) -> Response:
        chat = route == "chat"
        rid = openai.new_id("chatcmpl" if chat else "cmpl")
        stack = AsyncExitStack()
        try:
            req, wanted, reply = await start()
            pin = request.headers.get(PIN_HEADER)
            if pin is not None and not (0 < len(pin) <= 100 and pin.isprintable()):
                raise RequestError(
                    f"{PIN_HEADER} must be 1 to 100 printable characters", param=PIN_HEADER
                )
            slot = await stack.enter_async_context(self.pool.lend(wanted, pin))
        except RequestError as exc:
            await stack.aclose()
            return self._error(route, exc)
        except PoolFull as exc:
            await stack.aclose()
            return self._error(
                route,
                RequestError(str(exc), status=429, code="busy", kind="rate_limit_exceeded"),
                headers={"Retry-After": str(self.config.retry_after)},
            )
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            body = self._stream(route, rid, stack, slot, wanted, reply, include_usage)
            return StreamingResponse(body, media_type="text/event-stream")
        async with stack:
            try:
                done = await reply(_session(slot))
            except kvrt.KvrtError as exc:
                return self._error(route, _refusal(exc))
            self._count(done)
            slot.history = _held(wanted, done)
        self.requests[(route, 200)] += 1
        made = openai.chat_response if chat else openai.completion_response
        return JSONResponse(made(rid, self.model, done))

    async def _stream(
        self,
        route: str,
        rid: str,
        stack: AsyncExitStack,
        slot: Slot,
        wanted: History,
        reply: Callable[[kvrt.Session], kvrt.Reply],
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        chat = route == "chat"
        async with stack:  # a client that goes away cancels this: generation stops
            if chat:
                yield openai.chunk(rid, self.model, chat=True, role=True, text="")
            try:
                answer = reply(_session(slot))
                async for piece in answer:
                    if piece.text:
                        yield openai.chunk(rid, self.model, chat=chat, text=piece.text)
                done = await answer
            except kvrt.KvrtError as exc:
                refusal = _refusal(exc)
                self.requests[(route, refusal.status)] += 1
                body = openai.error_body(
                    str(refusal), kind=refusal.kind, param=refusal.param, code=refusal.code
                )
                yield b"data: " + msgspec.json.encode(body) + b"\n\n"
                return
            self._count(done)
            slot.history = _held(wanted, done)
            finish = openai.FINISH[done.finish_reason]
            yield openai.chunk(rid, self.model, chat=chat, finish=finish)
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
        try:  # checked now, so a bad value is a 400 before any work
            kvrt.SamplingParams(**{k: options[k] for k in sampling if options[k] is not None})
        except kvrt.KvrtError as exc:
            param = next((k for k in sampling if k in str(exc)), None)
            raise RequestError(str(exc), param=param) from None
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


def _session(slot: Slot) -> kvrt.Session:
    assert slot.session is not None
    return slot.session


def _held(wanted: History, done: kvrt.Completion) -> History:
    """What the session holds after answering ``wanted`` with ``done``."""
    if isinstance(wanted, str):
        return wanted + done.text
    return (*wanted, kvrt.Message(role="assistant", content=done.text))


def _refusal(exc: kvrt.KvrtError) -> RequestError:
    if isinstance(exc, kvrt.ContextTooLargeError):
        return RequestError(str(exc), code="context_length_exceeded")
    if isinstance(exc, kvrt.InvalidArgumentError):
        return RequestError(str(exc))
    return RequestError(str(exc), status=500, kind="server_error")


def create_app(runtime: kvrt.Runtime, config: ServeConfig | None = None) -> Starlette:
    """The OpenAI-compatible ASGI app for ``runtime`` (mount it in your own server, or
    run it with :func:`kvrt.serve.serve`)."""
    server = Server(runtime, config or ServeConfig())
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics, methods=["GET"]),
        ]
    )
    app.state.server = server
    return app
