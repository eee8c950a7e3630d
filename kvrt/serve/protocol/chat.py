"""Chat Completions (``POST /v1/chat/completions``): a request body read into one typed
kvrt call (:func:`read_chat`), and the call's result written as the API's response
(:func:`chat_response`) or stream chunks (:class:`ChatStream`). Pure: no server, no
event loop.

Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``), structured output
(``response_format``) and ``logprobs``/``top_logprobs`` are served as OpenAI documents
them; the legacy ``functions``/``function_call`` are read as tools and answered in their
own form. Fields kvrt does not use are accepted and ignored (``user``, ``metadata``,
``store``); ``n`` above 1, penalties, audio and web search are refused with a 400 naming
them.
"""

from __future__ import annotations

import time

import msgspec
from msgspec import UNSET, UnsetType

import kvrt

from .call import Limits, Turn, chat_call, check_tool_turns, sampled
from .errors import RequestError
from .errors import refusal as refused
from .wire import (
    FINISH,
    STREAM_END,
    CommonRequest,
    LogprobBody,
    StreamEnd,
    UsageBody,
    check_schema_bytes,
    decode_request,
    logprob_body,
    usage_body,
)

__all__ = [
    "ChatAsked",
    "ChatChunk",
    "ChatCompletion",
    "ChatRequest",
    "ChatStream",
    "chat_response",
    "read_chat",
]


class ChatRequest(CommonRequest, kw_only=True):
    messages: list[object]
    max_completion_tokens: int | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, object] | None = None
    top_logprobs: int | None = None
    functions: list[object] | None = None
    """The legacy form of ``tools`` (read as tools)."""
    function_call: str | dict[str, object] | None = None
    """The legacy form of ``tool_choice``."""
    modalities: list[str] | None = None
    audio: dict[str, object] | None = None
    web_search_options: dict[str, object] | None = None


class ChatAsked(msgspec.Struct, frozen=True, kw_only=True):
    """A chat request, read: its turn, and how it is answered."""

    turn: Turn
    include_usage: bool = False
    """A stream ends with a usage chunk."""
    legacy: bool = False
    """Asked with the legacy ``functions``: answered with ``function_call``."""


def read_chat(body: bytes, limits: Limits) -> ChatAsked:
    """``POST /v1/chat/completions``'s body as the ``session.chat`` call it asks for, every
    part checked (its grammars compiled), or a :class:`RequestError` naming what is
    wrong."""
    check_schema_bytes(body, limits.max_grammar_bytes, format_param="response_format")
    req = decode_request(body, ChatRequest)
    req.check()
    if req.modalities is not None and set(req.modalities) != {"text"}:
        raise RequestError(
            f"modalities {req.modalities!r}: this model answers in text only", param="modalities"
        )
    for name in ("audio", "web_search_options"):
        if getattr(req, name) is not None:
            raise RequestError(
                f"{name} is not supported by kvrt (a local text model: no audio output, "
                "no web search)",
                param=name,
            )
    limits.check_model(req.model)
    tools, choice, parallel, legacy = _tools(req)
    try:
        messages = tuple(kvrt.read_messages(legacy_messages(req.messages)))
    except kvrt.KvrtError as exc:
        raise refused(exc, default="messages") from None
    check_tool_turns(messages)
    given = req.max_completion_tokens
    sampling = sampled(
        limits,
        max_tokens=req.max_tokens if given is None else given,
        max_tokens_param="max_tokens" if given is None else "max_completion_tokens",
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        logit_bias=req.logit_bias,
        logprobs=_logprobs(req),
    )
    call = chat_call(
        messages,
        sampling,
        limits,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=req.response_format,
    )
    turn = Turn(call=call, stream=req.stream, cache_salt=req.cache_salt)
    return ChatAsked(turn=turn, include_usage=req.include_usage, legacy=legacy)


def _logprobs(req: ChatRequest) -> int | None:
    """How many alternatives per token the request asks for (``logprobs: true`` with
    ``top_logprobs``, 0 to 20), or None (no logprobs)."""
    top = req.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise RequestError("top_logprobs must be from 0 to 20", param="top_logprobs")
    if req.logprobs is None or req.logprobs is False:
        if top:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    if req.logprobs is not True:
        raise RequestError("logprobs must be true or false", param="logprobs")
    return top or 0


_Tools = list[dict[str, object]] | None
_ToolChoice = str | dict[str, object] | None


def _tools(req: ChatRequest) -> tuple[_Tools, _ToolChoice, bool | None, bool]:
    """The request's tools, tool choice and parallel calls; with the legacy ``functions``
    / ``function_call`` read as them (one call a reply, as that API makes), and whether
    they were, so the answer is written in their form too."""
    if req.functions is None and req.function_call is None:
        return req.tools, req.tool_choice, req.parallel_tool_calls, False
    if req.tools is not None or req.tool_choice is not None:
        raise RequestError(
            "give tools and tool_choice, or the legacy functions and function_call, not both",
            param="functions",
        )
    functions: list[dict[str, object]] = []
    for i, f in enumerate(req.functions or []):
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise RequestError(
                f"functions[{i}] must be an object with a name", param=f"functions[{i}]"
            )
        functions.append(f)
    tools: _Tools = [{"type": "function", "function": f} for f in functions]
    choice = req.function_call
    names = [f["name"] for f in functions]
    if isinstance(choice, dict) and set(choice) == {"name"} and choice["name"] in names:
        return tools, {"type": "function", "function": {"name": choice["name"]}}, False, True
    if choice is None or choice in ("none", "auto"):
        return tools, choice, False, True
    raise RequestError(
        f'function_call must be "none", "auto" or {{"name": ...}} naming one of the '
        f"functions ({', '.join(map(str, names)) or 'none given'}), got {str(choice)[:80]}",
        param="function_call",
    )


def legacy_messages(messages: list[object]) -> list[object]:
    """Legacy turns as tool turns: an assistant's ``function_call`` becomes its one tool
    call, a ``function`` message (by ``name``) the tool message answering the latest call
    of that name; anything else is passed on as it is."""
    out: list[object] = []
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


class FunctionBody(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call's function: its name (in a stream, only the call's first entry) and
    its arguments (in a stream, the next fragment)."""

    name: str | UnsetType = UNSET
    arguments: str


class ToolCallBody(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call, or (streamed) one entry of one: its index, then its id and type in
    the call's first entry only."""

    index: int | UnsetType = UNSET
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionBody


class MessageBody(msgspec.Struct, frozen=True, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallBody] | UnsetType = UNSET
    function_call: FunctionBody | UnsetType = UNSET
    """The legacy form's one call."""


class Logprobs(msgspec.Struct, frozen=True, kw_only=True):
    content: list[LogprobBody]
    refusal: None = None


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: MessageBody
    logprobs: Logprobs | None
    finish_reason: str


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A chat completion object."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: UsageBody


class Delta(msgspec.Struct, frozen=True, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallBody] | UnsetType = UNSET
    function_call: FunctionBody | UnsetType = UNSET


class ChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: Logprobs | None = None
    finish_reason: str | None = None


class ChatChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One chunk of a streamed chat completion."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageBody | UnsetType = UNSET


def _logprobs_of(done: kvrt.Completion) -> Logprobs | None:
    if done.logprobs is None:
        return None
    return Logprobs(content=[logprob_body(t) for t in done.logprobs])


def chat_response(rid: str, model: str, done: kvrt.Completion, *, legacy: bool) -> ChatCompletion:
    """The chat completion object of ``done`` (``legacy``: in the functions form)."""
    finish = FINISH[done.finish_reason]
    if not done.tool_calls:
        message = MessageBody(content=done.text)
    elif legacy:
        first = done.tool_calls[0]
        called = FunctionBody(name=first.name, arguments=first.arguments)
        message = MessageBody(content=done.text or None, function_call=called)
        finish = "function_call"
    else:
        calls = [
            ToolCallBody(
                id=c.id, type="function", function=FunctionBody(name=c.name, arguments=c.arguments)
            )
            for c in done.tool_calls
        ]
        message = MessageBody(content=done.text or None, tool_calls=calls)
    choice = Choice(message=message, logprobs=_logprobs_of(done), finish_reason=finish)
    return ChatCompletion(
        id=rid, created=int(time.time()), model=model, choices=[choice], usage=usage_body(done)
    )


class ChatStream:
    """The chunks of one streamed chat completion, built from what the server feeds it
    (the shape of h11: no I/O here): :meth:`start`, :meth:`piece` for each piece of the
    reply, :meth:`finish` with the completion."""

    def __init__(self, rid: str, model: str, *, include_usage: bool, legacy: bool) -> None:
        self.rid, self.model = rid, model
        self.include_usage, self.legacy = include_usage, legacy
        self.created = int(time.time())

    def _chunk(
        self, delta: Delta, *, logprobs: Logprobs | None = None, finish: str | None = None
    ) -> ChatChunk:
        choice = ChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)
        return ChatChunk(id=self.rid, created=self.created, model=self.model, choices=[choice])

    def start(self) -> list[ChatChunk]:
        return [self._chunk(Delta(role="assistant", content=""))]

    def piece(self, piece: kvrt.Piece) -> list[ChatChunk]:
        """The chunks one generated piece makes: its text and log-prob in the first, and
        each tool-call entry in a chunk of its own (never two entries of one call in a
        chunk: framework assemblers, LlamaIndex's, read one entry a chunk)."""
        if not (piece.text or piece.tool_calls or piece.logprob is not None):
            return []
        entries = [e for d in piece.tool_calls for e in self._entries(d)]
        logprobs = None
        if piece.logprob is not None:
            logprobs = Logprobs(content=[logprob_body(piece.logprob)])
        first = self._delta(piece.text or UNSET, entries[0] if entries else None)
        out = [self._chunk(first, logprobs=logprobs)]
        out += [self._chunk(self._delta(UNSET, entry)) for entry in entries[1:]]
        return out

    def _entries(self, d: kvrt.ToolCallDelta) -> list[ToolCallBody]:
        """A call's delta as OpenAI streams it: the first entry of a call with its index,
        id, type and name (arguments empty), the next ones with an arguments fragment."""
        out = []
        if d.id is not None:
            opened = FunctionBody(name=d.name or "", arguments="")
            out.append(ToolCallBody(index=d.index, id=d.id, type="function", function=opened))
        if d.arguments:
            out.append(ToolCallBody(index=d.index, function=FunctionBody(arguments=d.arguments)))
        return out

    def _delta(self, text: str | UnsetType, entry: ToolCallBody | None) -> Delta:
        if entry is None:
            return Delta(content=text)
        if self.legacy:
            return Delta(content=text, function_call=entry.function)
        return Delta(content=text, tool_calls=[entry])

    def finish(self, done: kvrt.Completion) -> list[ChatChunk | StreamEnd]:
        """The finish chunk, the usage chunk when asked for, and the end."""
        finish = FINISH[done.finish_reason]
        if self.legacy and finish == "tool_calls":
            finish = "function_call"
        out: list[ChatChunk | StreamEnd] = [self._chunk(Delta(), finish=finish)]
        if self.include_usage:
            ended = ChatChunk(
                id=self.rid,
                created=self.created,
                model=self.model,
                choices=[],
                usage=usage_body(done),
            )
            out.append(ended)
        out.append(STREAM_END)
        return out
