"""Sync frameworks with kvrt in process, through the sync client (``kvrt.serve.
sync_openai_client``), each at its defaults: smolagents' ``ToolCallingAgent`` (it streams
its steps), DSPy at its defaults (``Predict`` with a typed output, ``ReAct``'s steps, through
LiteLLM) and Haystack's ``Agent``. No tool call carries a key its schema did not declare, and
no test asserts what the model freely chooses: where a framework's loop lets it answer
instead of calling, the call is asked for (``tool_choice``). (No ``from __future__ import annotations``: DSPy
reads the signature's field types at run time.)"""

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

import kvrt
import kvrt.serve
from tests.support.models import NO_DISK

pytestmark = [pytest.mark.frameworks, pytest.mark.model]

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")  # nothing leaves the machine


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with kvrt.serve.sync_openai_client(NO_DISK) as client:
        yield client


def _prefilled(client: Any) -> int:
    metrics = str(client.get("http://kvrt.in-process/metrics", cast_to=str))
    return int(float(metrics.split('kvrt_tokens_total{kind="prefilled"} ')[1].split()[0]))


def test_a_smolagents_tool_calling_agent_in_process(client: Any) -> None:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    seen: list[dict[str, Any]] = []

    @tool  # type: ignore[untyped-decorator]
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        seen.append({"a": a, "b": b})
        return a + b

    model = OpenAIServerModel(model_id=client.kvrt_model, api_key="in-process", temperature=0)
    model.client = client  # smolagents builds an openai.OpenAI; this one is kvrt in process
    agent = ToolCallingAgent(tools=[add], model=model, max_steps=2, verbosity_level=0)
    before = _prefilled(client)
    agent.run("What is 3 + 4? Use the add tool.")
    assert seen and set(seen[0]) == {"a", "b"}, seen  # declared keys only
    steps = [s for s in agent.memory.steps if getattr(s, "token_usage", None) is not None]
    assert len(steps) >= 2
    # each request sends the whole conversation again (three here, the first ~1,100 tokens):
    # kvrt computes what is new, not three prompts
    first = steps[0].token_usage.input_tokens
    assert _prefilled(client) - before < 2 * first, (_prefilled(client) - before, first)


def _dspy_lm(client: Any) -> Any:
    """DSPy's LM on kvrt in process, declared to LiteLLM as taking schemas and tools (what
    DSPy reads of a model), as docs/frameworks.md shows."""
    import dspy
    import litellm

    model = "openai/" + client.kvrt_model
    info = {
        "litellm_provider": "openai",
        "mode": "chat",
        "supports_response_schema": True,
        "supports_function_calling": True,
        "max_input_tokens": 8192,
    }
    litellm.register_model({model: info})
    return dspy.LM(
        model,
        api_key="in-process",
        api_base=str(client.base_url),
        engine="litellm",
        cache=False,
        temperature=0,
        max_tokens=200,
    )


def test_dspy_at_its_defaults_predicts_a_typed_output_in_process(client: Any) -> None:
    """DSPy's default adapter: its chat format first, then JSON under the signature's
    schema, which kvrt's grammar holds the reply to."""
    import dspy
    import litellm
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    class Invent(dspy.Signature):  # type: ignore[misc]
        """Invent a person."""

        hint: str = dspy.InputField()
        person: Person = dspy.OutputField()

    litellm.client_session = client.kvrt_http_client  # LiteLLM's calls go to kvrt in process
    try:
        lm = _dspy_lm(client)
        with dspy.context(lm=lm):
            person = dspy.Predict(Invent)(hint="a painter named Ada").person
        sent = [entry["kwargs"].get("response_format") for entry in lm.history]
    finally:
        litellm.client_session = None
    assert isinstance(person, Person) and person.name, person
    # The signature's schema (DSPy hands LiteLLM a pydantic model), not bare JSON mode
    assert sent[-1] not in (None, {"type": "json_object"}), sent


def test_dspy_react_steps_are_held_to_their_schema(client: Any) -> None:
    """``dspy.ReAct``'s steps under an adapter sending each signature's schema (open
    mappings included): every step names one of its tools, whatever the model writes."""
    import dspy
    import litellm
    import pydantic

    class SchemaAdapter(dspy.JSONAdapter):  # type: ignore[misc]
        def _prepare_response_format(self, lm: Any, lm_kwargs: Any, signature: Any) -> None:
            fields: dict[str, Any] = {
                n: (f.annotation, ...) for n, f in signature.output_fields.items()
            }
            schema = pydantic.create_model("Output", **fields).model_json_schema()
            lm_kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    litellm.client_session = client.kvrt_http_client
    try:
        lm = _dspy_lm(client)
        react = dspy.ReAct("question -> answer: int", tools=[add], max_iters=2)
        # A step cut at max_tokens does not parse: the model's doing, not kvrt's.
        with (
            dspy.context(lm=lm, adapter=SchemaAdapter()),
            contextlib.suppress(dspy.utils.exceptions.AdapterParseError),
        ):
            react(question="What is 3 + 4?")
        replies = [entry["outputs"][0] for entry in lm.history]
    finally:
        litellm.client_session = None
    # Each step's tool, where the reply got that far (a step may be cut in its thought).
    named = [m.group(1) for r in replies if (m := re.search(r'"next_tool_name": "(.*?)"', r))]
    assert named and set(named) <= {"add", "finish"}, replies


def test_a_haystack_agent_in_process(client: Any) -> None:
    from haystack.components.agents import Agent
    from haystack.components.generators.chat import OpenAIChatGenerator
    from haystack.dataclasses import ChatMessage
    from haystack.tools import tool
    from haystack.utils import Secret

    seen: list[dict[str, Any]] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append({"a": a, "b": b})
        return a + b

    # The model is told to call a tool and the agent ends once it has: whether a tiny
    # model calls one on its own differs between CPUs (SmolLM2 answered in text on one).
    generator = OpenAIChatGenerator(
        model=client.kvrt_model,
        api_key=Secret.from_token("in-process"),
        generation_kwargs={"temperature": 0, "max_tokens": 64, "tool_choice": "required"},
    )
    generator.client = client  # Haystack's sync calls go through this one
    agent = Agent(
        chat_generator=generator,
        tools=[add],
        system_prompt="Use the add tool for sums.",
        exit_conditions=["add"],
        max_agent_steps=3,
    )
    agent.warm_up()
    out = agent.run(messages=[ChatMessage.from_user("What is 3 + 4?")])
    assert seen and set(seen[0]) == {"a", "b"}, seen  # declared keys only
    (result,) = [m for m in out["messages"] if m.tool_call_result is not None]
    assert result.tool_call_result.result == str(sum(seen[0].values()))


def test_litellm_streams_tool_calls_its_own_assembler_reads(client: Any) -> None:
    """LiteLLM streaming a tool call, assembled by its own ``stream_chunk_builder``: the
    call whole, its arguments the declared keys, and the step after it computes the tool's
    turn only (the call's KV reused)."""
    import json

    import litellm

    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the add tool for sums."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    options: dict[str, Any] = {
        "model": "openai/" + client.kvrt_model,
        "api_base": str(client.base_url),
        "api_key": "in-process",
        "tools": [tool],
        "stream": True,
        "temperature": 0,
        "max_tokens": 64,
    }
    litellm.client_session = client.kvrt_http_client
    try:
        chunks = list(litellm.completion(messages=messages, tool_choice="required", **options))
        built: Any = litellm.stream_chunk_builder(chunks)
        (call,) = built.choices[0].message.tool_calls
        assert call.function.name == "add" and call.id
        assert json.loads(call.function.arguments) == {"a": 3, "b": 4}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": "add", "arguments": call.function.arguments}},
            ]},
            {"role": "tool", "tool_call_id": call.id, "content": "7"},
        ]  # fmt: skip
        before = _prefilled(client)
        list(litellm.completion(messages=messages, tool_choice="none", **options))
        assert _prefilled(client) - before < 30  # the tool's turn and the framing
    finally:
        litellm.client_session = None
