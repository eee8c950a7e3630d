"""Tool definitions, tool choices and calls, checked where they enter; and, for models
whose chat template knows no tools, how the tools are shown (the envelope itself, its
grammar and its reader, is :mod:`kvrt._chat.envelope`).

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
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .._checks import check_text
from .._errors import ArgumentTypeError, InvalidArgumentError
from .grammar import JSON_SEPARATORS, Grammar

__all__ = [
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "canonical_arguments",
    "check_tool_schemas",
    "read_tool_choice",
    "read_tools",
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
            f"{where} must be 1 to 64 of A-Z, a-z, 0-9, '_' or '-', got {name!r}"[:200],
            param=where,
        )
    return name


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def read_tools(tools: Any, *, check_schemas: bool = True) -> tuple[Tool, ...]:
    """OpenAI-style tool definitions (mappings, or :class:`Tool`), checked: each a
    function with a unique name and an object schema the grammar engine supports (with
    ``check_schemas=False``, the schemas' grammars are left to :func:`check_tool_schemas`,
    for a request that may not use them: ``tool_choice`` ``none``).

    Chat Completions nest a function (``{"type": "function", "function": {...}}``), the
    Responses API does not (``{"type": "function", "name": ...}``): errors name what is
    wrong in the shape it was given (``tools[0].function.parameters`` or
    ``tools[0].parameters``), in the message and in ``param``."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ArgumentTypeError(
            f"tools must be a list of tool definitions, got {type(tools).__name__}", param="tools"
        )
    out: list[Tool] = []
    places: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if isinstance(tool, Tool):
            out.append(tool)
            places.append(f"{where}.function")
            continue
        if not isinstance(tool, Mapping):
            raise ArgumentTypeError(
                f"{where} must be a mapping, got {type(tool).__name__}", param=where
            )
        kind = tool.get("type", "function")
        if kind != "function":
            raise InvalidArgumentError(
                f"{where}.type {kind!r} is not supported: only 'function'", param=f"{where}.type"
            )
        nested = "function" in tool
        fn = tool.get("function", tool)
        at = f"{where}.function" if nested else where
        if not isinstance(fn, Mapping):
            raise ArgumentTypeError(f"{at} must be a mapping", param=at)
        name = _name(f"{at}.name", fn.get("name"))
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ArgumentTypeError(f"{at}.description must be a string", param=f"{at}.description")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise ArgumentTypeError(
                f"{at}.parameters must be a JSON Schema object", param=f"{at}.parameters"
            )
        parameters = dict(parameters)
        if parameters.get("type", "object") != "object":
            raise InvalidArgumentError(
                f"{at}.parameters must describe an object", param=f"{at}.parameters"
            )
        out.append(Tool(name=name, description=description, parameters=parameters))
        places.append(at)
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        at = places[len(names) - 1 - names[::-1].index(dup)]
        raise InvalidArgumentError(f"two tools are named {dup!r}", param=f"{at}.name")
    if check_schemas:
        check_tool_schemas(out, places)
    return tuple(out)


def check_tool_schemas(tools: Sequence[Tool], places: Sequence[str] = ()) -> None:
    """Each tool's parameters compiled as the grammar its calls' arguments follow (once:
    compiled grammars are kept), or an :class:`InvalidArgumentError` naming the tool
    (``places``: where each tool was given, as :func:`read_tools` names them)."""
    for i, tool in enumerate(tools):
        try:
            Grammar.json_schema(tool.parameters)
        except InvalidArgumentError as exc:
            at = f"{places[i] if i < len(places) else f'tools[{i}].function'}.parameters"
            raise InvalidArgumentError(f"{at}: {exc}", param=at) from None


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
                ],
                param="tool_choice",
            )
        if choice == "required" and not tools:
            raise InvalidArgumentError("tool_choice 'required' needs tools", param="tool_choice")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "none"
            raise InvalidArgumentError(
                f"tool_choice names the function {name!r}, which is not in tools (tools: {known})"[
                    :300
                ],
                param="tool_choice",
            )
        return ("function", name)
    raise InvalidArgumentError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', ...}",
        param="tool_choice",
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
