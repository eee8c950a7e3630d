"""Structured output and tool calls in process, on both engines: what the grammar enforces
holds on every output, tool loops compute only what is new, bad requests are clear errors.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

import kvrt
from tests.support.models import NO_DISK, loaded, tiny

pytestmark = [pytest.mark.anyio, pytest.mark.model]


@pytest.fixture(params=["llama", "openvino"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

SCHEMAS: list[dict[str, Any]] = [
    PERSON,
    {
        "type": "object",
        "maxProperties": 3,
        "additionalProperties": {"type": "string", "maxLength": 24},
    },
    {  # an open object: other properties allowed, bounded so a reply cannot ramble on
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": {"type": "string", "maxLength": 40},
        "maxProperties": 3,
    },
    {"type": "array", "items": {"type": "integer", "maximum": 999}, "minItems": 2, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "integer", "minimum": 3, "maximum": 9},
    {
        "type": "object",
        "properties": {"price": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["price"],
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {  # pydantic's shape: $defs and $ref, titles, an optional field
        "$defs": {
            "Address": {
                "properties": {"city": {"title": "City", "type": "string", "maxLength": 30}},
                "required": ["city"],
                "title": "Address",
                "type": "object",
                "additionalProperties": False,
            }
        },
        "properties": {
            "name": {"title": "Name", "type": "string", "maxLength": 30},
            "home": {"$ref": "#/$defs/Address"},
            "nick": {
                "anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}],
                "default": None,
            },
        },
        "required": ["name", "home", "nick"],
        "title": "Person",
        "type": "object",
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "maximum": 99}},
        "required": ["kind", "x"],
    },
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "maximum": 999}},
            "required": ["id"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
    {  # nested objects, closed at every level
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "string", "maxLength": 16}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {"type": "string", "minLength": 2, "maxLength": 8},
    {
        "oneOf": [
            {
                "type": "object",
                "properties": {"cat": {"type": "string", "maxLength": 16}},
                "required": ["cat"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"dog": {"type": "string", "maxLength": 16}},
                "required": ["dog"],
                "additionalProperties": False,
            },
        ]
    },
    {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}},
        "required": ["when"],
    },
    {"type": "boolean"},
    {
        "type": "object",
        "additionalProperties": {"type": "integer", "maximum": 99},
        "maxProperties": 3,
    },
    {"enum": [1, "two", None, True]},
]


async def test_constrained_output_matches_its_schema_every_time(backend: str) -> None:
    """Twenty schemas as pydantic and the OpenAI SDK write them: every output parses and
    validates, and generation ends when the JSON is complete."""
    async with (
        kvrt.open_runtime(engine=loaded(backend), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        for i, schema in enumerate(SCHEMAS):
            done = await s.chat(
                [{"role": "user", "content": f"Give me example {i} as JSON."}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": f"s{i}", "schema": schema},
                },
                max_tokens=160,
            )
            assert done.finish_reason in ("stop", "eos"), (i, done.finish_reason, done.text)
            jsonschema.validate(json.loads(done.text), schema)
        regex = kvrt.Grammar.regex(r"[0-9]{3}-[0-9]{4}")
        await s.ensure_context([kvrt.Segment("q", "A phone number: ")])
        done = await s.generate(max_tokens=20, grammar=regex)
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", done.text), done.text
        lark = kvrt.Grammar.lark('start: "yes" | "no"')
        done = await s.generate(max_tokens=8, grammar=lark)
        assert done.text in ("yes", "no") and done.finish_reason == "stop"
        gbnf = kvrt.Grammar.gbnf('root ::= "A" [0-9] [0-9]')
        done = await s.generate(max_tokens=8, grammar=gbnf)
        assert re.fullmatch(r"A[0-9]{2}", done.text), done.text


def test_what_the_grammar_cannot_enforce_is_refused_naming_it() -> None:
    for schema, keyword in [
        ({"not": {"type": "string"}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if, then"),
        ({"dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ]:
        with pytest.raises(kvrt.InvalidArgumentError, match=f"uses {keyword}, which constrained"):
            kvrt.Grammar.json_schema(schema)
    with pytest.raises(kvrt.InvalidArgumentError, match="Invalid type: nope"):
        kvrt.Grammar.json_schema({"type": "nope"})
    with pytest.raises(kvrt.InvalidArgumentError, match="unclosed group"):
        kvrt.Grammar.regex("(unclosed")
    with pytest.raises(kvrt.InvalidArgumentError, match='unknown name: "foo"'):
        kvrt.Grammar.lark("start: foo")
    with pytest.raises(kvrt.ArgumentTypeError, match="must be a mapping"):
        kvrt.Grammar.json_schema(["not", "a", "schema"])
    with pytest.raises(kvrt.InvalidArgumentError, match="not valid JSON"):
        kvrt.Grammar.json_schema("{oops")
    with pytest.raises(kvrt.InvalidArgumentError, match=r"response_format\.type must be"):
        kvrt.read_response_format({"type": "xml"})


def _accepts(grammar: kvrt.Grammar, text: str) -> bool:
    """Whether constrained decoding may write ``text`` whole, token by token."""
    from kvrt._chat.grammar import Constraint

    engine = loaded("llama")
    constraint = Constraint(engine, grammar)
    for token in engine.tokenize(text, add_special=False, parse_special=False):
        if not constraint.allowed()[token]:
            return False
        constraint.consume(token)
    return constraint.complete


def test_arguments_and_answers_hold_only_the_keys_their_schema_declares() -> None:
    """A schema without ``additionalProperties`` is closed, as OpenAI's strict mode reads
    it (small models wrote ``"c.size"``, ``"street_address"``); one that allows other keys
    keeps them."""
    from kvrt._chat.call_formats import Tagged

    address = {"type": "object", "properties": {"street": {"type": "string"}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "home": address}}
    answer = kvrt.Grammar.json_schema(schema)
    assert _accepts(answer, '{"a": 1, "home": {"street": "x"}}')
    assert not _accepts(answer, '{"a": 1, "b": 2}')
    assert not _accepts(answer, '{"home": {"street": "x", "street_address": "y"}}')
    opened = kvrt.Grammar.json_schema({**schema, "additionalProperties": {"type": "integer"}})
    assert _accepts(opened, '{"a": 1, "b": 2}')
    tools = kvrt.read_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    calls = Tagged().grammar(tools, "required", parallel=False, response_schema=None)
    assert calls is not None

    def call(arguments: str) -> str:
        return '<tool_call>\n{"name": "f", "arguments": ' + arguments + "}\n</tool_call>"

    assert _accepts(calls, call('{"a": 3}'))
    assert not _accepts(calls, call('{"a": 3, "c": 4}'))


WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


def valid(call: kvrt.ToolCall) -> None:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(json.loads(call.arguments), schema[call.name])


async def test_every_tool_choice_is_enforced(backend: str) -> None:
    async with (
        kvrt.open_runtime(engine=loaded(backend), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=2048) as s,
    ):
        tools = [WEATHER, TIME]
        required = await s.chat(ASK, tools=tools, tool_choice="required", max_tokens=96)
        assert required.finish_reason == "tool_calls" and required.tool_calls
        assert required.text == "" and required.raw_text.startswith('{"tool_calls": [')
        for call in required.tool_calls:
            valid(call)
        named = await s.chat(
            ASK,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=96,
        )
        assert named.tool_calls and {c.name for c in named.tool_calls} == {"get_time"}
        one = await s.chat(
            ASK, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=96
        )
        assert len(one.tool_calls) == 1
        valid(one.tool_calls[0])
        none = await s.chat(ASK, tools=tools, tool_choice="none", max_tokens=24)
        assert not none.tool_calls and none.finish_reason in ("length", "eos", "stop")
        ids = [c.id for c in required.tool_calls + named.tool_calls + one.tool_calls]
        assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)

        # Streamed: the deltas make the same calls as the completion.
        reply = s.chat(ASK, tools=tools, tool_choice="required", max_tokens=96)
        calls: dict[int, dict[str, str]] = {}
        async for piece in reply:
            assert piece.text == ""  # no content in a reply that calls tools
            for delta in piece.tool_calls:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id is not None:
                    entry.update(id=delta.id, name=delta.name or "")
                entry["arguments"] += delta.arguments
        done = await reply
        assert [(c.id, c.name, c.arguments) for c in done.tool_calls] == [
            (calls[i]["id"], calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)
        ]


async def test_bad_tool_requests_are_clear_errors() -> None:
    async with (
        kvrt.open_runtime(engine=loaded("llama"), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        bad: list[tuple[dict[str, Any], type[Exception], str]] = [
            (
                {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                kvrt.InvalidArgumentError,
                "names the function 'nope', which is not in tools",
            ),
            ({"tool_choice": "sometimes"}, kvrt.InvalidArgumentError, "tool_choice must be"),
            (
                {"tools": [{"type": "retrieval"}]},
                kvrt.InvalidArgumentError,
                r"tools\[0\].type 'retrieval' is not supported",
            ),
            (
                {"tools": [{"type": "function", "function": {"name": "a b"}}]},
                kvrt.InvalidArgumentError,
                "A-Z, a-z, 0-9",
            ),
            (
                {"tools": [WEATHER, WEATHER]},
                kvrt.InvalidArgumentError,
                "two tools are named 'get_weather'",
            ),
            (
                {
                    "tools": [
                        {
                            "type": "function",
                            "function": {"name": "f", "parameters": {"type": "object", "not": {}}},
                        }
                    ]
                },
                kvrt.InvalidArgumentError,
                "uses not",
            ),
            ({"tools": "get_weather"}, kvrt.ArgumentTypeError, "tools must be a list"),
            (
                {"response_format": {"type": "json_schema", "json_schema": {}}},
                kvrt.InvalidArgumentError,
                "schema must be a JSON Schema object",
            ),
            (
                {"tools": [WEATHER], "response_format": {"type": "regex", "regex": "a+"}},
                kvrt.InvalidArgumentError,
                "cannot be combined with tool calls",
            ),
            ({"logprobs": 99}, kvrt.InvalidArgumentError, "logprobs must be"),
        ]
        for kwargs, error, message in bad:
            with pytest.raises(error, match=message):
                s.chat(ASK, **kwargs)
        with pytest.raises(kvrt.InvalidArgumentError, match="tool_choice 'required' needs tools"):
            s.chat(ASK, tool_choice="required")
        await s.chat(ASK, max_tokens=2)  # the session serves on


async def test_tools_on_a_model_without_a_chat_template_are_refused(gemma_path: str) -> None:
    config = kvrt.Config(engine=kvrt.EngineConfig(model=gemma_path), disk=NO_DISK.disk)
    async with (
        kvrt.open_runtime("llama", config=config) as rt,
        rt.open_session(hot_tokens=512) as s,
    ):
        with pytest.raises(
            kvrt.InvalidArgumentError, match=r"no chat template .* cannot be given tools"
        ):
            s.chat(ASK, tools=[WEATHER])


@pytest.mark.slow
async def test_a_ten_step_tool_loop_computes_only_what_is_new(backend: str) -> None:
    """Each step sends the whole loop back (the calls as structured tool_calls, as
    frameworks do): the session computes the new tool result and the template's framing,
    and reuses the rest, its own calls included."""
    cities = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Quito", "Bern", "Doha", "Riga", "Baku"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    computed: list[int] = []
    async with (
        kvrt.open_runtime(engine=loaded(backend), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=4096) as s,
    ):
        for step in range(10):
            done = await s.chat(
                messages,
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=64,
            )
            assert done.tool_calls, done.raw_text
            prompt = done.usage.prompt
            assert prompt.reused + prompt.prefilled + prompt.restored == done.usage.prompt_tokens
            computed.append(prompt.prefilled)
            call = done.tool_calls[0]
            valid(call)
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": f"Sunny, 21 C in {cities[step]}.",
                },
            ]
        # The last step answers (tool_choice "none", as a framework ends its loop): the
        # prompt keeps its tools, so it reuses the loop too, and the answer is text.
        done = await s.chat(messages, tools=[WEATHER], tool_choice="none", max_tokens=32)
        assert not done.tool_calls and not done.text.lstrip().startswith("{"), done.raw_text
        computed.append(done.usage.prompt.prefilled)
    new = [
        len(rt.engine.tokenize(f"Result of get_weather: Sunny, 21 C in {c}.", add_special=False))
        for c in cities
    ]
    print("\ntokens computed per step:", computed, "(tool results:", new, ")")
    # After the first step, each computes its tool result and at most 12 tokens of
    # framing (end of the assistant turn, the user header, the assistant header).
    for step in range(1, 11):
        assert computed[step] <= new[step - 1] + 12, (step, computed, new)


async def test_logprobs_are_the_models_after_the_mask(backend: str) -> None:
    async with (
        kvrt.open_runtime(engine=loaded(backend), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        done = await s.chat([{"role": "user", "content": "Hi"}], max_tokens=6, logprobs=3)
        assert done.logprobs is not None and len(done.logprobs) == len(done.tokens)
        for t, token in zip(done.logprobs, done.tokens, strict=True):
            assert t.token == token and t.logprob <= 0.0 and len(t.top) == 3
            assert [a.logprob for a in t.top] == sorted((a.logprob for a in t.top), reverse=True)
            assert t.top[0].token == token  # greedy: the likeliest is the one chosen
        constrained = await s.chat(
            [{"role": "user", "content": "Yes or no?"}],
            response_format={"type": "grammar", "grammar": 'start: "yes" | "no"'},
            max_tokens=4,
            logprobs=5,
        )
        assert constrained.logprobs is not None
        for t in constrained.logprobs:  # only tokens the grammar allowed were candidates
            assert all(
                a.text and ("yes".startswith(a.text) or "no".startswith(a.text)) for a in t.top
            )
            assert abs(sum(2.718281828**a.logprob for a in t.top) - 1.0) < 1e-3


def nested_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """A tool's parameters and a response format as pydantic writes nested models:
    ``$defs`` at the root and ``$ref`` to them, one of them recursive."""
    import pydantic

    class Address(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=20)
        home: Address
        manager: Person | None = None

    class Order(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        item: str = pydantic.Field(max_length=20)
        ship_to: Address

    return Person.model_json_schema(), Order.model_json_schema()


@pytest.mark.parametrize("anyio_backend", ["trio"])  # about the grammar, not the loop
async def test_nested_schemas_work_as_tool_parameters(anyio_backend: str) -> None:
    """A tool whose parameters use ``$defs``/``$ref`` (every nested pydantic model) works
    as it does as a response format, beside other such tools and a response format of
    its own (the references were resolved against the envelope's root: a 400)."""
    from kvrt._chat.call_formats import JsonCall, Tagged
    from kvrt._chat.grammar import _compile

    person, order = nested_schemas()
    assert "$defs" in person and "$defs" in order
    tools = [
        {"type": "function", "function": {"name": "add_person", "parameters": person}},
        {"type": "function", "function": {"name": "place_order", "parameters": order}},
    ]
    async with (
        kvrt.open_runtime(engine=loaded("llama"), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        ask = [{"role": "user", "content": "Add Ada, who lives in Paris, France."}]
        for choice in ("required", {"type": "function", "function": {"name": "place_order"}}):
            done = await s.chat(ask, tools=tools, tool_choice=choice, max_tokens=160)
            assert done.finish_reason == "tool_calls" and done.tool_calls, done.raw_text
            for call in done.tool_calls:
                schema = person if call.name == "add_person" else order
                jsonschema.validate(json.loads(call.arguments), schema)
        fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": order}}
        done = await s.chat(ask, tools=tools, response_format=fmt, max_tokens=160)
        if done.tool_calls:
            for call in done.tool_calls:
                schema = person if call.name == "add_person" else order
                jsonschema.validate(json.loads(call.arguments), schema)
        else:
            jsonschema.validate(json.loads(done.text), order)
    # The templates' own call formats compile them too.
    read = kvrt.read_tools(tools)
    for format_ in (Tagged(), JsonCall(names=("add_person", "place_order"))):
        grammar = format_.grammar(read, "auto", parallel=True, response_schema=order)
        assert grammar is not None
        _compile(grammar.kind, grammar.source)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_numbers_a_schema_leaves_unbounded_end(anyio_backend: str) -> None:
    """An ``integer`` or ``number`` with no bound gets llama.cpp's: 16 digits before the
    point (10 after it); a greedy model asked for pi wrote digits until its token limit
    (60 of 60 tokens, 56 digits). Bounds the schema sets are kept."""
    ask = [
        {"role": "user", "content": "Write the number pi with all the digits you know, as JSON."}
    ]
    async with (
        kvrt.open_runtime(engine=loaded("llama"), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        for kind, bounds in (("number", {}), ("integer", {}), ("integer", {"minimum": 3})):
            schema = {
                "type": "object",
                "properties": {"x": {"type": kind, **bounds}},
                "required": ["x"],
                "additionalProperties": False,
            }
            fmt = {"type": "json_schema", "json_schema": {"name": "pi", "schema": schema}}
            done = await s.chat(ask, response_format=fmt, max_tokens=60, temperature=0)
            assert done.finish_reason == "stop", (kind, done.text)
            value = json.loads(done.text)["x"]
            jsonschema.validate({"x": value}, schema)
            whole, _, fraction = str(abs(value)).partition(".")
            assert len(whole) <= 16 and len(fraction) <= 10, done.text


def test_a_reply_ends_at_its_first_repeated_call() -> None:
    """A call identical to an earlier one of the reply is dropped and ends the reply
    (generation stops on ``repeated``): a model repeating one call went on to its token
    limit, reported as one call with every token spent."""
    from kvrt._chat.call_formats import Tagged
    from kvrt._chat.envelope import EnvelopeStream

    call = '{"name": "f", "arguments": {"a": 1}}'
    other = '{"name": "f", "arguments": {"a": 2}}'
    envelope = EnvelopeStream(wrapped=True)
    list(envelope.feed('{"tool_calls": [' + call + ", " + other))
    assert not envelope.repeated and len(envelope.calls) == 2
    list(envelope.feed(", " + call))
    assert envelope.repeated and len(envelope.calls) == 2
    tagged = Tagged().stream()
    list(tagged.feed(f"<tool_call>\n{call}\n</tool_call>\n"))
    assert not tagged.repeated
    list(tagged.feed(f"<tool_call>\n{call}\n</tool_call>"))
    assert tagged.repeated and len(tagged.calls) == 1


ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add(a: 'int', b: 'int') -> 'int'\nAdd two integers.",
        "parameters": {
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "type": "object",
        },
    },
}


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_reply_cut_at_a_repeated_call_is_reused_when_sent_back(
    anyio_backend: str,
) -> None:
    """SmolLM2 under parallel calls writes its call, then begins the same call again (as
    LlamaIndex's agent asks, ``parallel_tool_calls`` on): the reply ends there and is sent
    back as one call, a closed envelope. Its KV is reused up to where the two texts part,
    so the next step computes the envelope's close and the tool's turn only (it computed
    the whole call again: 45 tokens a step instead of 19)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the add tool for sums."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    options: dict[str, Any] = {"tools": [ADD], "parallel_tool_calls": True, "temperature": 0}
    async with (
        kvrt.open_runtime(engine=loaded("llama"), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=4096) as s,
    ):
        first = await s.chat(messages, max_tokens=64, **options)
        (call,) = first.tool_calls
        assert json.loads(call.arguments) == {"a": 3, "b": 4}
        # the path under test: the model began the call a second time
        assert first.raw_text.count('"name": "add"') == 2, first.raw_text
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": "add", "arguments": call.arguments}},
            ]},
            {"role": "tool", "tool_call_id": call.id, "content": "7"},
        ]  # fmt: skip
        second = await s.chat(messages, max_tokens=8, **options)
        prompt = second.usage.prompt
        assert prompt.reused >= first.usage.prompt_tokens + 20, prompt
        assert prompt.prefilled < 24, prompt


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_calls_sent_back_re_serialized_are_reused_and_edited_ones_placed(
    anyio_backend: str,
) -> None:
    """Arguments are compared in one canonical form: a call sent back re-serialized (as
    pydantic-ai does, ``{"city":"Paris"}``) is the call that was generated, and its KV is
    reused (each step computed the whole turn again); one sent back with edited arguments
    is placed as sent (it was placed with the generated ones, the edit dropped)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]

    def sent_back(call: kvrt.ToolCall, arguments: str, result: str) -> list[dict[str, Any]]:
        function = {"name": call.name, "arguments": arguments}
        return [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": function}
            ]},
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ]  # fmt: skip

    async with (
        kvrt.open_runtime(engine=loaded("llama"), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=4096) as s,
    ):

        async def step() -> tuple[kvrt.ToolCall, int]:
            done = await s.chat(
                messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                max_tokens=64,
            )  # fmt: skip
            assert done.tool_calls, done.raw_text
            return done.tool_calls[0], done.usage.prompt.prefilled

        call, _ = await step()
        compact = json.dumps(json.loads(call.arguments), separators=(",", ":"))
        assert compact != call.arguments
        result = "Sunny, 21 C."
        messages += sent_back(call, compact, result)
        call, computed = await step()
        new = len(rt.engine.tokenize(f"Result of get_weather: {result}", add_special=False))
        assert computed <= new + 12, computed  # the call reused, re-serialized or not

        edited = json.dumps({**json.loads(call.arguments), "city": "Reykjavik"})
        messages += sent_back(call, edited, result)
        _, computed = await step()
        call_tokens = len(rt.engine.tokenize(edited, add_special=False))
        assert computed > new + call_tokens, computed  # the edited call computed as sent


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_turn_without_tools_answers_in_text_after_calls(anyio_backend: str) -> None:
    """After a handoff the agent handed to has no tools: earlier calls are shown to it as
    text, so it answers in text (shown in kvrt's envelope, they taught it to answer with
    ``{"tool_calls": [{"name": "transfer_to_...``)."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "transfer_to_weather_agent", "arguments": "{}"},
    }
    messages: list[Any] = [
        {"role": "system", "content": "You are a helpful weather agent."},
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"assistant": "Weather agent"}'},
    ]
    async with (
        kvrt.open_runtime(engine=loaded("llama"), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=2048) as s,
    ):
        done = await s.chat(messages, max_tokens=24, temperature=0)
        assert done.text.strip() and not done.text.lstrip().startswith("{"), done.text
        assert "tool_calls" not in done.text


PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "enum": [7]}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}
"""A tool whose one call is one text: its grammar admits nothing else."""


async def test_two_generations_of_one_call_text_keep_their_own_tokens(anyio_backend: str) -> None:
    """A tool loop that calls the same tool with the same arguments twice (LlamaIndex's,
    at times): the two replies come back as one text, generated as different tokens (the
    second repeated its call, was cut there and is sent back as its distinct call). Each
    is placed with its own tokens, so the next step computes only what is new."""
    engine = tiny("llama")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Ping twice."}]
    done: list[kvrt.Completion] = []
    async with (
        kvrt.open_runtime(engine=engine, config=NO_DISK) as rt,
        rt.open_session(hot_tokens=2048) as session,
    ):
        # One call, its envelope closed by the grammar; then calls that repeat themselves.
        for parallel in (False, True):
            got = await session.chat(
                messages,
                tools=[PING],
                tool_choice="required",
                parallel_tool_calls=parallel,
                max_tokens=96,
            )
            done.append(got)
            (call,) = got.tool_calls
            asked = {"name": call.name, "arguments": call.arguments}
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call.id, "type": "function", "function": asked}],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "pong"})
        messages.append({"role": "user", "content": "Thanks."})
        after = await session.chat(messages, tools=[PING], tool_choice="none", max_tokens=1)
    assert [c.tool_calls[0].arguments for c in done] == ['{"n": 7}'] * 2
    assert done[0].tokens != done[1].tokens  # the second was cut at its repeated call
    # The new tool result, the user's turn and the reply's header: not the first call.
    assert after.usage.prefilled_tokens < 40, after.usage


NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"s": {"type": "string", "maxLength": 3}},
            "required": ["s"],
            "additionalProperties": False,
        },
    },
}


async def test_a_named_function_is_one_call_and_a_cut_reply_says_length(
    anyio_backend: str,
) -> None:
    """``tool_choice`` naming a function makes one call unless ``parallel_tool_calls``
    asks for more (as OpenAI does); a reply that ``max_tokens`` cuts inside a later call
    finishes ``length``, with the calls it completed, never ``tool_calls``. The tiny
    model's free choice is taken away: every token holding ``]`` is banned, so where the
    grammar lets a reply go on it makes another call."""
    engine = tiny("llama")
    banned = {t: -100.0 for t in range(engine.facts.n_vocab) if b"]" in engine.token_bytes(t)}
    sampling = kvrt.SamplingParams(temperature=0.0, logit_bias=banned)
    named = {"type": "function", "function": {"name": "note"}}
    messages = [{"role": "user", "content": "Take three notes."}]
    async with (
        kvrt.open_runtime(engine=engine, config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024) as session,
    ):
        one = await session.chat(
            messages, tools=[NOTE], tool_choice=named, sampling=sampling, max_tokens=200
        )
        several = await session.chat(
            messages,
            tools=[NOTE],
            tool_choice=named,
            parallel_tool_calls=True,
            sampling=sampling,
            max_tokens=200,
        )
        pieces = [
            p
            async for p in session.chat(
                messages, tools=[NOTE], tool_choice="required", sampling=sampling, max_tokens=60
            )
        ]
        first = next(i for i, p in enumerate(pieces) if p.tool_calls)
        cut = await session.chat(
            messages,
            tools=[NOTE],
            tool_choice="required",
            sampling=sampling,
            max_tokens=first + 4,
        )
    assert len(one.tool_calls) == 1 and one.finish_reason == "tool_calls", one
    assert len(several.tool_calls) > 1, several
    assert cut.finish_reason == "length" and len(cut.tool_calls) == 1, cut
