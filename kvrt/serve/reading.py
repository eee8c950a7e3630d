"""Reading a request: its body within the size limit, as a JSON object, its tenant, a list
endpoint's paging."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request

from .protocol.errors import MAX_BODY, RequestError
from .state.threads import off_loop

__all__ = ["listing", "read_body", "read_json", "tenant_of"]


async def read_body(request: Request) -> bytes:
    """The request body, refused (413) as soon as it is known to pass the limit: from its
    ``Content-Length`` before a byte is read, else while it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise RequestError("Content-Length is not a byte count")
        if int(declared) > MAX_BODY:
            raise RequestError(f"the body is larger than {MAX_BODY} bytes", status=413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY:
            raise RequestError(f"the body is larger than {MAX_BODY} bytes", status=413)
        parts.append(part)
    return b"".join(parts)


LARGE_BODY = 64 * 1024
"""Bytes past which a JSON body is decoded off the event loop."""


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object (an empty body: ``{}``), or a 400."""
    body = await read_body(request)
    if not body.strip():
        return {}
    try:
        if len(body) > LARGE_BODY:  # decoded in a worker thread: the loop serves others
            found = await off_loop(msgspec.json.decode, body)
        else:
            found = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raise RequestError("the body is not valid JSON") from None
    if not isinstance(found, dict):
        raise RequestError("the body must be a JSON object")
    return found


def tenant_of(request: Request) -> str | None:
    """The tenant of the request's API key, or None where the server takes no keys."""
    found = request.scope.get("state", {}).get("kvrt_tenant")
    return found if isinstance(found, str) else None


def listing(request: Request, *, default_order: str) -> tuple[int, str]:
    """A list endpoint's ``limit`` (1 to 100, default 20) and ``order``."""
    limit = request.query_params.get("limit", "20")
    if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= 100:
        raise RequestError("limit must be an integer from 1 to 100", param="limit")
    order = request.query_params.get("order", default_order)
    if order not in ("asc", "desc"):
        raise RequestError("order must be 'asc' or 'desc'", param="order")
    return int(limit), order
