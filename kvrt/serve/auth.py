"""API keys: each request names its tenant by its key, compared in constant time."""

from __future__ import annotations

import hmac
from collections import Counter

import msgspec
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .protocol import RequestError, error_body

__all__ = ["KeyRequired"]


class KeyRequired:
    """Refuses (401, OpenAI-style) a request without ``Authorization: Bearer <key>`` of
    a known key, but for ``/health``, and one with two such headers (a proxy and a client
    disagreeing must not pick the tenant); every key is compared in constant time. The
    request carries its key's tenant on (``request.state.kvrt_tenant``)."""

    def __init__(
        self, app: ASGIApp, *, keys: dict[str, str], requests: Counter[tuple[str, int]]
    ) -> None:
        self.app = app
        self.keys = [(key.encode(), tenant) for key, tenant in keys.items()]
        self.requests = requests
        """The server's request counts (refusals count as route ``auth``)."""

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
        self.requests[("auth", status)] += 1
        body = msgspec.json.encode(error_body(RequestError(message, status=status, code=code)))
        await Response(body, status, media_type="application/json")(scope, receive, send)
