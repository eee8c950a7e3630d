"""The Conversations API's routes over the server's state store, and the lookups a
response makes of the conversation it continues. The translation is
:mod:`kvrt.serve.protocol.conversations`; the store :mod:`kvrt.serve.state`."""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..protocol import RequestError
from ..protocol.conversations import (
    ID,
    ConversationBody,
    DeletedBody,
    canonical_items,
    metadata,
    not_kept,
)
from ..protocol.wire import Item, listed, object_id, page
from ..reading import listing, read_json, tenant_of
from ..state import ConversationHead, StateStore
from ..state.threads import off_loop
from .exchange import StateRoutes

__all__ = ["Conversations", "items_in", "json_body", "json_response"]


async def head_of(
    store: StateStore, tenant: str | None, cid: str, param: str | None = None
) -> ConversationHead:
    found = await store.conversation(tenant, cid) if ID.fullmatch(cid) else None
    if found is None:
        raise not_kept(cid, param)
    return found


async def items_in(
    store: StateStore, tenant: str | None, cid: str, param: str | None = None
) -> list[Item]:
    """A kept conversation's items, or its 404."""
    found = await store.items(tenant, cid) if ID.fullmatch(cid) else None
    if found is None:
        raise not_kept(cid, param)
    return found


async def json_response(content: msgspec.Struct) -> Response:
    """``content`` as a JSON response, encoded in a worker thread (items may be large)."""
    encoded = await off_loop(msgspec.json.encode, content)
    return Response(encoded, media_type="application/json")


def json_body(body: msgspec.Struct) -> Response:
    """``body`` as a JSON response (small: encoded on the loop)."""
    return Response(msgspec.json.encode(body), media_type="application/json")


def _conversation(cid: str, head: ConversationHead) -> Response:
    return json_body(ConversationBody(id=cid, created_at=head.created_at, metadata=head.metadata))


class Conversations(StateRoutes):
    """The Conversations API's routes over the state store."""

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
            return _conversation(cid, head)

        return await self.answered(work)

    async def one(self, request: Request) -> Response:
        """``GET`` a conversation, ``POST`` its new ``metadata``, or ``DELETE`` it."""
        cid, tenant = request.path_params["cid"], tenant_of(request)

        async def work() -> Response:
            store = await self.state()
            if request.method == "DELETE":
                if not ID.fullmatch(cid) or not await store.delete_conversation(tenant, cid):
                    raise not_kept(cid)
                return json_body(DeletedBody(id=cid, object="conversation.deleted"))
            if request.method == "POST":
                sent = await read_json(request)
                meta = metadata(sent.get("metadata"))
                if not ID.fullmatch(cid) or not await store.set_metadata(tenant, cid, meta):
                    raise not_kept(cid)
            return _conversation(cid, await head_of(store, tenant, cid))

        return await self.answered(work)

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
                return await json_response(
                    page(added, limit=len(added) or 1, order="asc", after=None)
                )
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
            return await json_response(listed(*found))

        return await self.answered(work)

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
                return _conversation(cid, await head_of(store, tenant, cid))
            try:
                found = await store.item(tenant, cid, iid) if ID.fullmatch(cid) else None
            except KeyError:
                raise RequestError(
                    f"item {iid!r} is not in conversation {cid!r}", status=404
                ) from None
            if found is None:
                raise not_kept(cid)
            encoded = await off_loop(msgspec.json.encode, found)
            return Response(encoded, media_type="application/json")

        return await self.answered(work)
