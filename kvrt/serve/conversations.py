"""The Conversations API (``/v1/conversations`` and its items) and the Responses API's
``conversation`` field: a conversation is a list of items the server keeps for its tenant,
and a response created in one reads them before its own input, then adds its input and
output to them. The KV of what a conversation holds is where every prompt's KV is: in a
session of the pool, else in the cold tiers (RAM, disk, Redis), so a conversation picked
up again computes only what is new to it.

Items are kept typed and in one canonical form (messages with text parts,
``function_call``, ``function_call_output``), each with an id; metadata as OpenAI bounds
it (16 keys of at most 64 characters, values of at most 512). They live in the server's
state store (:mod:`kvrt.serve.state`: SQLite, or the replicas' shared server), bounded
per tenant, read and written off the event loop.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import kvrt

from .openai import RequestError
from .reading import listing, read_json, tenant_of
from .responses import message_items, new_id, page, to_messages
from .state import ConversationHead, StateError, StateStore, refusal

ID = re.compile(r"conv_[0-9a-f]{32}")
"""What a conversation id looks like (anything else is a 404 before any file is
touched)."""

__all__ = [
    "Routes",
    "add",
    "body",
    "canonical_items",
    "conversation_id",
    "head_of",
    "items_in",
    "items_of",
    "messages",
    "metadata",
    "not_kept",
    "output_items",
]


def metadata(value: Any, where: str = "metadata") -> dict[str, str]:
    """Metadata as OpenAI bounds it, or a 400 naming what is wrong."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 16:
        raise RequestError(f"{where} must be an object of at most 16 keys", param=where)
    for key, text in value.items():
        if not isinstance(text, str) or len(key) > 64 or len(text) > 512:
            raise RequestError(
                f"{where} keys are at most 64 characters and values strings of at most 512",
                param=where,
            )
    return dict(value)


def canonical_items(items: Any, where: str = "items") -> list[dict[str, Any]]:
    """Input items (as the Responses API takes them) checked and written in the one form
    a conversation keeps, each with a fresh id."""
    if not isinstance(items, list):
        raise RequestError(f"{where} must be a list of items", param=where)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        try:
            read = to_messages([item])
        except RequestError as exc:
            raise RequestError(
                str(exc).replace("input[0]", at), param=(exc.param or "").replace("input[0]", at)
            ) from None
        for message in read:
            out.extend(items_of(message))
    return out


def items_of(message: kvrt.Message) -> list[dict[str, Any]]:
    """A kept message as conversation items, with fresh ids."""
    return message_items(message, new_id)


def output_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as a conversation keeps them (their ids kept)."""
    found: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item.get("content", ()))
            found.append(
                {
                    "type": "message",
                    "id": item["id"],
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                    "status": "completed",
                }
            )
        elif item["type"] == "function_call":
            keys = ("type", "id", "call_id", "name", "arguments", "status")
            found.append({k: item[k] for k in keys})
    return found


def as_input(item: dict[str, Any]) -> dict[str, Any]:
    """A kept item as a request's input item (what ``to_messages`` reads)."""
    return {k: v for k, v in item.items() if k not in ("id", "status")}


def conversation_id(value: Any) -> str | None:
    """The Responses API's ``conversation``: an id, or ``{"id": ...}``."""
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if not isinstance(value, str) or not value:
        raise RequestError(
            'conversation must be a conversation id or {"id": ...}', param="conversation"
        )
    return value


def body(cid: str, head: ConversationHead) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "conversation",
        "created_at": head.created_at,
        "metadata": head.metadata,
    }


def not_kept(cid: str, param: str | None = None) -> RequestError:
    """The 404 of a conversation that is not kept (unknown, deleted, expired, another
    tenant's)."""
    return RequestError(
        f"conversation {cid!r} is not kept (unknown, deleted, or expired)",
        status=404,
        param=param,
        code="conversation_not_found",
    )


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


async def add(store: StateStore, tenant: str | None, cid: str, items: list[dict[str, Any]]) -> None:
    """Add ``items`` to a kept conversation, or its 404 (a :class:`StateError` when they
    cannot be kept)."""
    if not ID.fullmatch(cid) or not await store.add_items(tenant, cid, items):
        raise not_kept(cid, "conversation")


def messages(items: list[dict[str, Any]]) -> list[kvrt.Message]:
    """What a conversation holds, as the messages a response's context begins with (in
    a worker thread: a conversation may be large)."""
    return to_messages([as_input(item) for item in items]) if items else []


async def json_response(content: Any) -> Response:
    """``content`` as a JSON response, encoded in a worker thread (items may be large)."""
    encoded = await anyio.to_thread.run_sync(msgspec.json.encode, content)
    return Response(encoded, media_type="application/json")


class Routes:
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
            items = await anyio.to_thread.run_sync(canonical_items, sent.get("items") or [])
            head = ConversationHead(int(time.time()), metadata(sent.get("metadata")))
            cid = new_id("conv")
            await store.create_conversation(tenant_of(request), cid, head, items)
            return JSONResponse(body(cid, head))

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
            return JSONResponse(body(cid, await head_of(store, tenant, cid)))

        return await self._answer(work)

    async def items(self, request: Request) -> Response:
        """``GET`` a conversation's items (``limit``, ``order`` asc by default, ``after``),
        or ``POST`` more (``items``)."""
        cid, tenant = request.path_params["cid"], tenant_of(request)

        async def work() -> Response:
            store = await self.state()
            if request.method == "POST":
                sent = await read_json(request)
                added = await anyio.to_thread.run_sync(canonical_items, sent.get("items"))
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
                return JSONResponse(body(cid, await head_of(store, tenant, cid)))
            kept = await items_in(store, tenant, cid)
            found = next((i for i in kept if i["id"] == iid), None)
            if found is None:
                raise RequestError(f"item {iid!r} is not in conversation {cid!r}", status=404)
            return await json_response(found)

        return await self._answer(work)
