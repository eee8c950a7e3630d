"""How a reply carries tool calls: the grammar that enforces it, the stream that reads it,
the text a call renders as. Three formats:

- :class:`Envelope`: kvrt's JSON envelope for templates without tools (:mod:`kvrt._chat.tools`);
- :class:`Tagged`: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  or more, as Hermes and Qwen templates teach (text, or calls: never both in one reply);
- :class:`JsonCall`: the whole reply one ``{"name": ..., "parameters": {...}}`` object, as
  Llama 3.1 to 3.3 templates teach (one call per reply).

Arguments always validate against their tool's schema (the grammar embeds it) and are
written with :data:`kvrt._chat.grammar.JSON_SEPARATORS`, so a call streams, parses and renders
back to the same text. Everything here is pure: no I/O, no engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .envelope import EnvelopeStream, envelope_grammar, new_call_id, render_envelope
from .grammar import JSON_SEPARATORS, Grammar
from .schemas import bounded_numbers, closed_objects, embed_schema, with_defs
from .tools import Tool, ToolCall, ToolCallDelta, ToolChoice

__all__ = ["CallFormat", "CallStream", "Envelope", "JsonCall", "Tagged", "call_format"]

_GUIDANCE = {
    "whitespace_flexible": False,
    "item_separator": JSON_SEPARATORS[0],
    "key_separator": JSON_SEPARATORS[1],
}


class CallStream(Protocol):
    """A reply read as it is generated (see :class:`kvrt._chat.envelope.EnvelopeStream`)."""

    content: str
    calls: list[ToolCall]

    @property
    def decided(self) -> bool: ...

    repeated: bool
    """A call came again, identical to an earlier one of the reply: the reply ends there."""

    def feed(self, text: str) -> Iterator[str | ToolCallDelta]: ...

    def undecided(self, raw: str) -> str:
        """The content of a reply that ended before its form was known."""
        ...


class CallFormat(Protocol):
    """One way of writing tool calls."""

    @property
    def tools_in_template(self) -> bool:
        """The chat template shows the model its tools (else kvrt's system section)."""
        ...

    def grammar(
        self,
        tools: Sequence[Tool],
        choice: ToolChoice,
        *,
        parallel: bool,
        response_schema: dict[str, Any] | None,
    ) -> Grammar | None: ...

    def stream(self) -> CallStream: ...

    def render(self, content: str, calls: Sequence[tuple[str, str]]) -> str:
        """An assistant message as this format would have generated it (``calls`` as
        ``(name, arguments JSON)``), for one whose generated text is not remembered."""
        ...


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=JSON_SEPARATORS)


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(
        {**closed_objects(bounded_numbers(schema)), "x-guidance": _GUIDANCE}
    )


def _call_schema(tool: Tool, key: str) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    arguments = embed_schema(tool.parameters, "arguments", defs)
    call = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
    }
    return with_defs(call, defs)


def _allowed(tools: Sequence[Tool], choice: ToolChoice) -> list[Tool]:
    return [t for t in tools if not isinstance(choice, tuple) or t.name == choice[1]]


@dataclass(frozen=True, slots=True)
class Envelope:
    """kvrt's JSON envelope; ``wrapped``: a plain answer is ``{"response": ...}`` (not a
    response schema's JSON)."""

    wrapped: bool = True
    tools_in_template = False

    def grammar(
        self,
        tools: Sequence[Tool],
        choice: ToolChoice,
        *,
        parallel: bool,
        response_schema: dict[str, Any] | None,
    ) -> Grammar | None:
        return envelope_grammar(tools, choice, parallel=parallel, response_schema=response_schema)

    def stream(self) -> CallStream:
        return _EnvelopeReader(wrapped=self.wrapped)

    def render(self, content: str, calls: Sequence[tuple[str, str]]) -> str:
        return render_envelope(content, calls, wrapped=self.wrapped or bool(calls))


class _EnvelopeReader(EnvelopeStream):
    def undecided(self, raw: str) -> str:
        return "" if self.wrapped else raw


@dataclass(frozen=True, slots=True)
class Tagged:
    """``<tool_call>`` JSON, as Hermes and Qwen chat templates teach."""

    open: str = "<tool_call>\n"
    close: str = "\n</tool_call>"
    tools_in_template = True

    def grammar(
        self,
        tools: Sequence[Tool],
        choice: ToolChoice,
        *,
        parallel: bool,
        response_schema: dict[str, Any] | None,
    ) -> Grammar | None:
        def call(tool: Tool) -> str:
            body = _json_rule(_call_schema(tool, "arguments"))
            return f"{json.dumps(self.open)} {body} {json.dumps(self.close)}"

        return _lark(
            tools,
            choice,
            response_schema,
            call,
            calls='calls: call ("\\n" call)*' if parallel else "calls: call",
            text=f"TEXT: /(.|\\n)+/ & ~/{_regex(self.open)}(.|\\n)*/",
        )

    def stream(self) -> CallStream:
        return _TaggedReader(self.open, self.close)

    def render(self, content: str, calls: Sequence[tuple[str, str]]) -> str:
        shown = [
            self.open + _dumps({"name": name, "arguments": _parsed(arguments)}) + self.close
            for name, arguments in calls
        ]
        return "\n".join(([content] if content else []) + shown)


@dataclass(frozen=True, slots=True)
class JsonCall:
    """A reply that is one ``{"name": ..., "parameters": ...}`` object (Llama 3.x)."""

    names: tuple[str, ...] = ()
    """The tools' names: a reply is a call when it opens as a call of one of them."""
    key: str = "parameters"
    tools_in_template = True

    def grammar(
        self,
        tools: Sequence[Tool],
        choice: ToolChoice,
        *,
        parallel: bool,
        response_schema: dict[str, Any] | None,
    ) -> Grammar | None:
        return _lark(
            tools,
            choice,
            response_schema,
            lambda tool: _json_rule(_call_schema(tool, self.key)),
            calls="calls: call",  # the format holds one call
            text="TEXT: /(.|\\n)+/ & ~/\\{(.|\\n)*/",
        )

    def stream(self) -> CallStream:
        return _JsonReader(self.names, self.key)

    def render(self, content: str, calls: Sequence[tuple[str, str]]) -> str:
        if not calls:
            return content
        name, arguments = calls[0]  # the format holds one call
        return _dumps({"name": name, self.key: _parsed(arguments)})


def _lark(
    tools: Sequence[Tool],
    choice: ToolChoice,
    response_schema: dict[str, Any] | None,
    call: Callable[[Tool], str],
    *,
    calls: str,
    text: str,
) -> Grammar | None:
    """A reply of calls (each ``call(tool)``, as the ``calls`` rule joins them) or of an
    answer (``TEXT``, which cannot open as a call, or ``response_schema``'s JSON), as
    ``choice`` allows."""
    if not tools:
        return Grammar.json_schema(response_schema) if response_schema is not None else None
    if choice == "none":  # the tools are shown all the same: only the grammar forbids calls
        if response_schema is not None:
            return Grammar.json_schema(response_schema)
        return Grammar.lark("\n".join(["start: TEXT", text]))
    allowed = _allowed(tools, choice)
    forced = choice == "required" or isinstance(choice, tuple)
    lines = [
        "start: " + ("calls" if forced else "answer | calls"),
        "answer: " + (_json_rule(response_schema) if response_schema is not None else "TEXT"),
        calls,
        "call: " + " | ".join(f"call_{i}" for i in range(len(allowed))),
        *(f"call_{i}: {call(tool)}" for i, tool in enumerate(allowed)),
        text,
    ]
    return Grammar.lark("\n".join(lines))


def call_format(style: str | None, tools: Sequence[Tool], *, wrapped: bool) -> CallFormat:
    """The format of a template's call style (None: kvrt's envelope)."""
    if style == "tagged":
        return Tagged()
    if style == "json":
        return JsonCall(tuple(t.name for t in tools))
    return Envelope(wrapped=wrapped)


def _regex(text: str) -> str:
    return "".join(
        "\\n" if c == "\n" else ("\\" + c if c in r"\.^$|?*+()[]{}/" else c) for c in text
    )


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object opening at ``start``; None while incomplete."""
    depth, in_string, escape = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class _Reader:
    """What the tagged and JSON readers share: text or calls, decided by the opening."""

    def __init__(self) -> None:
        self._text = ""
        self._at = 0
        self._mode: str | None = None  # "text" or "calls"
        self.content = ""
        self.calls: list[ToolCall] = []
        self.repeated = False

    @property
    def decided(self) -> bool:
        return self._mode is not None

    def undecided(self, raw: str) -> str:
        return raw

    def _opens(self) -> tuple[str, ...]:
        raise NotImplementedError

    def feed(self, text: str) -> Iterator[str | ToolCallDelta]:
        self._text += text
        if self._mode is None:
            opens = self._opens()
            if any(self._text.startswith(o) for o in opens):
                self._mode = "calls"
            elif any(o.startswith(self._text) for o in opens):
                return
            else:
                self._mode = "text"
        if self._mode == "text":
            if self._at < len(self._text):
                new, self._at = self._text[self._at :], len(self._text)
                self.content += new
                yield new
            return
        yield from self._calls()

    def _calls(self) -> Iterator[ToolCallDelta]:
        raise NotImplementedError

    def _call(self, name: Any, arguments: Any) -> Iterator[ToolCallDelta]:
        if not isinstance(name, str):
            return
        text = _dumps(arguments)
        if any(c.name == name and c.arguments == text for c in self.calls):
            self.repeated = True  # the same call again in one reply (see EnvelopeStream)
            return
        call = ToolCall(id=new_call_id(), name=name, arguments=text)
        index = len(self.calls)
        self.calls.append(call)
        yield ToolCallDelta(index=index, id=call.id, name=name)
        yield ToolCallDelta(index=index, arguments=text)


class _TaggedReader(_Reader):
    def __init__(self, open_tag: str, close_tag: str) -> None:
        super().__init__()
        self._open, self._close = open_tag, close_tag

    def _opens(self) -> tuple[str, ...]:
        return (self._open,)

    def _calls(self) -> Iterator[ToolCallDelta]:
        while True:
            start = self._text.find(self._open, self._at)
            if start < 0:
                return
            body = start + len(self._open)
            end = _object_end(self._text, body)
            if end is None:
                return
            self._at = end
            try:
                obj = json.loads(self._text[body:end])
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield from self._call(obj.get("name"), obj.get("arguments", {}))


class _JsonReader(_Reader):
    def __init__(self, names: tuple[str, ...], key: str) -> None:
        super().__init__()
        self._names, self._key = names, key

    def _opens(self) -> tuple[str, ...]:
        return tuple(_dumps({"name": n, self._key: 0})[:-2] for n in self._names)

    def _calls(self) -> Iterator[ToolCallDelta]:
        if self._at:
            return
        end = _object_end(self._text, 0)
        if end is None:
            return
        self._at = end
        try:
            obj = json.loads(self._text[:end])
        except ValueError:
            return
        if isinstance(obj, dict):
            yield from self._call(obj.get("name"), obj.get(self._key, {}))
