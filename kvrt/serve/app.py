"""The ASGI application: OpenAI-compatible routes over a runtime's session pool. The app
routes and authenticates; :class:`~kvrt.serve.server.Server` answers."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

import kvrt

from .auth import KeyRequired
from .config import ServeConfig, model_id
from .server import Server

__all__ = ["ServeConfig", "Server", "create_app", "model_id"]


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
        middleware=[Middleware(KeyRequired, keys=config.tenants(), requests=server.requests)]
        if config.tenants()
        else [],
    )
    app.state.server = server
    return app
