"""The Responses API (``POST /v1/responses``): requests read into chat messages, answers
built as response objects and as the event stream the OpenAI Agents SDK consumes.

Input is a string or items: messages (``input_text``/``output_text`` parts),
``function_call`` and ``function_call_output``. ``instructions`` come first as a system
message; ``previous_response_id`` continues a kept response's conversation (the server keeps them
in its state store, :mod:`kvrt.serve.state`, bounded per tenant; ``store: false`` keeps
none), and the pool finds the session that holds its KV; ``conversation`` continues a kept conversation
(:mod:`kvrt.serve.conversations`). Function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``, ``json_schema``),
``max_output_tokens``, ``temperature``, ``top_p`` and ``top_logprobs`` are served; any other
field that asks for something kvrt does not do is a 400 naming it.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any, Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import kvrt

from .openai import MAX_BODY, RequestError, chat_logprob, check_salt, usage
from .reading import listing, tenant_of
from .state import KeptResponse, StateError, StateStore, refusal

__all__ = [
    "KeptRoutes",
    "ResponsesRequest",
    "events",
    "input_items",
    "kept_response",
    "message_items",
    "new_id",
    "not_kept",
    "page",
    "read",
    "response_body",
    "to_messages",
]


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    store: bool | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None


INCLUDES = ("message.output_text.logprobs",)
"""What ``include`` may ask for: each output text's token log-probabilities (with
``top_logprobs`` alternatives, 0 when not given)."""


def read(body: bytes) -> ResponsesRequest:
    """The request, or a :class:`RequestError` naming the field that is wrong or that asks
    for what kvrt does not do."""

    if len(body) > MAX_BODY:
        raise RequestError(f"the body is larger than {MAX_BODY} bytes", status=413)
    try:
        req = msgspec.json.decode(body, type=ResponsesRequest)
    except RecursionError:
        raise RequestError("the body's JSON is nested too deeply") from None
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = None
        if "unknown field" in message:
            param = message.split("`")[1] if "`" in message else None
            raise RequestError(f"{param} is not supported by kvrt", param=param) from None
        if " - at `$." in message:
            param = message.rsplit(" - at `$.", 1)[1].rstrip("`")
        raise RequestError(f"invalid request: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None
    if req.background:
        raise RequestError("background responses are not supported by kvrt", param="background")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise RequestError("reasoning is not supported by this model", param="reasoning")
    for name in req.include or ():
        if name not in INCLUDES:
            raise RequestError(
                f"include {name!r} is not supported by kvrt (it has: {', '.join(INCLUDES)})",
                param="include",
            )
    if req.truncation not in (None, "disabled", "auto"):
        raise RequestError("truncation must be 'disabled' or 'auto'", param="truncation")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise RequestError("top_logprobs must be from 0 to 20", param="top_logprobs")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise RequestError("max_output_tokens must be at least 1", param="max_output_tokens")
    check_salt(req.cache_salt)
    return req


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format``."""
    if req.text is None:
        return None
    fmt = req.text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")},
        }
    raise RequestError(f"text.format type {kind!r} is not supported", param="text.format")


def tools_of(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape; any other kind of tool is refused."""
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(
                f"tools[{i}] of type {kind!r} is not supported: only function tools", param="tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def tool_choice_of(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise RequestError(
            f"tool_choice of type {choice.get('type')!r} is not supported", param="tool_choice"
        )
    return choice


_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}
"""The keys each kind of input item may carry (what the API defines for it; the ``id`` and
``status`` of items a client sends back are read and dropped)."""
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _checked(item: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise RequestError(f"{where} must be an object", param=where)
    unknown = sorted(set(item) - keys)
    if unknown:
        raise RequestError(
            f"{where}.{unknown[0]} is not a field kvrt reads", param=f"{where}.{unknown[0]}"
        )
    return item


def _text(value: Any, where: str) -> str:
    """A string, or a list of text parts joined: what kvrt keeps of content."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{at} of type {kind!r} is not supported: only text parts", param=at)
        _checked(part, at, _PART_KEYS)
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{at}.text must be a string", param=f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def to_messages(items: str | list[Any]) -> list[kvrt.Message]:
    """Input items as the chat messages kvrt keeps of them, typed: consecutive function
    calls make one assistant message, a function call's output a tool message. An unknown
    key, a non-text part or a wrong type is a 400 naming where (``input[0].output``): what
    is kept is only what the conversation needs, never a client's extra bytes."""
    if isinstance(items, str):
        return [kvrt.Message(role="user", content=items)]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in _ITEM_KEYS:
            raise RequestError(f"{where} of type {kind!r} is not supported by kvrt", param=where)
        _checked(item, where, _ITEM_KEYS[kind])
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(
                    f"{where}.role {role!r} is not a message role", param=f"{where}.role"
                )
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise RequestError(
                    f"{where}.arguments must be a string", param=f"{where}.arguments"
                )
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
    if not out:
        return []
    try:
        return kvrt.read_messages(out)
    except kvrt.KvrtError as exc:
        raise RequestError(str(exc).replace("messages[", "input["), param="input") from None


def output_messages(done: kvrt.Completion) -> list[kvrt.Message]:
    """The answer as chat messages, for the conversation a stored response continues."""
    if done.tool_calls:
        calls = tuple((c.id, c.name, c.arguments) for c in done.tool_calls)
        return [kvrt.Message(role="assistant", content="", tool_calls=calls)]
    return [kvrt.Message(role="assistant", content=done.text)]


F = TypeVar("F", bound=Callable[..., Any])


def message_items(message: kvrt.Message, id_of: Callable[[str], str]) -> list[dict[str, Any]]:
    """A kept message as the items the API lists: its text (a message), then each of its
    calls (``function_call``); a tool message is a ``function_call_output``. ``id_of``
    gives each item's id from its kind's prefix (``msg``, ``fc``, ``fco``)."""
    if message.role == "tool":
        return [
            {
                "type": "function_call_output",
                "id": id_of("fco"),
                "call_id": message.tool_call_id,
                "output": message.content,
                "status": "completed",
            }
        ]
    found: list[dict[str, Any]] = []
    if message.content or not message.tool_calls:
        kind = "output_text" if message.role == "assistant" else "input_text"
        found.append(
            {
                "type": "message",
                "id": id_of("msg"),
                "role": message.role,
                "content": [{"type": kind, "text": message.content}],
                "status": "completed",
            }
        )
    for cid, name, arguments in message.tool_calls:
        found.append(
            {
                "type": "function_call",
                "id": id_of("fc"),
                "call_id": cid,
                "name": name,
                "arguments": arguments,
                "status": "completed",
            }
        )
    return found


def input_items(rid: str, stored: KeptResponse) -> list[dict[str, Any]]:
    """The items its request's ``input`` gave, as the API lists them (ids derived from the
    response's: ``{rid}_in_{n}``)."""
    start, end = stored.inputs
    n = itertools.count()

    def id_of(_: str) -> str:
        return f"{rid}_in_{next(n)}"

    return [item for m in stored.messages[start:end] for item in message_items(m, id_of)]


def page(
    items: list[dict[str, Any]], *, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """A list endpoint's page: ``limit`` items after ``after`` in ``order``."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise RequestError(f"after {after!r} is no item of this list", param="after")
        ordered = ordered[at + 1 :]
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _usage(done: kvrt.Completion) -> dict[str, Any]:
    """The Responses API's usage, with kvrt's breakdown under ``kvrt`` as chat has it."""
    u = done.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
        "kvrt": usage(done)["kvrt"],
    }


def _logprobs(done: kvrt.Completion | None, pieces: list[kvrt.TokenLogprob]) -> list[Any]:
    tokens = list(done.logprobs or ()) if done is not None else pieces
    return [chat_logprob(t) for t in tokens]


def output_items(done: kvrt.Completion, ids: dict[str, str]) -> list[dict[str, Any]]:
    """The response's output items (``ids``: the item ids already announced when
    streaming, by call id or ``message``)."""
    if done.tool_calls:
        return [
            {
                "type": "function_call",
                "id": ids.get(c.id) or new_id("fc"),
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "completed",
            }
            for c in done.tool_calls
        ]
    return [_message_item(ids.get("message") or new_id("msg"), done.text, "completed", done)]


def _message_item(mid: str, text: str, status: str, done: kvrt.Completion | None) -> dict[str, Any]:
    content = []
    if status == "completed":
        part = {"type": "output_text", "text": text, "annotations": []}
        if done is not None and done.logprobs is not None:
            part["logprobs"] = _logprobs(done, [])
        content.append(part)
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}


def response_body(
    rid: str,
    model: str,
    req: ResponsesRequest,
    *,
    created: float,
    status: str,
    output: list[dict[str, Any]],
    done: kvrt.Completion | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "instructions": req.instructions,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "conversation": {"id": req.conversation}
        if isinstance(req.conversation, str)
        else req.conversation,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": req.text or {"format": {"type": "text"}},
        "store": req.store is not False,
        "metadata": req.metadata or {},
        "truncation": req.truncation or "disabled",
        "error": None,
        "incomplete_details": None,
        "usage": _usage(done) if done is not None else None,
    }
    if done is not None and done.finish_reason in ("length", "closed"):
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


class Answer(Protocol):
    """A reply as the streams read it: its pieces, then (awaited) its completion."""

    def __aiter__(self) -> AsyncIterator[kvrt.Piece]: ...
    def __await__(self) -> Generator[Any, None, kvrt.Completion]: ...


async def events(
    reply: Answer,
    rid: str,
    model: str,
    req: ResponsesRequest,
    created: float,
    finished: Callable[[kvrt.Completion], None],
    answered: Callable[[kvrt.Completion, dict[str, Any]], Awaitable[None]] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """The event stream of one response, as the Agents SDK reads it: created, in
    progress, then per output item added / deltas / done, then completed (``answered`` is
    handed the completion and the final response object first, and keeps them: what it
    could not keep ends the stream with ``response.failed`` instead)."""
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    head = response_body(
        rid, model, req, created=created, status="in_progress", output=[], done=None
    )
    yield event("response.created", response=head)
    yield event("response.in_progress", response=head)
    ids: dict[str, str] = {}
    index: dict[str, int] = {}
    text = ""
    arguments: dict[str, str] = {}
    chosen: list[kvrt.TokenLogprob] = []
    async for piece in reply:
        if piece.text:
            if "message" not in ids:
                ids["message"] = new_id("msg")
                index["message"] = len(index)
                item = _message_item(ids["message"], "", "in_progress", None)
                yield event("response.output_item.added", output_index=index["message"], item=item)
                part = {"type": "output_text", "text": "", "annotations": []}
                yield event(
                    "response.content_part.added",
                    item_id=ids["message"],
                    output_index=index["message"],
                    content_index=0,
                    part=part,
                )
            text += piece.text
            logprobs = [chat_logprob(piece.logprob)] if piece.logprob is not None else []
            if piece.logprob is not None:
                chosen.append(piece.logprob)
            yield event(
                "response.output_text.delta",
                item_id=ids["message"],
                output_index=index["message"],
                content_index=0,
                delta=piece.text,
                logprobs=logprobs,
            )
        for delta in piece.tool_calls:
            key = f"call:{delta.index}"
            if delta.id is not None:
                ids[key] = new_id("fc")
                ids[delta.id] = ids[key]
                index[key] = len(index)
                arguments[key] = ""
                item = {
                    "type": "function_call",
                    "id": ids[key],
                    "call_id": delta.id,
                    "name": delta.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                yield event("response.output_item.added", output_index=index[key], item=item)
            if delta.arguments:
                arguments[key] += delta.arguments
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=ids[key],
                    output_index=index[key],
                    delta=delta.arguments,
                )
    done = await reply
    finished(done)
    output = output_items(done, ids)
    for item in output:
        if item["type"] == "message":
            if "message" not in ids:  # no text at all: announce the empty message now
                index["message"] = len(index)
                yield event(
                    "response.output_item.added",
                    output_index=index["message"],
                    item=_message_item(item["id"], "", "in_progress", None),
                )
                yield event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index["message"],
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            at = index["message"]
            part = item["content"][0]
            yield event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=at,
                content_index=0,
                text=part["text"],
                logprobs=_logprobs(done, chosen),
            )
            yield event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=at,
                content_index=0,
                part=part,
            )
            yield event("response.output_item.done", output_index=at, item=item)
        else:
            found = [k for k, v in ids.items() if v == item["id"] and k.startswith("call:")]
            at = index[found[0]] if found else len(index)
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=at,
                arguments=item["arguments"],
            )
            yield event("response.output_item.done", output_index=at, item=item)
    body = response_body(
        rid, model, req, created=created, status="completed", output=output, done=done
    )
    if answered is not None:
        try:
            await answered(done, body)
        except StateError as exc:
            error = {"code": f"state_{exc.kind}", "message": str(exc)}
            yield event("response.failed", response={**body, "status": "failed", "error": error})
            return
    yield event(
        "response.completed" if body["status"] == "completed" else "response.incomplete",
        response=body,
    )


class KeptRoutes:
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
                    raise not_kept(rid)
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
            listed = page(
                input_items(rid, found),
                limit=limit,
                order=order,
                after=query.get("after"),
            )
        except RequestError as exc:
            return self.error(exc)
        except StateError as exc:
            return self.error(refusal(exc))
        return JSONResponse(listed)


def not_kept(rid: str, param: str | None = None) -> RequestError:
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
    """The kept response ``rid``, or the 404 :func:`not_kept` says (a damaged one is a
    :class:`StateError`)."""
    found = await store.response(tenant, rid)
    if found is None:
        raise not_kept(rid, param)
    return found
