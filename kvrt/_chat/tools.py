"""Tool calls for models whose chat template knows no tools: a JSON envelope under a grammar.

As llama.cpp does for such templates, the tools' schemas go into a system section of the
prompt, and the reply is JSON the grammar enforces, always one of::

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    {"response": "It is sunny."}

(``tool_choice`` decides which: ``auto`` either, ``required`` or a named function the
first, ``none`` plain text; ``parallel_tool_calls=False`` allows one call; with a
``response_format`` schema, the answer is that schema's JSON instead of ``response``.) The
arguments always validate against their tool's schema: the grammar embeds it. JSON is
written with ``json.dumps``'s separators and no other whitespace (see
:data:`kvrt._chat.grammar.JSON_SEPARATORS`), so an envelope parses, streams and renders back
to the same text.

Everything here is pure: no I/O, no engine.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec

from .._checks import check_text
from .._errors import ArgumentTypeError, InvalidArgumentError
from .grammar import JSON_SEPARATORS, Grammar
from .schemas import embed_schema, with_defs

__all__ = [
    "EnvelopeStream",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "canonical_arguments",
    "check_tool_schemas",
    "envelope_grammar",
    "read_tool_choice",
    "read_tools",
    "render_envelope",
    "tools_prompt",
]


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model may call (OpenAI's ``{"type": "function", "function": ...}``)."""

    name: str
    """The function's name: letters, digits, ``_`` and ``-``, at most 64."""
    description: str = ""
    """What it does, for the model."""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})
    """A JSON Schema of its arguments (an object)."""

    def openai(self) -> dict[str, Any]:
        """The definition as OpenAI (and a chat template's ``tools``) spell it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A call the model made."""

    id: str
    """The call's id (``call_...``): a ``tool`` message answering it names it."""
    name: str
    """The function called."""
    arguments: str
    """Its arguments, as JSON text (valid against the tool's schema)."""


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a call as it is generated: the first names it, the rest add arguments."""

    index: int
    """Which call of the reply, from 0."""
    id: str | None = None
    """The call's id (first piece only)."""
    name: str | None = None
    """The function (first piece only)."""
    arguments: str = ""
    """The next fragment of the arguments' JSON text."""


ToolChoice = str | tuple[str, str]
"""``none``, ``auto``, ``required``, or ``("function", name)``."""


def _name(where: str, value: Any) -> str:
    name = check_text(where, value, empty=False)
    if not _TOOL_NAME.fullmatch(name):  # ASCII only, as OpenAI: no look-alike letters
        raise InvalidArgumentError(
            f"{where} must be 1 to 64 of A-Z, a-z, 0-9, '_' or '-', got {name!r}"[:200]
        )
    return name


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def read_tools(tools: Any, *, check_schemas: bool = True) -> tuple[Tool, ...]:
    """OpenAI-style tool definitions (mappings, or :class:`Tool`), checked: each a
    function with a unique name and an object schema the grammar engine supports (with
    ``check_schemas=False``, the schemas' grammars are left to :func:`check_tool_schemas`,
    for a request that may not use them: ``tool_choice`` ``none``)."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ArgumentTypeError(
            f"tools must be a list of tool definitions, got {type(tools).__name__}"
        )
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if isinstance(tool, Tool):
            out.append(tool)
            continue
        if not isinstance(tool, Mapping):
            raise ArgumentTypeError(f"{where} must be a mapping, got {type(tool).__name__}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise InvalidArgumentError(f"{where}.type {kind!r} is not supported: only 'function'")
        fn = tool.get("function", tool)  # Chat Completions nest it; Responses do not
        if not isinstance(fn, Mapping):
            raise ArgumentTypeError(f"{where}.function must be a mapping")
        name = _name(f"{where}.function.name", fn.get("name"))
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ArgumentTypeError(f"{where}.function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise ArgumentTypeError(f"{where}.function.parameters must be a JSON Schema object")
        parameters = dict(parameters)
        if parameters.get("type", "object") != "object":
            raise InvalidArgumentError(f"{where}.function.parameters must describe an object")
        out.append(Tool(name=name, description=description, parameters=parameters))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidArgumentError(f"two tools are named {dup!r}")
    if check_schemas:
        check_tool_schemas(out)
    return tuple(out)


def check_tool_schemas(tools: Sequence[Tool]) -> None:
    """Each tool's parameters compiled as the grammar its calls' arguments follow (once:
    compiled grammars are kept), or an :class:`InvalidArgumentError` naming the tool."""
    for i, tool in enumerate(tools):
        try:
            Grammar.json_schema(tool.parameters)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"tools[{i}].function.parameters: {exc}") from None


def read_tool_choice(choice: Any, tools: Sequence[Tool]) -> ToolChoice:
    """``tool_choice`` checked against ``tools``: ``none``, ``auto``, ``required``, or a
    named function (``{"type": "function", "function": {"name": ...}}``, or the Responses
    API's ``{"type": "function", "name": ...}``)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidArgumentError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}"[
                    :200
                ]
            )
        if choice == "required" and not tools:
            raise InvalidArgumentError("tool_choice 'required' needs tools")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "none"
            raise InvalidArgumentError(
                f"tool_choice names the function {name!r}, which is not in tools (tools: {known})"[
                    :300
                ]
            )
        return ("function", name)
    raise InvalidArgumentError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', ...}"
    )


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=JSON_SEPARATORS)


def canonical_arguments(arguments: str) -> str:
    """A call's arguments in the one form kvrt writes and compares them in: its JSON
    re-written with ``json.dumps``'s separators, keys in their order, no escapes for
    what needs none (as chat templates render arguments with ``tojson``). Frameworks send
    calls back re-serialized (``{"key":"beta"}`` for ``{"key": "beta"}``): the same call,
    so the same text. Text that is not JSON is kept as it is."""
    try:
        return _dumps(json.loads(arguments))
    except ValueError:
        return arguments


def tools_prompt(tools: Sequence[Tool]) -> str:
    """The system section telling the model its tools and how to answer. Tools are shown
    as signatures, ``get_weather(city: string, unit?: 'C' | 'F'): what it does`` (the
    grammar enforces the whole schema; measured: SmolLM2 called a weather tool for 6 of 6
    weather questions shown signatures, 2 of 6 shown JSON Schema). The section does not
    depend on ``tool_choice`` (the grammar enforces that too), so a tool loop that changes
    its choice between steps keeps this section, and all after it, reused."""
    lines = ["You can call these tools:"]
    for tool in tools:
        about = f": {tool.description}" if tool.description else ""
        lines.append(f"- {tool.name}({_arguments(tool.parameters)}){about}")
    lines.append(
        'To call tools, answer with JSON only: {"tool_calls": [{"name": "<tool name>", '
        '"arguments": {<its arguments>}}]}'
    )
    lines.append('To answer without a tool, answer with JSON: {"response": "<your answer>"}')
    return "\n".join(lines)


def _arguments(schema: Mapping[str, Any]) -> str:
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        return ""
    required = set(schema.get("required") or ())
    return ", ".join(
        f"{name}{'' if name in required else '?'}: {_type(sub)}" for name, sub in properties.items()
    )


def _type(schema: Any) -> str:
    """A short name for what ``schema`` admits."""
    if not isinstance(schema, Mapping):
        return "any"
    if "enum" in schema and isinstance(schema["enum"], list):
        return " | ".join(_dumps(v).replace('"', "'") for v in schema["enum"])
    if "const" in schema:
        return _dumps(schema["const"]).replace('"', "'")
    if isinstance(schema.get("$ref"), str):
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(_type(s) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(str(k) for k in kind)
    if kind == "array":
        return f"array of {_type(schema.get('items'))}"
    return str(kind) if isinstance(kind, str) else "any"


def envelope_grammar(
    tools: Sequence[Tool],
    choice: ToolChoice,
    *,
    parallel: bool = True,
    response_schema: Mapping[str, Any] | None = None,
) -> Grammar | None:
    """The grammar of the reply: calls (of the tools ``choice`` allows, at most one when
    not ``parallel``), an answer (``{"response": text}``, or ``response_schema``'s JSON),
    or either. None for ``none`` without a response schema: plain text."""
    calls: dict[str, Any] | None = None
    defs: dict[str, Any] = {}
    if choice != "none" and tools:
        allowed = [t for t in tools if not isinstance(choice, tuple) or t.name == choice[1]]
        one_call = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    "arguments": embed_schema(t.parameters, f"tool_{i}", defs),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, t in enumerate(allowed)
        ]
        items: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
        if not parallel:
            items["maxItems"] = 1
        calls = {
            "type": "object",
            "properties": {"tool_calls": items},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
    answer: dict[str, Any] | None
    if response_schema is not None:
        answer = dict(response_schema)
    elif tools:  # the envelope the model was taught, whatever tool_choice allows
        answer = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
    else:
        return None
    if calls is None:
        return Grammar.json_schema(answer)
    if choice == "required" or isinstance(choice, tuple):
        return Grammar.json_schema(with_defs(calls, defs))
    answer = embed_schema(answer, "response", defs)
    return Grammar.json_schema(with_defs({"anyOf": [calls, answer]}, defs))


_CALLS = '{"tool_calls": ['
_RESPONSE = '{"response": "'
_NAME = '{"name": "'
_ARGUMENTS = ', "arguments": '


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def render_envelope(content: str, calls: Sequence[tuple[str, str]], *, wrapped: bool) -> str:
    """An assistant message as the envelope the grammar would have made of it (for a
    message whose generated text kvrt does not remember)."""
    if calls:
        out = []
        for name, arguments in calls:
            try:
                parsed = json.loads(arguments) if arguments else {}
            except ValueError:
                parsed = arguments
            out.append({"name": name, "arguments": parsed})
        return _dumps({"tool_calls": out})
    return _dumps({"response": content}) if wrapped else content


class EnvelopeStream:
    """The envelope read as it is generated: content deltas (the ``response`` string,
    unescaped, or the text itself when not wrapped) and tool-call deltas (name first,
    then fragments of the arguments' JSON).

    A call's deltas are held back until its arguments are complete, and a call identical
    to an earlier one of the same reply (same tool, same arguments) is dropped and ends
    the reply (``repeated``): small models repeat a call, and each copy would run the tool
    again (measured: SmolLM2 asked for the same call three times in one reply, then,
    given three results, again and again; given one, it answered), and one that repeats
    itself goes on until its token limit.

    >>> s = EnvelopeStream(wrapped=True)
    >>> [*s.feed('{"tool_calls": [{"name": "f", "argu')], [*s.feed('ments": {"a": 1}}]}')]
    ([], [ToolCallDelta(index=0, id='call_...', name='f'), ToolCallDelta(index=0, ...)])
    """

    def __init__(self, *, wrapped: bool) -> None:
        self.wrapped = wrapped
        self._text = ""
        self._at = 0
        self._mode: str | None = None  # "calls", "response", "other"
        self._name: str | None = None  # the call being read
        self._args = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._content_out = 0
        self.content = ""
        """The answer's text streamed so far (the ``response`` string unescaped, or the
        text itself when not wrapped), complete or cut short."""
        self.calls: list[ToolCall] = []
        """The distinct calls complete so far, in order, with the ids their deltas got."""
        self.repeated = False
        """Whether a call came again, identical to an earlier one: the reply ends there."""

    @property
    def decided(self) -> bool:
        """Whether the text so far shows calls, a wrapped answer, or other text."""
        return self._mode is not None

    def feed(self, text: str) -> Iterator[str | ToolCallDelta]:
        """The deltas ``text`` (the next generated text) completes."""
        self._text += text
        if self._mode is None:
            if self._text.startswith(_CALLS):
                self._mode, self._at = "calls", len(_CALLS)
            elif self.wrapped and self._text.startswith(_RESPONSE):
                self._mode, self._at = "response", len(_RESPONSE)
            elif _CALLS.startswith(self._text) or (
                self.wrapped and _RESPONSE.startswith(self._text)
            ):
                return  # not decided yet
            else:
                self._mode = "other"
        if self._mode == "other":
            if self._at < len(self._text):
                self.content += self._text[self._at :]
                yield self._text[self._at :]
                self._at = len(self._text)
        elif self._mode == "response":
            yield from self._response()
        else:
            yield from self._calls()

    def _response(self) -> Iterator[str]:
        raw = self._text[self._at :]
        # The string ends at the first unescaped quote.
        end, i = None, 0
        while i < len(raw):
            if raw[i] == "\\":
                i += 2
                continue
            if raw[i] == '"':
                end = i
                break
            i += 1
        body = raw if end is None else raw[:end]
        # Hold back a trailing partial escape; decode the rest as a JSON string.
        cut = len(body)
        back = body.rfind("\\")
        if (
            end is None
            and back >= 0
            and len(body) - back < (6 if body[back + 1 : back + 2] == "u" else 2)
        ):
            cut = back
        try:
            decoded = json.loads('"' + body[:cut] + '"')
        except ValueError:
            return
        if len(decoded) > self._content_out:
            self.content += decoded[self._content_out :]
            yield decoded[self._content_out :]
            self._content_out = len(decoded)

    def _calls(self) -> Iterator[ToolCallDelta]:
        text = self._text
        while self._at < len(text):
            if self._name is None:
                rest = text[self._at :]
                start = rest.find(_NAME)
                if start < 0:
                    return
                quote = rest.find('"', start + len(_NAME))  # names hold no quotes
                after = quote + 1 + len(_ARGUMENTS)
                if quote < 0 or len(rest) < after:
                    return  # the name, or what follows it, is still coming
                self._name = rest[start + len(_NAME) : quote]
                self._args = ""
                self._at += after
                self._depth, self._in_string, self._escape = 0, False, False
                continue
            begin = self._at
            done = False
            while self._at < len(text):
                c = text[self._at]
                self._at += 1
                if self._in_string:
                    if self._escape:
                        self._escape = False
                    elif c == "\\":
                        self._escape = True
                    elif c == '"':
                        self._in_string = False
                elif c == '"':
                    self._in_string = True
                elif c in "{[":
                    self._depth += 1
                elif c in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        done = True
                        break
            self._args += text[begin : self._at]
            if not done:
                return
            name, arguments, self._name = self._name, self._args, None
            if any(
                c.name == name and c.arguments == canonical_arguments(arguments) for c in self.calls
            ):
                self.repeated = True  # the same call again: dropped, and the reply ends
                return
            call = ToolCall(id=new_call_id(), name=name, arguments=canonical_arguments(arguments))
            index = len(self.calls)
            self.calls.append(call)
            yield ToolCallDelta(index=index, id=call.id, name=name)
            yield ToolCallDelta(index=index, arguments=call.arguments)
