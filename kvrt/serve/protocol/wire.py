"""What the API surfaces share on the wire: a body decoded into its request Struct, the
bounds every request is held to before it is read (its size, its schemas', its salt),
ids, the usage and log-probability objects, list pages, and an event as server-sent
event bytes."""

from __future__ import annotations

import re
import secrets
import uuid
from typing import Any, TypeVar

import msgspec

import kvrt

from .errors import MAX_BODY, RequestError

__all__ = [
    "FINISH",
    "STREAM_END",
    "CommonRequest",
    "Item",
    "KvrtUsage",
    "LogprobBody",
    "Page",
    "UsageBody",
    "check_cache_salt",
    "check_schema_bytes",
    "completion_id",
    "decode_request",
    "kvrt_usage",
    "logprob_body",
    "object_id",
    "page",
    "sse",
    "usage_body",
]

R = TypeVar("R", bound=msgspec.Struct)

Item = dict[str, Any]
"""A Responses or Conversations item as the client sent it or the server keeps it: a
message, a function call or a function call's output, with its ``id``."""


def decode_request(body: bytes, kind: type[R]) -> R:
    """The request, or a :class:`RequestError` naming what is wrong: a field kvrt does
    not read (where ``kind`` forbids unknown fields) is "not supported"."""
    if len(body) > MAX_BODY:
        raise RequestError(f"the body is larger than {MAX_BODY} bytes", status=413)
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:
        raise RequestError("the body's JSON is nested too deeply") from None
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.startswith("Object contains unknown field"):
            param = message.split("`")[1] if "`" in message else None
            raise RequestError(f"{param} is not supported by kvrt", param=param) from None
        where = re.search(r"at `\$\.([^`]+)`|required field `([^`]+)`", message)
        param = (where.group(1) or where.group(2)) if where else None
        raise RequestError(f"invalid request: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None


MAX_SALT = 256
"""The longest ``cache_salt`` a request may give (characters)."""


def check_cache_salt(salt: str | None) -> None:
    """A 400 naming ``cache_salt`` unless it is 1 to :data:`MAX_SALT` printable
    characters (an unbounded salt is an unbounded key in every tier)."""
    if salt is None:
        return
    if not salt or len(salt) > MAX_SALT or not salt.isprintable():
        raise RequestError(
            f"cache_salt must be 1 to {MAX_SALT} printable characters", param="cache_salt"
        )


class _Schemas(msgspec.Struct):
    """The parts of a body that carry JSON Schemas, as sent: read without being built."""

    response_format: msgspec.Raw = msgspec.Raw(b"null")
    text: msgspec.Raw = msgspec.Raw(b"null")
    """The Responses API's (its ``format``)."""
    tools: msgspec.Raw = msgspec.Raw(b"null")


def check_schema_bytes(body: bytes, limit: int, *, format_param: str) -> None:
    """Refuse a body whose response format (``format_param``: ``response_format``, or the
    Responses API's ``text.format``) or a tool of which is, as sent, more than twice
    ``limit`` bytes (the schema limit, measured exactly once the body is read, allowing
    for whitespace), before the body is decoded: building a huge schema's objects (and
    freeing them) is what a flood of such requests would cost the server."""
    try:
        parts = msgspec.json.decode(body, type=_Schemas)
    except (msgspec.DecodeError, RecursionError):
        return  # what is wrong with it, the request's reader says
    bound = 2 * limit
    fmt = parts.response_format if format_param == "response_format" else parts.text
    if len(fmt) > bound:
        raise RequestError(
            f"{format_param} is {len(fmt):,} bytes as sent; this server compiles schemas of "
            f"at most {limit:,} bytes (max_grammar_bytes)",
            param=format_param,
        )
    if len(parts.tools) <= bound:
        return
    try:
        tools = msgspec.json.decode(parts.tools, type=list[msgspec.Raw])
    except msgspec.ValidationError:
        return
    for i, tool in enumerate(tools):
        if len(tool) > bound:
            raise RequestError(
                f"tools[{i}] is {len(tool):,} bytes as sent; this server compiles schemas of "
                f"at most {limit:,} bytes (max_grammar_bytes)",
                param=f"tools[{i}]",
            )


def completion_id(prefix: str) -> str:
    """A Chat Completions or Completions id: ``chatcmpl-...``, ``cmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def object_id(prefix: str) -> str:
    """A Responses or Conversations object's id: ``resp_...``, ``msg_...``, ``conv_...``."""
    return f"{prefix}_{secrets.token_hex(16)}"


FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "closed": "length",
    "tool_calls": "tool_calls",
}
"""kvrt's finish reasons as the Chat Completions and Completions APIs name them."""


class Alternative(msgspec.Struct, frozen=True, kw_only=True):
    """One of the likeliest tokens at a place."""

    token: str
    logprob: float
    bytes: list[int]


class LogprobBody(msgspec.Struct, frozen=True, kw_only=True):
    """A generated token's log-probability, with the likeliest alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Alternative]


def logprob_body(t: kvrt.TokenLogprob) -> LogprobBody:
    return LogprobBody(
        token=t.text,
        logprob=t.logprob,
        bytes=list(t.raw),
        top_logprobs=[
            Alternative(token=a.text, logprob=a.logprob, bytes=list(a.raw)) for a in t.top
        ],
    )


class Work(msgspec.Struct, frozen=True, kw_only=True):
    """The work the call did, by where KV came from (a block computed, pushed out and
    brought back counts twice)."""

    reused_tokens: int
    restored_tokens: int
    prefilled_tokens: int
    approximate_tokens: int


class KvrtUsage(msgspec.Struct, frozen=True, kw_only=True):
    """kvrt's breakdown of a usage object: where each prompt token's KV came from
    (``reused``, ``restored``, ``prefilled``, ``approximate`` and ``not_hot`` add up to
    the prompt's tokens), the work done, exactness and timings."""

    reused_tokens: int
    restored_tokens: int
    prefilled_tokens: int
    approximate_tokens: int
    not_hot_tokens: int
    work: Work
    exact: bool
    visible_tokens: int
    invisible_segments: list[str]
    finish_reason: str
    time_to_first_token: float | None
    decode_tokens_per_second: float | None
    total_seconds: float


def kvrt_usage(done: kvrt.Completion) -> KvrtUsage:
    u, t, p = done.usage, done.timings, done.usage.prompt
    return KvrtUsage(
        reused_tokens=p.reused,
        restored_tokens=p.restored,
        prefilled_tokens=p.prefilled,
        approximate_tokens=p.approximate,
        not_hot_tokens=p.not_hot,
        work=Work(
            reused_tokens=u.reused_tokens,
            restored_tokens=u.restored_tokens,
            prefilled_tokens=u.prefilled_tokens,
            approximate_tokens=u.approximate_tokens,
        ),
        exact=done.context.exact,
        visible_tokens=u.visible_tokens,
        invisible_segments=list(done.invisible_segments),
        finish_reason=done.finish_reason,
        time_to_first_token=t.time_to_first_token,
        decode_tokens_per_second=t.decode_tokens_per_second,
        total_seconds=t.total_seconds,
    )


class Page(msgspec.Struct, frozen=True, kw_only=True):
    """A list endpoint's page."""

    object: str = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


def page(items: list[Item], *, limit: int, order: str, after: str | None) -> Page:
    """``limit`` items after ``after`` in ``order`` (``asc`` or ``desc``)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise RequestError(f"after {after!r} is no item of this list", param="after")
        ordered = ordered[at + 1 :]
    data = ordered[:limit]
    return listed(data, len(ordered) > limit)


def listed(data: list[Item], more: bool) -> Page:
    """``data`` as a page, ``more`` after it."""
    return Page(
        data=data,
        first_id=data[0]["id"] if data else None,
        last_id=data[-1]["id"] if data else None,
        has_more=more,
    )


class StreamEnd(msgspec.Struct, frozen=True):
    """The end of a Chat Completions or Completions stream (``data: [DONE]``)."""


STREAM_END = StreamEnd()

_encoder = msgspec.json.Encoder()


def sse(event: msgspec.Struct, name: str | None = None) -> bytes:
    """``event`` as server-sent event bytes: named ``name``, else by its tag (the Responses
    API's ``type``), else unnamed."""
    if isinstance(event, StreamEnd):
        return b"data: [DONE]\n\n"
    tag = type(event).__struct_config__.tag
    name = name or (tag if isinstance(tag, str) else None)
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + _encoder.encode(event) + b"\n\n"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class CommonRequest(msgspec.Struct, kw_only=True):
    """The fields Chat Completions and Completions requests share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None
    """vLLM's field: requests reuse cached KV only with requests of the same salt (and
    the same API key's tenant)."""

    def check(self) -> None:
        """A 400 naming what kvrt does not do (``n`` above 1, penalties), or a bad salt."""
        for name, value, default in (
            ("n", self.n, 1),
            ("presence_penalty", self.presence_penalty, 0),
            ("frequency_penalty", self.frequency_penalty, 0),
        ):
            if value not in (None, default):
                raise RequestError(f"{name}={value!r} is not supported by kvrt", param=name)
        check_cache_salt(self.cache_salt)

    @property
    def include_usage(self) -> bool:
        """A stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class UsageBody(msgspec.Struct, frozen=True, kw_only=True):
    """The Chat Completions and Completions usage object, with kvrt's breakdown."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    kvrt: KvrtUsage


def usage_body(done: kvrt.Completion) -> UsageBody:
    u = done.usage
    return UsageBody(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        prompt_tokens_details={"cached_tokens": u.cached_tokens},
        kvrt=kvrt_usage(done),
    )
