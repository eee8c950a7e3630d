"""The ASGI application: OpenAI-compatible routes over a runtime's session pool. The app
routes and authenticates; :class:`~kvrt.serve.server.Server` answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import kvrt

from .auth import KeyRequired
from .config import ServeConfig, model_id
from .exchanges import ChatCompletions, Completions, Conversations, KeptResponses, Responses
from .metrics import exposition
from .server import Server
from .state import StateError, StateStats

__all__ = ["ServeConfig", "Server", "create_app", "model_id"]


def create_app(runtime: kvrt.Runtime, config: ServeConfig | None = None) -> Starlette:
    """The OpenAI-compatible ASGI app for ``runtime`` (mount it in your own server, or
    run it with :func:`kvrt.serve.serve`)."""
    config = config or ServeConfig()
    server = Server(runtime, config)
    kept = KeptResponses(server.state, partial(server.refuse, "responses"))
    conversations = Conversations(server.state, partial(server.refuse, "conversations"))
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", server.endpoint(ChatCompletions()), methods=["POST"]),
            Route("/v1/completions", server.endpoint(Completions()), methods=["POST"]),
            Route("/v1/responses", server.endpoint(Responses()), methods=["POST"]),
            Route("/v1/responses/{rid}", kept.one, methods=["GET", "DELETE"]),
            Route("/v1/responses/{rid}/input_items", kept.inputs, methods=["GET"]),
            Route("/v1/conversations", conversations.create, methods=["POST"]),
            Route("/v1/conversations/{cid}", conversations.one, methods=["GET", "POST", "DELETE"]),
            Route("/v1/conversations/{cid}/items", conversations.items, methods=["GET", "POST"]),
            Route(
                "/v1/conversations/{cid}/items/{iid}",
                conversations.item,
                methods=["GET", "DELETE"],
            ),
            Route("/v1/models", _models(server), methods=["GET"]),
            Route("/health", _health(server), methods=["GET"]),
            Route("/metrics", _metrics(server), methods=["GET"]),
        ],
        middleware=[Middleware(KeyRequired, keys=config.tenants(), requests=server.requests)]
        if config.tenants()
        else [],
    )
    app.state.server = server
    return app


Endpoint = Callable[[Request], Awaitable[Response]]


def _health(server: Server) -> Endpoint:
    async def health(request: Request) -> Response:
        pool = server.pool
        return JSONResponse(
            {
                "status": "ok",
                "model": server.model,
                "sessions": len(pool.slots),
                "busy": pool.busy,
                "waiting": pool.waiting,
            }
        )

    return health


def _models(server: Server) -> Endpoint:
    async def models(request: Request) -> Response:
        model = {"id": server.model, "object": "model", "created": 0, "owned_by": "kvrt"}
        return JSONResponse({"object": "list", "data": [model]})

    return models


def _metrics(server: Server) -> Endpoint:
    async def metrics(request: Request) -> Response:
        try:
            state = await (await server.state()).stats()
        except StateError:
            state = StateStats.unreadable()
        text = exposition(
            requests=server.requests,
            tokens=server.tokens,
            gone=server.gone,
            cold=server.runtime.cold_stats(),
            pool=server.pool,
            state=state,
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return metrics
