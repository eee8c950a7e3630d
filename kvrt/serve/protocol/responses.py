"""The Responses API (``POST /v1/responses``): a request read into one typed kvrt call
(:func:`read`, then :func:`responses_call` with what it continues), answers built as
response objects and as the event stream the OpenAI Agents SDK consumes
(:class:`ResponseEvents`, fed the reply's pieces). Pure: no server, no event loop.

Input is a string or items: messages (``input_text``/``output_text`` parts),
``function_call`` and ``function_call_output``. ``instructions`` come first as a system
message; ``previous_response_id`` continues a kept response's conversation (the server keeps them
in its state store, :mod:`kvrt.serve.state`, bounded per tenant; ``store: false`` keeps
none), and the pool finds the session that holds its KV; ``conversation`` continues a kept conversation
(:mod:`kvrt.serve.protocol.conversations`). Function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``, ``json_schema``),
``max_output_tokens``, ``temperature``, ``top_p`` and ``top_logprobs`` are served; any other
field that asks for something kvrt does not do is a 400 naming it.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

import kvrt

from .call import Call, Limits, sampling_options, tool_options
from .chat import chat_logprob, check_cache_salt, check_schema_bytes, check_tool_turns, usage
from .errors import MAX_BODY, RequestError, refusal

__all__ = [
    "ResponseEvents",
    "ResponsesRequest",
    "input_items",
    "message_items",
    "object_id",
    "output_messages",
    "page",
    "response_body",
    "responses_call",
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


def _decode(body: bytes) -> ResponsesRequest:
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
    check_cache_salt(req.cache_salt)
    return req


def text_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format``, in the Responses API's own shape (kvrt reads it as a response
    format and names its errors ``text.format...``)."""
    if req.text is None:
        return None
    fmt = req.text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise RequestError(f"text.format type {kind!r} is not supported", param="text.format")
    return fmt


def function_tools(req: ResponsesRequest) -> list[Any] | None:
    """The request's tools, each a function tool (any other kind is refused)."""
    for i, tool in enumerate(req.tools or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(
                f"tools[{i}] of type {kind!r} is not supported: only function tools", param="tools"
            )
    return req.tools


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise RequestError(
            f"tool_choice of type {choice.get('type')!r} is not supported", param="tool_choice"
        )
    return choice


class _Sampling(msgspec.Struct, kw_only=True):
    """A Responses request's sampling fields under chat's names."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    logprobs: bool
    top_logprobs: int | None
    max_completion_tokens: None = None
    top_k: None = None
    seed: None = None
    stop: None = None


def responses_call(
    req: ResponsesRequest, before: Sequence[kvrt.Message], limits: Limits
) -> tuple[Call, list[kvrt.Message]]:
    """The ``session.chat`` call a request asks for, continuing ``before`` (a kept
    response's or a conversation's messages); with the messages the request itself adds
    (its input), which a kept response and a conversation keep."""
    given = to_messages(req.input)
    head = [kvrt.Message(role="system", content=req.instructions)] if req.instructions else []
    kept = [*before, *given]
    messages = tuple(head + kept)
    if not messages:
        raise RequestError("input is empty: give at least one item", param="input")
    check_tool_turns(kept, param="input")
    wanted = "message.output_text.logprobs" in (req.include or ())
    sampling = _Sampling(
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        logprobs=req.top_logprobs is not None or wanted,
        top_logprobs=req.top_logprobs,
    )
    options = sampling_options(sampling, limits)
    options.update(
        tool_options(
            function_tools(req),
            _tool_choice(req),
            req.parallel_tool_calls,
            text_format(req),
            limits,
            format_param="text.format",
        )
    )
    call = Call(
        method="chat",
        messages=messages,
        options=options,
        stream=req.stream,
        cache_salt=req.cache_salt,
    )
    return call, given


def read_request(body: bytes, limits: Limits) -> ResponsesRequest:
    """The request, checked as far as it can be before what it continues is read: its
    schemas' sizes, its fields, its model."""
    check_schema_bytes(body, limits.max_grammar_bytes, responses_api=True)
    req = _decode(body)
    limits.check_model(req.model)
    return req


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


def to_messages(items: str | list[Any], where: str = "input") -> list[kvrt.Message]:
    """Input items as the chat messages kvrt keeps of them, typed: consecutive function
    calls make one assistant message, a function call's output a tool message. An unknown
    key, a non-text part or a wrong type is a 400 naming where (``input[0].output``): what
    is kept is only what the conversation needs, never a client's extra bytes."""
    if isinstance(items, str):
        return [kvrt.Message(role="user", content=items)]
    out: list[dict[str, Any]] = []
    root = where
    for i, item in enumerate(items):
        where = f"{root}[{i}]"
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
        return kvrt.read_messages(out, param=root)
    except kvrt.KvrtError as exc:
        raise refusal(exc, default=root) from None


def output_messages(done: kvrt.Completion) -> list[kvrt.Message]:
    """The answer as chat messages, for the conversation a stored response continues."""
    if done.tool_calls:
        calls = tuple((c.id, c.name, c.arguments) for c in done.tool_calls)
        return [kvrt.Message(role="assistant", content="", tool_calls=calls)]
    return [kvrt.Message(role="assistant", content=done.text)]


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


def input_items(rid: str, inputs: Sequence[kvrt.Message]) -> list[dict[str, Any]]:
    """The items a kept response's request gave as ``inputs``, as the API lists them (ids
    derived from the response's: ``{rid}_in_{n}``)."""
    n = itertools.count()

    def id_of(_: str) -> str:
        return f"{rid}_in_{next(n)}"

    return [item for m in inputs for item in message_items(m, id_of)]


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


def object_id(prefix: str) -> str:
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
                "id": ids.get(c.id) or object_id("fc"),
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "completed",
            }
            for c in done.tool_calls
        ]
    return [_message_item(ids.get("message") or object_id("msg"), done.text, "completed", done)]


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


class ResponseEvents:
    """The event stream of one response, as the Agents SDK reads it, built from what the
    server feeds it (the shape of h11: no I/O here): :meth:`start` (created, in
    progress), :meth:`piece` for each piece of the reply (output items added, deltas),
    :meth:`finish` with the completion (each item done; the response object), then
    :meth:`completed` once what the response adds is kept, or :meth:`failed` when it
    could not be."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, created: float) -> None:
        self.rid, self.model, self.req, self.created = rid, model, req, created
        self._seq = 0
        self._ids: dict[str, str] = {}
        self._index: dict[str, int] = {}
        self._chosen: list[kvrt.TokenLogprob] = []

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        head = response_body(
            self.rid,
            self.model,
            self.req,
            created=self.created,
            status="in_progress",
            output=[],
            done=None,
        )
        return [
            self._event("response.created", response=head),
            self._event("response.in_progress", response=head),
        ]

    def _open_message(self, mid: str) -> list[dict[str, Any]]:
        self._ids["message"] = mid
        self._index["message"] = at = len(self._index)
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event(
                "response.output_item.added",
                output_index=at,
                item=_message_item(mid, "", "in_progress", None),
            ),
            self._event(
                "response.content_part.added",
                item_id=mid,
                output_index=at,
                content_index=0,
                part=part,
            ),
        ]

    def piece(self, piece: kvrt.Piece) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        ids, index = self._ids, self._index
        if piece.text:
            if "message" not in ids:
                out += self._open_message(object_id("msg"))
            logprobs = [chat_logprob(piece.logprob)] if piece.logprob is not None else []
            if piece.logprob is not None:
                self._chosen.append(piece.logprob)
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=ids["message"],
                    output_index=index["message"],
                    content_index=0,
                    delta=piece.text,
                    logprobs=logprobs,
                )
            )
        for delta in piece.tool_calls:
            key = f"call:{delta.index}"
            if delta.id is not None:
                ids[key] = object_id("fc")
                ids[delta.id] = ids[key]
                index[key] = len(index)
                item = {
                    "type": "function_call",
                    "id": ids[key],
                    "call_id": delta.id,
                    "name": delta.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                out.append(
                    self._event("response.output_item.added", output_index=index[key], item=item)
                )
            if delta.arguments:
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=ids[key],
                        output_index=index[key],
                        delta=delta.arguments,
                    )
                )
        return out

    def finish(self, done: kvrt.Completion) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Each output item done, and the response object (to keep, then to announce)."""
        out: list[dict[str, Any]] = []
        ids, index = self._ids, self._index
        output = output_items(done, ids)
        for item in output:
            if item["type"] == "message":
                if "message" not in ids:  # no text at all: announce the empty message now
                    out += self._open_message(item["id"])
                at = index["message"]
                part = item["content"][0]
                out.append(
                    self._event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=at,
                        content_index=0,
                        text=part["text"],
                        logprobs=_logprobs(done, self._chosen),
                    )
                )
                out.append(
                    self._event(
                        "response.content_part.done",
                        item_id=item["id"],
                        output_index=at,
                        content_index=0,
                        part=part,
                    )
                )
                out.append(self._event("response.output_item.done", output_index=at, item=item))
            else:
                found = [k for k, v in ids.items() if v == item["id"] and k.startswith("call:")]
                at = index[found[0]] if found else len(index)
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=at,
                        arguments=item["arguments"],
                    )
                )
                out.append(self._event("response.output_item.done", output_index=at, item=item))
        body = response_body(
            self.rid,
            self.model,
            self.req,
            created=self.created,
            status="completed",
            output=output,
            done=done,
        )
        return out, body

    def completed(self, body: dict[str, Any]) -> dict[str, Any]:
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=body)

    def failed(self, body: dict[str, Any], code: str, message: str) -> dict[str, Any]:
        """The stream's end when what the response adds could not be kept."""
        error = {"code": code, "message": message}
        return self._event("response.failed", response={**body, "status": "failed", "error": error})
