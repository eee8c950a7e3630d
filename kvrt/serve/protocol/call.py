"""What every API surface reads a request into: one typed kvrt call (:class:`Call`),
checked against what the server allows (:class:`Limits`). Pure: no server, no event loop;
the grammars a call needs are compiled here (kvrt keeps them), so the server does it in a
worker thread."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

import kvrt

from .errors import RequestError, refusal

__all__ = ["Call", "Limits", "sampling_options", "tool_options"]

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


class Call(msgspec.Struct, kw_only=True):
    """One kvrt call a request asks for, checked: ``session.chat(messages, **options)`` or
    ``session.complete(prompt, **options)``, and how its result is to be answered."""

    method: Literal["chat", "complete"]
    messages: tuple[kvrt.Message, ...] = ()
    prompt: str = ""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """The keyword arguments of the call."""
    stream: bool = False
    include_usage: bool = False
    """A stream ends with a usage chunk."""
    cache_salt: str | None = None
    legacy_functions: bool = False
    """Asked with the legacy ``functions``: answered with ``function_call``."""

    @property
    def history(self) -> tuple[kvrt.Message, ...] | str:
        """What the session must hold for the call: its messages, or its prompt."""
        return self.messages if self.method == "chat" else self.prompt

    def start(self, session: kvrt.Session) -> kvrt.Reply:
        """The call made on ``session``: its reply, started."""
        if self.method == "chat":
            return session.chat(self.messages, **self.options)
        return session.complete(self.prompt, **self.options)


def sampling_options(request: Any, limits: Limits, *, default: int | None = None) -> dict[str, Any]:
    """The sampling keywords of a call (``max_tokens``, ``temperature`` ... ``logprobs``),
    checked now (the bias against the vocabulary too): a 400 naming the field before any
    work."""
    options = {
        "max_tokens": max_tokens(
            request, default=default or limits.default_max_tokens, limit=limits.context
        ),
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "seed": request.seed,
        "stop": request.stop,
    }
    for name in ("temperature", "top_p"):
        value = options[name]
        if value is not None and not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number", param=name)
    sampling = ("temperature", "top_p", "top_k", "seed")
    bias = logit_bias(request)
    try:
        params = kvrt.SamplingParams(
            **{k: options[k] for k in sampling if options[k] is not None}, logit_bias=bias
        )
        kvrt.Sampler(params, limits.n_vocab)
    except kvrt.KvrtError as exc:
        raise refusal(exc, SAMPLING_PARAMS) from None
    if bias is not None:
        options["sampling"] = {"logit_bias": bias}
    options["logprobs"] = requested_logprobs(request)
    return options


def tool_options(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    response_format: Any,
    limits: Limits,
    *,
    format_param: str = "response_format",
) -> dict[str, Any]:
    """Tools and structured output, checked now: a bad one is a 400 naming it as the client
    sent it (kvrt's errors carry the path in the shape they were given: the Responses API's
    flat ``tools[0].parameters``, its ``text.format``). Schemas past ``max_grammar_bytes``
    are refused before they are compiled, and tool schemas a request cannot use
    (``tool_choice: "none"``) are not compiled."""
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
    options: dict[str, Any] = {}
    try:
        read = kvrt.read_tools(tools, check_schemas=False)
        choice = kvrt.read_tool_choice(tool_choice, read)
        if read and choice != "none":
            kvrt.read_tools(tools)  # their grammars, compiled (and kept) now
        if response_format is not None:
            kvrt.read_response_format(response_format, param=format_param)
    except kvrt.KvrtError as exc:
        raise refusal(exc, default="tools") from None
    if read:
        options["tools"] = tools
        options["tool_choice"] = tool_choice
        options["parallel_tool_calls"] = parallel_tool_calls
    if response_format is not None:
        options["response_format"] = response_format
    return options


def requested_logprobs(request: Any) -> int | None:
    """How many alternatives per token the request asks for, or None (no logprobs):
    chat's ``logprobs: true`` with ``top_logprobs`` (0 to 20), completions' integer
    ``logprobs``."""
    if hasattr(request, "top_logprobs"):  # chat, or a Responses request read as chat
        top = request.top_logprobs
        if top is not None and not 0 <= top <= 20:
            raise RequestError("top_logprobs must be from 0 to 20", param="top_logprobs")
        if request.logprobs is None or request.logprobs is False:
            if top:
                raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        if request.logprobs is not True:
            raise RequestError("logprobs must be true or false", param="logprobs")
        return top or 0
    value = request.logprobs
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not 0 <= value <= 5:
        raise RequestError("logprobs must be an integer from 0 to 5", param="logprobs")
    return int(value)


def logit_bias(request: Any) -> dict[int, float] | None:
    """``logit_bias`` (token ids as strings, as JSON has them) with int keys, or None."""
    given = getattr(request, "logit_bias", None)
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
