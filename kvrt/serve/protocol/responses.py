"""The Responses API (``POST /v1/responses``): a request read into one typed kvrt call
(:func:`read_request`, then :func:`responses_call` with what it continues), and the
response object (:func:`response_body`) its answer is. Its event stream is
:mod:`kvrt.serve.protocol.response_events`. Pure: no server, no event loop.

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

from collections.abc import Sequence

import msgspec
from msgspec import UNSET, UnsetType

import kvrt

from .call import Limits, Turn, chat_call, check_tool_turns, sampled
from .errors import RequestError
from .items import to_messages
from .wire import (
    KvrtUsage,
    LogprobBody,
    check_cache_salt,
    check_schema_bytes,
    decode_request,
    kvrt_usage,
    logprob_body,
    object_id,
)

__all__ = [
    "FunctionCallItem",
    "MessageItem",
    "OutputItem",
    "OutputText",
    "ResponseBody",
    "ResponsesRequest",
    "output_items",
    "output_messages",
    "read_request",
    "response_body",
    "responses_call",
]


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[object]
    instructions: str | None = None
    tools: list[object] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, object] | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, object] | None = None
    store: bool | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, object] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, object] | None = None
    background: bool | None = None

    @property
    def conversation_id(self) -> str | None:
        """The conversation it continues (``conversation``: an id, or ``{"id": ...}``)."""
        value: object = self.conversation
        if value is None:
            return None
        if isinstance(value, dict) and set(value) == {"id"}:
            value = value["id"]
        if not isinstance(value, str) or not value:
            raise RequestError(
                'conversation must be a conversation id or {"id": ...}', param="conversation"
            )
        return value


INCLUDES = ("message.output_text.logprobs",)
"""What ``include`` may ask for: each output text's token log-probabilities (with
``top_logprobs`` alternatives, 0 when not given)."""


def read_request(body: bytes, limits: Limits) -> ResponsesRequest:
    """The request, checked as far as it can be before what it continues is read: its
    schemas' sizes, its fields, its model; or a :class:`RequestError` naming the field
    that is wrong or that asks for what kvrt does not do."""
    check_schema_bytes(body, limits.max_grammar_bytes, format_param="text.format")
    req = decode_request(body, ResponsesRequest)
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
    if req.conversation_id is not None and req.previous_response_id:
        raise RequestError(
            "give conversation or previous_response_id, not both", param="conversation"
        )
    check_cache_salt(req.cache_salt)
    limits.check_model(req.model)
    return req


def text_format(req: ResponsesRequest) -> dict[str, object] | None:
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


def function_tools(req: ResponsesRequest) -> list[dict[str, object]] | None:
    """The request's tools, each a function tool (any other kind is refused)."""
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(
                f"tools[{i}] of type {kind!r} is not supported: only function tools", param="tools"
            )
        tools.append(tool)
    return tools


def _tool_choice(req: ResponsesRequest) -> str | dict[str, object] | None:
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise RequestError(
            f"tool_choice of type {choice.get('type')!r} is not supported", param="tool_choice"
        )
    return choice


def responses_call(
    req: ResponsesRequest, before: Sequence[kvrt.Message], limits: Limits
) -> tuple[Turn, list[kvrt.Message]]:
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
    logprobs = None
    if req.top_logprobs is not None or wanted:
        logprobs = req.top_logprobs or 0
    sampling = sampled(
        limits,
        max_tokens=req.max_output_tokens,
        max_tokens_param="max_output_tokens",
        temperature=req.temperature,
        top_p=req.top_p,
        logprobs=logprobs,
    )
    call = chat_call(
        messages,
        sampling,
        limits,
        tools=function_tools(req),
        tool_choice=_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=text_format(req),
        format_param="text.format",
    )
    return Turn(call=call, stream=req.stream, cache_salt=req.cache_salt), given


def output_messages(done: kvrt.Completion) -> list[kvrt.Message]:
    """The answer as chat messages, for the conversation a stored response continues."""
    if done.tool_calls:
        calls = tuple((c.id, c.name, c.arguments) for c in done.tool_calls)
        return [kvrt.Message(role="assistant", content="", tool_calls=calls)]
    return [kvrt.Message(role="assistant", content=done.text)]


class OutputText(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="output_text"):
    """A message's text part."""

    text: str
    annotations: list[str] = msgspec.field(default_factory=list)
    logprobs: list[LogprobBody] | UnsetType = UNSET


class MessageItem(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="message"):
    """An output message."""

    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText]


class FunctionCallItem(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="function_call"
):
    """A call of one of the request's tools."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = MessageItem | FunctionCallItem


def output_items(done: kvrt.Completion, ids: dict[str, str]) -> list[OutputItem]:
    """The response's output items (``ids``: the item ids already announced when
    streaming, by call id or ``message``)."""
    if done.tool_calls:
        return [
            FunctionCallItem(
                id=ids.get(c.id) or object_id("fc"),
                call_id=c.id,
                name=c.name,
                arguments=c.arguments,
                status="completed",
            )
            for c in done.tool_calls
        ]
    return [message_item(ids.get("message") or object_id("msg"), done)]


def message_item(mid: str, done: kvrt.Completion | None) -> MessageItem:
    """The output message ``mid``: in progress and empty, or ``done``'s text."""
    if done is None:
        return MessageItem(id=mid, status="in_progress", content=[])
    part = OutputText(text=done.text)
    if done.logprobs is not None:
        part = OutputText(text=done.text, logprobs=[logprob_body(t) for t in done.logprobs])
    return MessageItem(id=mid, status="completed", content=[part])


class ResponseUsage(msgspec.Struct, frozen=True, kw_only=True):
    """The Responses API's usage, with kvrt's breakdown under ``kvrt`` as chat has it."""

    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int
    kvrt: KvrtUsage


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """Why a response failed."""

    code: str
    message: str


class ResponseBody(msgspec.Struct, frozen=True, kw_only=True):
    """A response object."""

    id: str
    created_at: float
    status: str
    model: str
    output: list[OutputItem]
    instructions: str | None
    tools: list[object]
    tool_choice: str | dict[str, object]
    parallel_tool_calls: bool
    previous_response_id: str | None
    conversation: dict[str, str] | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    text: dict[str, object]
    store: bool
    metadata: dict[str, str]
    truncation: str
    error: Problem | None = None
    incomplete_details: dict[str, str] | None = None
    usage: ResponseUsage | None = None
    object: str = "response"


def response_body(
    rid: str,
    model: str,
    req: ResponsesRequest,
    *,
    created: float,
    output: list[OutputItem],
    done: kvrt.Completion | None,
) -> ResponseBody:
    """The response object: in progress (no ``done`` yet), completed, or incomplete
    (it ran out of tokens)."""
    cid = req.conversation_id
    status, incomplete, used = "in_progress", None, None
    if done is not None:
        u = done.usage
        used = ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details={"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            output_tokens=u.completion_tokens,
            output_tokens_details={"reasoning_tokens": 0},
            total_tokens=u.total_tokens,
            kvrt=kvrt_usage(done),
        )
        status = "completed"
        if done.finish_reason in ("length", "closed"):
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return ResponseBody(
        id=rid,
        created_at=created,
        status=status,
        model=model,
        output=output,
        instructions=req.instructions,
        tools=req.tools or [],
        tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        conversation=None if cid is None else {"id": cid},
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        text=req.text or {"format": {"type": "text"}},
        store=req.store is not False,
        metadata=req.metadata or {},
        truncation=req.truncation or "disabled",
        incomplete_details=incomplete,
        usage=used,
    )
