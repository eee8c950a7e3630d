"""The routes over the server's state store: kept responses read back, listed and
deleted, and the Conversations API; and the lookups a response makes of what it
continues. The translation is :mod:`kvrt.serve.protocol`; the store :mod:`kvrt.serve.state`."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .protocol import RequestError
from .protocol.conversations import ID, body, canonical_items, metadata, not_kept
from .protocol.responses import input_items, object_id, page
from .reading import listing, read_json, tenant_of
from .state import ConversationHead, KeptResponse, StateError, StateStore, refusal
from .state.threads import off_loop

__all__ = [
    "ConversationRoutes",
    "ResponseRoutes",
    "items_in",
    "kept_response",
    "response_not_kept",
]


class ResponseRoutes:
    """Kept responses read back, listed and deleted; ``error`` makes a refusal's response
    (the server's, which counts it)."""

    def __init__(
        self,
        store: Callable[[], Awaitable[StateStore]],
        error: Callable[[RequestError], Response],
    ) -> None:
        self.state, self.error = store, error

    async def one(self, request: Request) -> Response:
        """``GET`` a kept response as it was answered, or ``DELETE`` it."""
        rid, tenant = request.path_params["rid"], tenant_of(request)
        try:
            store = await self.state()
            if request.method == "DELETE":
                if not await store.forget_response(tenant, rid):
                    raise response_not_kept(rid)
                return JSONResponse({"id": rid, "object": "response", "deleted": True})
            found = await kept_response(store, tenant, rid)
        except RequestError as exc:
            return self.error(exc)
        except StateError as exc:
            return self.error(refusal(exc))
        return Response(found.body, media_type="application/json")

    async def inputs(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items``: the items its request's input gave
        (``limit`` 1 to 100, default 20; ``order`` ``desc`` (default) or ``asc``;
        ``after`` an item id)."""
        rid, query = request.path_params["rid"], request.query_params
        try:
            store = await self.state()
            limit, order = listing(request, default_order="desc")
            found = await kept_response(store, tenant_of(request), rid)
            start, end = found.inputs
            listed = page(
                input_items(rid, found.messages[start:end]),
                limit=limit,
                order=order,
                after=query.get("after"),
            )
        except RequestError as exc:
            return self.error(exc)
        except StateError as exc:
            return self.error(refusal(exc))
        return JSONResponse(listed)


def response_not_kept(rid: str, param: str | None = None) -> RequestError:
    """The 404 of a response that is not kept (unknown, expired, deleted, another
    tenant's, or stored with ``store: false``)."""
    if param == "previous_response_id":
        return RequestError(
            f"previous response {rid!r} is not kept (unknown, expired, or stored with "
            "store: false)",
            status=404,
            param=param,
            code="previous_response_not_found",
        )
    return RequestError(
        f"response {rid!r} is not kept (unknown, expired, deleted, or stored with store: false)",
        status=404,
        param=param,
        code="response_not_found",
    )


async def kept_response(
    store: StateStore, tenant: str | None, rid: str, param: str | None = None
) -> KeptResponse:
    """The kept response ``rid``, or the 404 :func:`response_not_kept` says (a damaged one is a
    :class:`StateError`)."""
    found = await store.response(tenant, rid)
    if found is None:
        raise response_not_kept(rid, param)
    return found


async def head_of(
    store: StateStore, tenant: str | None, cid: str, param: str | None = None
) -> ConversationHead:
    found = await store.conversation(tenant, cid) if ID.fullmatch(cid) else None
    if found is None:
        raise not_kept(cid, param)
    return found


async def items_in(
    store: StateStore, tenant: str | None, cid: str, param: str | None = None
) -> list[dict[str, Any]]:
    """A kept conversation's items, or its 404."""
    found = await store.items(tenant, cid) if ID.fullmatch(cid) else None
    if found is None:
        raise not_kept(cid, param)
    return found


async def json_response(content: Any) -> Response:
    """``content`` as a JSON response, encoded in a worker thread (items may be large)."""
    encoded = await off_loop(msgspec.json.encode, content)
    return Response(encoded, media_type="application/json")


class ConversationRoutes:
    """The Conversations API's routes over a state store; ``error`` makes a refusal's
    response (the server's, which counts it)."""

    def __init__(
        self,
        store: Callable[[], Awaitable[StateStore]],
        error: Callable[[RequestError], Response],
    ) -> None:
        self.state, self.error = store, error

    async def _answer(self, work: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await work()
        except RequestError as exc:
            return self.error(exc)
        except StateError as exc:
            return self.error(refusal(exc))

    async def create(self, request: Request) -> Response:
        """``POST /v1/conversations``: ``items`` (input items) and ``metadata``."""

        async def work() -> Response:
            store = await self.state()
            sent = await read_json(request)
            unknown = sorted(set(sent) - {"items", "metadata"})
            if unknown:
                raise RequestError(f"{unknown[0]} is not supported by kvrt", param=unknown[0])
            items = await off_loop(canonical_items, sent.get("items") or [])
            head = ConversationHead(int(time.time()), metadata(sent.get("metadata")))
            cid = object_id("conv")
            await store.create_conversation(tenant_of(request), cid, head, items)
            return JSONResponse(body(cid, head.created_at, head.metadata))

        return await self._answer(work)

    async def one(self, request: Request) -> Response:
        """``GET`` a conversation, ``POST`` its new ``metadata``, or ``DELETE`` it."""
        cid, tenant = request.path_params["cid"], tenant_of(request)

        async def work() -> Response:
            store = await self.state()
            if request.method == "DELETE":
                if not ID.fullmatch(cid) or not await store.delete_conversation(tenant, cid):
                    raise not_kept(cid)
                return JSONResponse({"id": cid, "object": "conversation.deleted", "deleted": True})
            if request.method == "POST":
                sent = await read_json(request)
                meta = metadata(sent.get("metadata"))
                if not ID.fullmatch(cid) or not await store.set_metadata(tenant, cid, meta):
                    raise not_kept(cid)
            head = await head_of(store, tenant, cid)
            return JSONResponse(body(cid, head.created_at, head.metadata))

        return await self._answer(work)

    async def items(self, request: Request) -> Response:
        """``GET`` a conversation's items (``limit``, ``order`` asc by default, ``after``),
        or ``POST`` more (``items``)."""
        cid, tenant = request.path_params["cid"], tenant_of(request)

        async def work() -> Response:
            store = await self.state()
            if request.method == "POST":
                sent = await read_json(request)
                added = await off_loop(canonical_items, sent.get("items"))
                if not ID.fullmatch(cid) or not await store.add_items(tenant, cid, added):
                    raise not_kept(cid)
                return JSONResponse(page(added, limit=len(added) or 1, order="asc", after=None))
            limit, order = listing(request, default_order="asc")
            after = request.query_params.get("after")
            try:
                found = (
                    await store.item_page(tenant, cid, limit=limit, order=order, after=after)
                    if ID.fullmatch(cid)
                    else None
                )
            except KeyError:
                raise RequestError(
                    f"after {after!r} is no item of this list", param="after"
                ) from None
            if found is None:
                raise not_kept(cid)
            data, more = found
            return await json_response(
                {
                    "object": "list",
                    "data": data,
                    "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None,
                    "has_more": more,
                }
            )

        return await self._answer(work)

    async def item(self, request: Request) -> Response:
        """``GET`` one item of a conversation, or ``DELETE`` it (answered with the
        conversation)."""
        cid, iid, tenant = (
            request.path_params["cid"],
            request.path_params["iid"],
            tenant_of(request),
        )

        async def work() -> Response:
            store = await self.state()
            if request.method == "DELETE":
                removed = await store.remove_item(tenant, cid, iid) if ID.fullmatch(cid) else None
                if removed is None:
                    raise not_kept(cid)
                if not removed:
                    raise RequestError(f"item {iid!r} is not in conversation {cid!r}", status=404)
                head = await head_of(store, tenant, cid)
                return JSONResponse(body(cid, head.created_at, head.metadata))
            try:
                found = await store.item(tenant, cid, iid) if ID.fullmatch(cid) else None
            except KeyError:
                raise RequestError(
                    f"item {iid!r} is not in conversation {cid!r}", status=404
                ) from None
            if found is None:
                raise not_kept(cid)
            return await json_response(found)

        return await self._answer(work)
