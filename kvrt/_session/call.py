"""A chat call read and checked once: the value :meth:`Session.chat` answers, which an
API's translator builds from a request (the server and the in-process API share its one
validation and its one meaning)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .._chat.grammar import Grammar, read_response_format
from .._chat.tools import Tool, ToolChoice, read_tool_choice, read_tools
from .._checks import check_bool, check_int
from .._engine.contract import SamplingParams
from .._errors import ArgumentTypeError, InvalidArgumentError
from . import arguments
from .chat import Message, messages_of

__all__ = ["ChatCall"]


class ChatCall(msgspec.Struct, frozen=True, kw_only=True):
    """One chat turn, read and checked: the messages, the tools and how they may be
    called, the response format, the sampling and the limits. Build it with
    :meth:`read` (the arguments of :meth:`kvrt.Session.chat`, which builds one the same
    way) and give it to ``session.chat(call)``; what is wrong is an error naming it, raised
    by :meth:`read`, before any session is involved. What depends on the session (a model
    with no chat template given tools) is checked when it is answered.
    """

    messages: tuple[Message, ...]
    """The conversation, read."""
    tools: tuple[Tool, ...] = ()
    """The functions the model may call (their grammars compiled when they may be)."""
    tool_choice: ToolChoice = "none"
    """``none``, ``auto``, ``required``, or ``("function", name)``."""
    parallel_tool_calls: bool = True
    """Several calls a reply, or one."""
    response_format: Grammar | None = None
    """The grammar the answer follows, or None (free text)."""
    response_schema: dict[str, Any] | None = None
    """The response format's JSON Schema, when it is one."""
    sampling: SamplingParams = SamplingParams()
    """How each token is chosen."""
    max_tokens: int = 256
    """The most tokens generated."""
    stop: tuple[str, ...] = ()
    """Stop sequences."""
    logprobs: int | None = None
    """How many alternatives each token's log-probability comes with, or None."""

    def __post_init__(self) -> None:
        """A call built by hand (or changed with ``msgspec.structs.replace``) is held to
        what :meth:`read` makes: each field of its type and in its range, a named tool
        among its tools, no grammar of the caller's beside tools it may call."""
        for name, value, kind in (
            ("messages", self.messages, Message),
            ("tools", self.tools, Tool),
        ):
            if not isinstance(value, tuple) or not all(isinstance(v, kind) for v in value):
                raise ArgumentTypeError(
                    f"ChatCall.{name} must be a tuple of kvrt.{kind.__name__} "
                    "(ChatCall.read makes one from OpenAI-style values)",
                    param=name,
                )
        if not self.messages:
            raise InvalidArgumentError(
                "messages is empty: give at least one message", param="messages"
            )
        choice, names = self.tool_choice, {t.name for t in self.tools}
        named = isinstance(choice, tuple) and len(choice) == 2 and choice[0] == "function"
        if not (choice in ("none", "auto", "required") or (named and choice[1] in names)):
            raise InvalidArgumentError(
                f"ChatCall.tool_choice {choice!r} is not 'none', 'auto', 'required' or "
                "('function', name) of one of its tools",
                param="tool_choice",
            )
        typed: tuple[tuple[str, object, type | tuple[type, ...]], ...] = (
            ("parallel_tool_calls", self.parallel_tool_calls, bool),
            ("response_format", self.response_format, (Grammar, type(None))),
            ("response_schema", self.response_schema, (dict, type(None))),
            ("sampling", self.sampling, SamplingParams),
        )
        for field, given, types in typed:
            if not isinstance(given, types):
                raise ArgumentTypeError(
                    f"ChatCall.{field} cannot be a {type(given).__name__}", param=field
                )
        check_int("max_tokens", self.max_tokens, low=0)
        arguments.stops(self.stop)
        arguments.logprobs(self.logprobs)
        own = self.response_format is not None and self.response_schema is None
        if self.tools and choice != "none" and own:
            raise InvalidArgumentError(
                "response_format with tools must be json_object or json_schema (a regex or "
                "grammar cannot be combined with tool calls)",
                param="response_format",
            )

    @classmethod
    def read(
        cls,
        messages: Sequence[Mapping[str, Any]] | Sequence[Message],
        *,
        max_tokens: int = 256,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any] | Tool] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: Mapping[str, Any] | Grammar | None = None,
        logprobs: int | None = None,
        format_param: str = "response_format",
    ) -> ChatCall:
        """The call, every argument checked (see :meth:`kvrt.Session.chat` for each): an
        :class:`kvrt.InvalidArgumentError` or :class:`kvrt.ArgumentTypeError` names the
        first one wrong. ``format_param`` is what errors call the response format (the
        Responses API's ``text.format``). The grammars of tools that may be called and
        of the response format are compiled now (and kept)."""
        read = tuple(messages_of(messages))
        params = arguments.sampling(
            sampling, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        tool_list = read_tools(tools, check_schemas=False)
        choice = read_tool_choice(tool_choice, tool_list)
        if tool_list and choice != "none":  # tool_choice none compiles no tool's grammar
            read_tools(tools)
        grammar, schema = read_response_format(response_format, param=format_param)
        if parallel_tool_calls is None:  # a named function is one call, as OpenAI makes it
            parallel = not isinstance(choice, tuple)
        else:
            parallel = check_bool("parallel_tool_calls", parallel_tool_calls)
        return cls(
            messages=read,
            tools=tool_list,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            response_format=grammar,
            response_schema=schema,
            sampling=params,
            max_tokens=check_int("max_tokens", max_tokens, low=0),
            stop=arguments.stops(stop),
            logprobs=arguments.logprobs(logprobs),
        )
