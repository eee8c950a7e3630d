"""What every API surface reads a request into: one :class:`Turn` (the typed kvrt call,
a :class:`kvrt.ChatCall` or a :class:`Prompt`, and how it is to be served), checked
against what the server allows (:class:`Limits`). Pure: no server, no event loop; the
grammars a call needs are compiled here (kvrt keeps them), so the server does it in a
worker thread."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import msgspec

import kvrt

from .errors import RequestError, refusal

__all__ = ["Limits", "Prompt", "Sampled", "Turn", "chat_call", "check_tool_turns", "sampled"]

SAMPLING_PARAMS = {
    f"sampling.{name}": name for name in ("temperature", "top_p", "top_k", "seed", "logit_bias")
}
"""kvrt's names of the sampling arguments, as the APIs call them."""


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """What the server allows a request: the model id it serves and the bounds a call is
    checked against."""

    model: str
    """The model id clients send."""
    context: int
    """The session's planner context: the most tokens a reply may ask for."""
    n_vocab: int
    """The model's vocabulary (``logit_bias`` names tokens below it)."""
    default_max_tokens: int = 512
    """Tokens generated when a request gives no ``max_tokens``."""
    max_grammar_bytes: int = 256 * 1024
    """The largest JSON Schema compiled for a request, in bytes of JSON."""

    def check_model(self, model: str) -> None:
        if model != self.model:
            raise RequestError(
                f"unknown model {model!r}: this server serves {self.model!r}",
                param="model",
                code="model_not_found",
            )


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """A ``session.complete`` call, read and checked."""

    prompt: str
    max_tokens: int
    sampling: kvrt.SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: int | None = None


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """What a request asks of a session: its call, and how the reply is served."""

    call: kvrt.ChatCall | Prompt
    stream: bool = False
    cache_salt: str | None = None
    """Requests reuse cached KV only with requests of the same salt (and tenant)."""

    @property
    def history(self) -> tuple[kvrt.Message, ...] | str:
        """What the session must hold for the call: its messages, or its prompt."""
        call = self.call
        return call.prompt if isinstance(call, Prompt) else call.messages

    def start(self, session: kvrt.Session) -> kvrt.Reply:
        """The call made on ``session``: its reply, started."""
        call = self.call
        if isinstance(call, kvrt.ChatCall):
            return session.chat(call)
        return session.complete(
            call.prompt,
            max_tokens=call.max_tokens,
            sampling=call.sampling,
            stop=call.stop,
            logprobs=call.logprobs,
        )


class Sampled(msgspec.Struct, frozen=True, kw_only=True):
    """A request's sampling and limits, checked."""

    max_tokens: int
    sampling: kvrt.SamplingParams
    stop: tuple[str, ...]
    logprobs: int | None


def sampled(
    limits: Limits,
    *,
    max_tokens: int | None,
    max_tokens_param: str = "max_tokens",
    default: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    logit_bias: Mapping[str, float] | None = None,
    logprobs: int | None = None,
) -> Sampled:
    """The sampling of a call, checked now (the bias against the vocabulary too): a 400
    naming the field before any work. ``temperature`` is 1 when not given, as the APIs
    have it."""
    limit = limits.context
    if max_tokens is None:
        tokens = min(default or limits.default_max_tokens, limit)
    elif 1 <= max_tokens <= limit:
        tokens = max_tokens
    else:
        raise RequestError(
            f"{max_tokens_param} must be between 1 and {limit} (the session's planner context), "
            f"got {max_tokens}",
            param=max_tokens_param,
        )
    temperature = 1.0 if temperature is None else temperature
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number", param=name)
    try:
        params = kvrt.SamplingParams(
            temperature=temperature,
            top_k=top_k or 0,
            top_p=1.0 if top_p is None else top_p,
            seed=seed,
            logit_bias=_bias(logit_bias),
        )
        kvrt.Sampler(params, limits.n_vocab)
    except kvrt.KvrtError as exc:
        raise refusal(exc, SAMPLING_PARAMS) from None
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return Sampled(max_tokens=tokens, sampling=params, stop=stops, logprobs=logprobs)


def _bias(given: Mapping[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` (token ids as strings, as JSON has them) with int keys, or None."""
    if not given:
        return None
    bias: dict[int, float] = {}
    for key, value in given.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise RequestError(
                f"logit_bias keys are token ids (decimal integers), got {key[:40]!r}",
                param="logit_bias",
            )
        bias[int(key)] = value
    return bias


def chat_call(
    messages: Sequence[kvrt.Message],
    sampling: Sampled,
    limits: Limits,
    *,
    tools: Sequence[Mapping[str, object]] | None,
    tool_choice: str | Mapping[str, object] | None,
    parallel_tool_calls: bool | None,
    response_format: Mapping[str, object] | None,
    format_param: str = "response_format",
) -> kvrt.ChatCall:
    """The :class:`kvrt.ChatCall` a request asks for, built and checked by kvrt (its
    grammars compiled): a bad part is a 400 naming it as the client sent it (kvrt's
    errors carry the path in the shape they were given: the Responses API's flat
    ``tools[0].parameters``, its ``text.format``). Schemas past ``max_grammar_bytes``
    are refused before they are compiled."""
    limit = limits.max_grammar_bytes
    for i, tool in enumerate(tools or ()):
        nested = isinstance(tool, Mapping) and "function" in tool
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        size = len(msgspec.json.encode(fn.get("parameters"))) if isinstance(fn, Mapping) else 0
        if size > limit:
            where = f"tools[{i}].function.parameters" if nested else f"tools[{i}].parameters"
            raise RequestError(
                f"{where} is a {size:,}-byte schema; this server compiles at most "
                f"{limit:,} bytes (max_grammar_bytes)",
                param=where,
            )
    if response_format is not None:
        size = len(msgspec.json.encode(response_format))
        if size > limit:
            raise RequestError(
                f"{format_param} is {size:,} bytes; this server compiles at most {limit:,} "
                "(max_grammar_bytes)",
                param=format_param,
            )
    try:
        return kvrt.ChatCall.read(
            messages,
            max_tokens=sampling.max_tokens,
            sampling=sampling.sampling,
            stop=sampling.stop,
            logprobs=sampling.logprobs,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            response_format=response_format,
            format_param=format_param,
        )
    except kvrt.KvrtError as exc:
        raise refusal(exc, default="tools") from None


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
