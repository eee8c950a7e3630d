"""kvrt's JSON envelope, for a model whose chat template knows no tools: the grammar a
reply follows (``{"tool_calls": [...]}`` or ``{"response": "..."}``), the envelope written
back as the model's turn, and a reply read as it is generated."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .grammar import Grammar
from .schemas import embed_schema, with_defs
from .tools import Tool, ToolCall, ToolCallDelta, ToolChoice, _dumps, canonical_arguments

__all__ = ["EnvelopeStream", "envelope_grammar", "new_call_id", "render_envelope"]


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
