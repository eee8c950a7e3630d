"""The OpenAI wire format: requests read and checked, responses and stream chunks built.

Fields kvrt does not use are accepted and ignored (``user``, ``metadata``, ``store``, and
also ``tools``, ``tool_choice``, ``response_format``: the model's text comes back as the
message content, never as structured tool calls); ``n`` above 1, penalties, ``logprobs``
and ``echo`` are refused with a 400 naming them.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import msgspec

import kvrt

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "RequestError",
    "chat_response",
    "chunk",
    "completion_response",
    "error_body",
    "usage",
]


class RequestError(Exception):
    """A request kvrt refuses: the status and OpenAI-style error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind


def error_body(message: str, *, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
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


class ChatRequest(_Common, kw_only=True):
    messages: list[Any]
    max_completion_tokens: int | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str]
    echo: bool | None = None


MAX_BODY = 64 * 1024 * 1024
"""The largest request body read (64 MiB: far more than any context fits)."""


def read(body: bytes, kind: type[_Common]) -> Any:
    """The request, or a :class:`RequestError` naming what is wrong."""
    if len(body) > MAX_BODY:
        raise RequestError(f"the body is larger than {MAX_BODY} bytes", status=413)
    try:
        request = msgspec.json.decode(body, type=kind)
    except RecursionError:
        raise RequestError("the body's JSON is nested too deeply") from None
    except msgspec.ValidationError as exc:
        where = re.search(r"at `\$\.([^`]+)`|required field `([^`]+)`", str(exc))
        param = (where.group(1) or where.group(2)) if where else None
        raise RequestError(f"invalid request: {exc}", param=param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None
    for name, value, default in (
        ("n", request.n, 1),
        ("presence_penalty", request.presence_penalty, 0),
        ("frequency_penalty", request.frequency_penalty, 0),
        ("logprobs", request.logprobs, False),
    ):
        if value not in (None, default):
            raise RequestError(f"{name}={value!r} is not supported by kvrt", param=name)
    if isinstance(request, CompletionRequest) and request.echo:
        raise RequestError("echo is not supported by kvrt", param="echo")
    return request


def max_tokens(request: Any, *, default: int, limit: int) -> int:
    given = getattr(request, "max_completion_tokens", None)
    name = "max_completion_tokens"
    if given is None:
        given, name = request.max_tokens, "max_tokens"
    if given is None:
        return min(default, limit)
    if not 1 <= given <= limit:
        raise RequestError(
            f"{name} must be between 1 and {limit} (the session's planner context), got {given}",
            param=name,
        )
    return int(given)


def usage(done: kvrt.Completion) -> dict[str, Any]:
    """OpenAI's usage object, with kvrt's breakdown under ``kvrt``: where each prompt
    token's KV came from (``reused``, ``restored``, ``prefilled``, ``approximate`` and
    ``not_hot`` add up to ``prompt_tokens``), and the work done (``work``: a block
    computed, pushed out and brought back counts twice there)."""
    u, t, p = done.usage, done.timings, done.usage.prompt
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "kvrt": {
            "reused_tokens": p.reused,
            "restored_tokens": p.restored,
            "prefilled_tokens": p.prefilled,
            "approximate_tokens": p.approximate,
            "not_hot_tokens": p.not_hot,
            "work": {
                "reused_tokens": u.reused_tokens,
                "restored_tokens": u.restored_tokens,
                "prefilled_tokens": u.prefilled_tokens,
                "approximate_tokens": u.approximate_tokens,
            },
            "exact": done.context.exact,
            "visible_tokens": u.visible_tokens,
            "invisible_segments": list(done.invisible_segments),
            "finish_reason": done.finish_reason,
            "time_to_first_token": t.time_to_first_token,
            "decode_tokens_per_second": t.decode_tokens_per_second,
            "total_seconds": t.total_seconds,
        },
    }


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "closed": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_response(rid: str, model: str, done: kvrt.Completion) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": None,
                "finish_reason": FINISH[done.finish_reason],
            }
        ],
        "usage": usage(done),
    }


def completion_response(rid: str, model: str, done: kvrt.Completion) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": done.text,
                "logprobs": None,
                "finish_reason": FINISH[done.finish_reason],
            }
        ],
        "usage": usage(done),
    }


def chunk(
    rid: str,
    model: str,
    *,
    chat: bool,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    done: kvrt.Completion | None = None,
) -> bytes:
    """One server-sent event of a streamed response."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    if done is not None:
        body["choices"] = []
        body["usage"] = usage(done)
    elif chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        body["choices"] = [
            {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        ]
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
