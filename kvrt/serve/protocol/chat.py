"""Chat Completions and Completions: a request body read into one typed kvrt call
(:func:`read_chat`, :func:`read_completion`), and the call's result written as the API's
response or stream chunks. Pure: no server, no event loop.

Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``), structured output
(``response_format``) and ``logprobs``/``top_logprobs`` are served as OpenAI documents
them. Fields kvrt does not use are accepted and ignored (``user``, ``metadata``,
``store``); ``n`` above 1, penalties and ``echo`` are refused with a 400 naming them.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

import kvrt

from .call import Call, Limits, sampling_options, tool_options
from .errors import MAX_BODY, RequestError
from .errors import refusal as refused

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "chat_response",
    "check_cache_salt",
    "check_schema_bytes",
    "check_tool_turns",
    "chunk",
    "completion_response",
    "legacy_functions",
    "legacy_messages",
    "read_chat",
    "read_completion",
    "usage",
]


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
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None
    """vLLM's field: requests reuse cached KV only with requests of the same salt (and
    the same API key's tenant)."""


class ChatRequest(_Common, kw_only=True):
    messages: list[Any]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None
    functions: list[Any] | None = None
    """The legacy form of ``tools`` (read as tools)."""
    function_call: str | dict[str, Any] | None = None
    """The legacy form of ``tool_choice``."""
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str]
    echo: bool | None = None


class _Schemas(msgspec.Struct):
    """The parts of a body that carry JSON Schemas, as sent: read without being built."""

    response_format: msgspec.Raw = msgspec.Raw(b"null")
    text: msgspec.Raw = msgspec.Raw(b"null")
    """The Responses API's (its ``format``)."""
    tools: msgspec.Raw = msgspec.Raw(b"null")


def check_schema_bytes(body: bytes, limit: int, *, responses_api: bool = False) -> None:
    """Refuse a body whose response format or a tool of which is, as sent, more than twice
    ``limit`` bytes (the schema limit, measured exactly once the body is read, allowing
    for whitespace), before the body is decoded: building a huge schema's objects (and
    freeing them) is what a flood of such requests would cost the server."""
    try:
        parts = msgspec.json.decode(body, type=_Schemas)
    except (msgspec.DecodeError, RecursionError):
        return  # what is wrong with it, the request's reader says
    bound = 2 * limit
    fmt = parts.text if responses_api else parts.response_format
    if len(fmt) > bound:
        where = "text.format" if responses_api else "response_format"
        raise RequestError(
            f"{where} is {len(fmt):,} bytes as sent; this server compiles schemas of at most "
            f"{limit:,} bytes (max_grammar_bytes)",
            param=where,
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


def _decode(body: bytes, kind: type[_Common]) -> Any:
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
    ):
        if value not in (None, default):
            raise RequestError(f"{name}={value!r} is not supported by kvrt", param=name)
    if isinstance(request, CompletionRequest) and request.echo:
        raise RequestError("echo is not supported by kvrt", param="echo")
    if isinstance(request, ChatRequest):
        if request.modalities is not None and set(request.modalities) != {"text"}:
            raise RequestError(
                f"modalities {request.modalities!r}: this model answers in text only",
                param="modalities",
            )
        for name in ("audio", "web_search_options"):
            if getattr(request, name) is not None:
                raise RequestError(
                    f"{name} is not supported by kvrt (a local text model: no audio output, "
                    "no web search)",
                    param=name,
                )
    check_cache_salt(request.cache_salt)
    return request


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


def check_tool_turns(messages: Sequence[kvrt.Message], *, param: str = "messages") -> None:
    """What OpenAI refuses in a conversation, refused the same way (a 400): a ``tool``
    message without a ``tool_call_id``, or with one no earlier assistant call has, and an
    assistant's call whose arguments are not JSON. Chat's messages are named by their
    index; a Responses conversation (its earlier responses' items before the request's
    own) only by ``param``, since its indices are not the client's."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        where = f"{param}[{i}]" if param == "messages" else param
        for j, (call_id, _name, arguments) in enumerate(m.tool_calls):
            try:
                json.loads(arguments)
            except ValueError:
                raise RequestError(
                    f"{where}.tool_calls[{j}].function.arguments is not JSON: {arguments!r}"[:300],
                    param=param,
                ) from None
            called.add(call_id)
        if m.role != "tool":
            continue
        if not m.tool_call_id:
            raise RequestError(f"{where} is a tool message without a tool_call_id", param=param)
        if m.tool_call_id not in called:
            raise RequestError(
                f"{where}.tool_call_id {m.tool_call_id!r} answers no earlier assistant tool call"[
                    :300
                ],
                param=param,
            )


def logprobs_body(done: kvrt.Completion, *, chat: bool) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` object of a choice (chat: ``content``; completions:
    ``tokens``/``token_logprobs``/``top_logprobs``)."""
    if done.logprobs is None:
        return None
    if chat:
        return {"content": [chat_logprob(t) for t in done.logprobs], "refusal": None}
    return {
        "tokens": [t.text for t in done.logprobs],
        "token_logprobs": [t.logprob for t in done.logprobs],
        "top_logprobs": [{a.text: a.logprob for a in t.top} for t in done.logprobs],
        "text_offset": _offsets(done.logprobs),
    }


def chat_logprob(t: kvrt.TokenLogprob) -> dict[str, Any]:
    return {
        "token": t.text,
        "logprob": t.logprob,
        "bytes": list(t.raw),
        "top_logprobs": [
            {"token": a.text, "logprob": a.logprob, "bytes": list(a.raw)} for a in t.top
        ],
    }


def _offsets(tokens: tuple[kvrt.TokenLogprob, ...]) -> list[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t.text)
    return out


def tool_calls_body(calls: tuple[kvrt.ToolCall, ...]) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def tool_call_deltas(deltas: tuple[kvrt.ToolCallDelta, ...]) -> list[dict[str, Any]]:
    """Stream deltas as OpenAI sends them, one entry per chunk: the first of a call with its
    index, id, type and name (arguments empty), the next ones with the index and an
    arguments fragment. Framework assemblers (LlamaIndex reads ``tool_calls[0]`` only)
    read one entry a chunk, so each entry goes out in a chunk of its own."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.id is not None:
            out.append(
                {
                    "index": d.index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": ""},
                }
            )
        if d.arguments:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def legacy_functions(request: ChatRequest) -> bool:
    """Read the legacy ``functions`` / ``function_call`` as ``tools`` / ``tool_choice``
    (one call a reply, as that API makes): True when the request used them, so the answer
    is written in their form too (``message.function_call``, finish ``function_call``)."""
    if request.functions is None and request.function_call is None:
        return False
    if request.tools is not None or request.tool_choice is not None:
        raise RequestError(
            "give tools and tool_choice, or the legacy functions and function_call, not both",
            param="functions",
        )
    functions = request.functions or []
    for i, f in enumerate(functions):
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise RequestError(
                f"functions[{i}] must be an object with a name", param=f"functions[{i}]"
            )
    request.tools = [{"type": "function", "function": f} for f in functions]
    choice = request.function_call
    names = [f["name"] for f in functions]
    if isinstance(choice, dict) and set(choice) == {"name"} and choice["name"] in names:
        request.tool_choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is None or choice in ("none", "auto"):
        request.tool_choice = choice
    else:
        raise RequestError(
            f'function_call must be "none", "auto" or {{"name": ...}} naming one of the '
            f"functions ({', '.join(names) or 'none given'}), got {str(choice)[:80]}",
            param="function_call",
        )
    request.parallel_tool_calls = False
    return True


def legacy_messages(messages: list[Any]) -> list[Any]:
    """Legacy turns as tool turns: an assistant's ``function_call`` becomes its one tool
    call, a ``function`` message (by ``name``) the tool message answering the latest call
    of that name; anything else is passed on as it is."""
    out: list[Any] = []
    open_calls: dict[str, str] = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("role") == "assistant" and m.get("function_call") is not None:
            # (None, as a response's message dumped whole carries it, is no call)
            fc = m["function_call"]
            if not isinstance(fc, dict) or set(fc) != {"name", "arguments"}:
                raise RequestError(
                    f"messages[{i}].function_call must be an object of name and arguments",
                    param=f"messages[{i}].function_call",
                )
            cid = f"call_legacy_{i}"
            open_calls[str(fc.get("name"))] = cid
            call = {"id": cid, "type": "function", "function": fc}
            rest = {k: v for k, v in m.items() if k != "function_call"}
            out.append({**rest, "tool_calls": [call]})
        elif m.get("role") == "function":
            name = m.get("name")
            if not isinstance(name, str) or name not in open_calls:
                raise RequestError(
                    f"messages[{i}] (role function) answers no earlier function_call of "
                    f"that name ({name!r})",
                    param=f"messages[{i}].name",
                )
            out.append(
                {"role": "tool", "tool_call_id": open_calls.pop(name), "content": m.get("content")}
            )
        else:
            out.append(m)
    return out


def as_legacy(body: dict[str, Any]) -> dict[str, Any]:
    """A chat response or stream chunk in the legacy functions form."""
    for choice in body.get("choices", ()):
        part = choice.get("message") or choice.get("delta") or {}
        calls = part.pop("tool_calls", None)
        if calls:
            part["function_call"] = dict(calls[0]["function"])
        if choice.get("finish_reason") == "tool_calls":
            choice["finish_reason"] = "function_call"
    return body


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


FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "closed": "length",
    "tool_calls": "tool_calls",
}


def completion_id(prefix: str) -> str:
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
                "message": _message(done),
                "logprobs": logprobs_body(done, chat=True),
                "finish_reason": FINISH[done.finish_reason],
            }
        ],
        "usage": usage(done),
    }


def _message(done: kvrt.Completion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.text, "refusal": None}
    if done.tool_calls:
        message["content"] = done.text or None
        message["tool_calls"] = tool_calls_body(done.tool_calls)
    return message


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
                "logprobs": logprobs_body(done, chat=False),
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
    piece: kvrt.Piece | None = None,
    tool_call: dict[str, Any] | None = None,
    legacy: bool = False,
) -> bytes:
    """One server-sent event of a streamed response (``legacy``: in the functions form),
    with at most one tool-call entry (:func:`piece_chunks` splits a piece into events)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    logprobs: dict[str, Any] | None = None
    if piece is not None and piece.logprob is not None:
        if chat:
            logprobs = {"content": [chat_logprob(piece.logprob)], "refusal": None}
        else:
            t = piece.logprob
            logprobs = {
                "tokens": [t.text],
                "token_logprobs": [t.logprob],
                "top_logprobs": [{a.text: a.logprob for a in t.top}],
            }
    if done is not None:
        body["choices"] = []
        body["usage"] = usage(done)
    elif chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        body["choices"] = [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        ]
    else:
        body["choices"] = [
            {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        ]
    if legacy:
        as_legacy(body)
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def piece_chunks(
    rid: str, model: str, piece: kvrt.Piece, *, chat: bool, legacy: bool = False
) -> list[bytes]:
    """The events one generated piece makes: its text and log-prob in the first, and each
    tool-call entry in an event of its own (never two entries of one call in a chunk)."""
    calls = tool_call_deltas(piece.tool_calls) if chat and piece.tool_calls else []
    first = calls[0] if calls else None
    out = [
        chunk(
            rid,
            model,
            chat=chat,
            text=piece.text or None,
            piece=piece,
            tool_call=first,
            legacy=legacy,
        )
    ]
    out.extend(chunk(rid, model, chat=chat, tool_call=entry, legacy=legacy) for entry in calls[1:])
    return out


def read_chat(body: bytes, limits: Limits) -> Call:
    """``POST /v1/chat/completions``'s body as the ``session.chat`` call it asks for, every
    part checked (its grammars compiled), or a :class:`RequestError` naming what is
    wrong."""
    check_schema_bytes(body, limits.max_grammar_bytes)
    req = _decode(body, ChatRequest)
    limits.check_model(req.model)
    legacy = legacy_functions(req)
    try:
        messages = tuple(kvrt.read_messages(legacy_messages(req.messages)))
    except kvrt.KvrtError as exc:
        raise refused(exc, default="messages") from None
    check_tool_turns(messages)
    options = sampling_options(req, limits)
    options.update(
        tool_options(
            req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format, limits
        )
    )
    return Call(
        method="chat",
        messages=messages,
        options=options,
        stream=req.stream,
        include_usage=req.stream_options is not None and req.stream_options.include_usage,
        cache_salt=req.cache_salt,
        legacy_functions=legacy,
    )


def read_completion(body: bytes, limits: Limits) -> Call:
    """``POST /v1/completions``'s body as the ``session.complete`` call it asks for."""
    req = _decode(body, CompletionRequest)
    limits.check_model(req.model)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise RequestError("prompt must be one string", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise RequestError("prompt is empty", param="prompt")
    return Call(
        method="complete",
        prompt=prompt,
        options=sampling_options(req, limits, default=16),
        stream=req.stream,
        include_usage=req.stream_options is not None and req.stream_options.include_usage,
        cache_salt=req.cache_salt,
    )
