"""The Responses surface: a request read with what it continues (a kept response, or a
conversation, from the state store), answered with a response object or its events, and
what it adds kept, whole or not at all; and the routes that read kept responses back."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

import kvrt

from ..protocol import RequestError, Turn
from ..protocol import conversations as conversation_api
from ..protocol.items import input_items
from ..protocol.response_events import ResponseEvents
from ..protocol.responses import (
    ResponseBody,
    ResponsesRequest,
    output_items,
    output_messages,
    read_request,
    response_body,
    responses_call,
)
from ..protocol.wire import object_id, page
from ..reading import listing, tenant_of
from ..state import KeptResponse, StateError, StateStore, refusal
from ..streaming import Started
from .conversations import items_in, json_body
from .exchange import Desk, StateRoutes

__all__ = ["KeptResponses", "Responses", "kept_response"]


class Responses:
    """``POST /v1/responses``."""

    name = "responses"

    async def open(self, body: bytes, tenant: str | None, desk: Desk) -> ResponseExchange:
        created = time.time()
        req = await desk.off_loop(read_request, body, desk.limits)
        cid = req.conversation_id
        before: list[kvrt.Message] = []
        try:
            state = await desk.state()
            if cid is not None:
                items = await items_in(state, tenant, cid, "conversation")
                before = await desk.off_loop(conversation_api.messages, items)
            elif req.previous_response_id:
                rid = req.previous_response_id
                found = await kept_response(state, tenant, rid, "previous_response_id")
                before = list(found.messages)
        except StateError as exc:  # the store cannot be opened, or what it holds is damaged
            continued = "previous_response_id" if req.previous_response_id else None
            raise refusal(exc, "conversation" if cid else continued) from None
        turn, given = await desk.off_loop(responses_call, req, before, desk.limits)
        return ResponseExchange(req, turn, before, given, state, tenant, desk.limits.model, created)


class ResponseExchange:
    """One Responses request: what it continues (``before``) and adds (``given``)."""

    error_event = "error"

    def __init__(
        self,
        req: ResponsesRequest,
        turn: Turn,
        before: list[kvrt.Message],
        given: list[kvrt.Message],
        state: StateStore,
        tenant: str | None,
        model: str,
        created: float,
    ) -> None:
        self.req, self.turn, self.before, self.given = req, turn, before, given
        self.state, self.tenant = state, tenant
        self.rid, self.model, self.created = object_id("resp"), model, created

    async def reply(self, done: kvrt.Completion) -> ResponseBody:
        output = output_items(done, {})
        body = response_body(
            self.rid, self.model, self.req, created=self.created, output=output, done=done
        )
        try:
            await self._keep(done, body)
        except StateError as exc:
            raise refusal(exc) from None
        return body

    async def events(self, answer: Started) -> AsyncIterator[msgspec.Struct]:
        events = ResponseEvents(self.rid, self.model, self.req, self.created)
        for event in events.start():
            yield event
        async for piece in answer:
            for event in events.piece(piece):
                yield event
        done = await answer
        ended, body = events.finish(done)
        for event in ended:
            yield event
        try:
            await self._keep(done, body)
        except StateError as exc:
            yield events.failed(body, f"state_{exc.kind}", str(exc))
            return
        except RequestError as exc:  # its conversation was deleted meanwhile
            yield events.failed(body, exc.code or "not_kept", str(exc))
            return
        yield events.completed(body)

    async def _keep(self, done: kvrt.Completion, body: ResponseBody) -> None:
        """Keep what the response added, whole or not at all: a :class:`StateError`
        when it cannot be kept, the conversation's 404 when it went meanwhile."""
        cid = self.req.conversation_id
        added = []
        if cid is not None:
            added = [i for m in self.given for i in conversation_api.items_of(m)]
            added += conversation_api.conversation_items(body.output)
        response = None
        if self.req.store is not False:
            messages = (*self.before, *self.given, *output_messages(done))
            span = (len(self.before), len(self.before) + len(self.given))
            kept = KeptResponse(messages, span, msgspec.json.encode(body))
            response = (self.rid, kept)
        if cid is None and response is None:
            return
        if not await self.state.keep_turn(self.tenant, response, cid, added):
            raise conversation_api.not_kept(cid or "", "conversation")


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
    """The kept response ``rid``, or the 404 :func:`response_not_kept` says (a damaged one
    is a :class:`StateError`)."""
    found = await store.response(tenant, rid)
    if found is None:
        raise response_not_kept(rid, param)
    return found


class KeptResponses(StateRoutes):
    """Kept responses read back, listed and deleted."""

    async def one(self, request: Request) -> Response:
        """``GET`` a kept response as it was answered, or ``DELETE`` it."""
        rid, tenant = request.path_params["rid"], tenant_of(request)

        async def work() -> Response:
            store = await self.state()
            if request.method == "DELETE":
                if not await store.forget_response(tenant, rid):
                    raise response_not_kept(rid)
                return json_body(conversation_api.DeletedBody(id=rid, object="response"))
            found = await kept_response(store, tenant, rid)
            return Response(found.body, media_type="application/json")

        return await self.answered(work)

    async def inputs(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items``: the items its request's input gave
        (``limit`` 1 to 100, default 20; ``order`` ``desc`` (default) or ``asc``;
        ``after`` an item id)."""
        rid = request.path_params["rid"]

        async def work() -> Response:
            store = await self.state()
            limit, order = listing(request, default_order="desc")
            found = await kept_response(store, tenant_of(request), rid)
            start, end = found.inputs
            listed = page(
                input_items(rid, found.messages[start:end]),
                limit=limit,
                order=order,
                after=request.query_params.get("after"),
            )
            return json_body(listed)

        return await self.answered(work)
