"""Agent frameworks against ``kvrt serve`` as a process: the openai client, the OpenAI
Agents SDK (Responses and Chat Completions), pydantic-ai, LangChain and LangGraph call
tools, get structured output and run tool loops — with an API key required.

The model is the embedded SmolLM2-135M: small, so the tests ask for what a grammar can
enforce (a call, its arguments, a schema) and check that every framework receives it in
the shape it expects.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.support.server import kvrt_serve

pytestmark = [pytest.mark.subprocess, pytest.mark.frameworks, pytest.mark.model]

KEY = "kvrt-test-key"


@dataclass
class Served:
    url: str
    model: str
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("agents") / "serve.log"
    key_file = log.with_name("key")
    key_file.write_text(KEY + "\n")
    env = {"PYTHONUNBUFFERED": "1", "KVRT_DISK_BUDGET": "0"}
    with kvrt_serve(log, "--api-key", f"@{key_file}", env=env) as url:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            model = json.loads(r.read())["model"]
        yield Served(url, model, log)


WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int


def test_a_key_is_required_on_every_route_but_health(served: Served) -> None:
    for path, data in [("/v1/models", None), ("/v1/chat/completions", b"{}"), ("/metrics", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            request = urllib.request.Request(f"{served.url}{path}", data=data, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=10)
            assert info.value.code == 401
            assert json.loads(info.value.read())["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(f"{served.url}/health", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0).models.list()


def test_the_openai_client_gets_tools_structured_output_and_logprobs(served: Served) -> None:
    c, model = served.client(), served.model
    choices: list[Any] = ["required", {"type": "function", "function": {"name": "get_weather"}}]
    for picked in choices:
        r = c.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=picked,
            max_tokens=64,
            temperature=0,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        calls: list[Any] = list(r.choices[0].message.tool_calls or [])
        assert calls and all(call.function.name == "get_weather" for call in calls)
        assert all(isinstance(json.loads(call.function.arguments)["city"], str) for call in calls)
    single = c.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0)  # fmt: skip
    assert len(single.choices[0].message.tool_calls or []) == 1
    plain = c.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content

    stream = c.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64,
        stream=True, temperature=0)  # fmt: skip
    assembled: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            entry = assembled.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            if d.id:
                entry["id"] = d.id
                entry["name"] = (d.function.name if d.function else None) or ""
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
    assert finish == "tool_calls" and assembled
    for entry in assembled.values():
        assert entry["id"].startswith("call_") and entry["name"] == "get_weather"
        assert isinstance(json.loads(entry["arguments"])["city"], str)

    parsed = c.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, max_tokens=64, temperature=0)  # fmt: skip
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.name
    obj = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": 'Answer with the object {"ok": true}.'}],
        response_format={"type": "json_object"}, max_tokens=64, temperature=0,
    )  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    lp = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
        top_logprobs=3, max_tokens=4, temperature=0,
    )  # fmt: skip
    content = lp.choices[0].logprobs.content if lp.choices[0].logprobs else None
    assert content and all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy


def test_the_responses_api_streamed_and_not(served: Served) -> None:
    c, model = served.client(), served.model
    tool: Any = {"type": "function", **WEATHER["function"]}
    first = c.responses.create(
        model=model,
        input="Say hello.",
        instructions="Be brief.",
        max_output_tokens=64,
        temperature=0,
    )
    assert first.output_text and first.usage is not None
    second = c.responses.create(  # instructions are not carried over: sent again
        model=model,
        input="And now goodbye.",
        instructions="Be brief.",
        previous_response_id=first.id,
        max_output_tokens=32,
        temperature=0,
    )
    assert second.usage is not None and second.previous_response_id == first.id
    # The conversation went on in the session that held it: its first turn was reused.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    called = c.responses.create(
        model=model,
        input="Weather in Rome?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    )
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    answer = c.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Weather in Rome?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": calls[0].name,
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C."},
        ],
        tools=[tool],
        max_output_tokens=64,
        temperature=0,
    )
    assert answer.status in ("completed", "incomplete")
    kinds: list[str] = []
    with c.responses.stream(
        model=model,
        input="Weather in Oslo?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"} <= set(kinds)  # fmt: skip
    streamed = [o for o in final.output if o.type == "function_call"]
    assert streamed and json.loads(streamed[0].arguments)["city"]
    with c.responses.stream(
        model=model, input="Say hi.", max_output_tokens=200, temperature=0
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert "".join(texts) == stream.get_final_response().output_text
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        c.responses.create(model=model, input="x", tools=[{"type": "web_search"}], temperature=0)
    with pytest.raises(openai.NotFoundError, match="is not kept"):
        c.responses.create(
            model=model, input="x", previous_response_id="resp_unknown", temperature=0
        )


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_openai_agents_sdk_agent_calls_its_tool(served: Served, api: str) -> None:
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        seen.append(city)
        return f"It is sunny in {city}."

    async def run() -> Any:
        kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(
            name="weather",
            instructions="Answer questions about the weather with the tool.",
            tools=[get_weather],
            model=kind(model=served.model, openai_client=served.async_client()),
            model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
            tool_use_behavior="stop_on_first_tool",
        )
        return (await Runner.run(agent, "What is the weather in Paris?")).final_output

    output = asyncio.run(run())
    assert seen and output == f"It is sunny in {seen[0]}."


def test_agents_sdk_conversations_and_handoffs(served: Served) -> None:
    """``conversation_id`` keeps the run's turns in a kvrt conversation (it was "conversation
    is not supported"); after a handoff the target agent, which has no tools, answers in
    text (it answered in kvrt's call envelope)."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    client = served.async_client()
    model = OpenAIResponsesModel(model=served.model, openai_client=client)
    settings = ModelSettings(max_tokens=160, temperature=0)

    async def run() -> None:
        brief = Agent(name="brief", instructions="Answer briefly.", model=model,
                      model_settings=settings)  # fmt: skip
        conv = await client.conversations.create()
        await Runner.run(brief, "Name a colour.", conversation_id=conv.id)
        await Runner.run(brief, "Reply with one word: yes.", conversation_id=conv.id)
        items = (await client.conversations.items.list(conv.id)).data
        assert [getattr(i, "role", None) for i in items] == ["user", "assistant"] * 2
        triage = Agent(
            name="triage",
            instructions="Hand every question to the expert.",
            model=model,
            handoffs=[brief],
            model_settings=ModelSettings(
                max_tokens=160, temperature=0, tool_choice="transfer_to_brief"
            ),
        )
        result = await Runner.run(triage, "Name a colour.")
        assert result.last_agent is brief
        assert isinstance(result.final_output, str) and result.final_output.strip()
        answer = result.final_output
        assert '"tool_calls"' not in answer and not answer.lstrip().startswith("{"), answer

    asyncio.run(run())


def test_pydantic_ai_agents_with_a_tool_and_with_structured_output(served: Served) -> None:
    import asyncio

    import pydantic_ai
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def model() -> OpenAIChatModel:
        provider = OpenAIProvider(base_url=f"{served.url}/v1", api_key=KEY)
        return OpenAIChatModel(served.model, provider=provider)

    settings: Any = {"max_tokens": 96, "temperature": 0}

    async def run() -> None:
        calls: list[str] = []
        agent = pydantic_ai.Agent(model(), instructions="Use the tool to answer.")

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Get the weather in a city."""
            calls.append(city)
            return f"Sunny in {city}."

        first = await agent.run(
            "What is the weather in Paris? Use the tool.", model_settings=settings
        )
        # Whether the model calls the tool is its own choice (one that differs between
        # CPUs): either path is checked.
        returned = [
            part
            for message in first.all_messages()
            for part in message.parts
            if isinstance(part, pydantic_ai.messages.ToolReturnPart)
        ]
        assert [r.content for r in returned] == [f"Sunny in {city}." for city in calls]
        assert isinstance(first.output, str) and first.output
        second = await agent.run(
            "And in Rome?", message_history=first.all_messages(), model_settings=settings
        )
        assert isinstance(second.output, str)

        for output in (pydantic_ai.ToolOutput(Person), pydantic_ai.NativeOutput(Person)):
            structured = pydantic_ai.Agent(model(), output_type=output)
            history: list[Any] = []
            for question in ("Invent a person.", "Another one.", "One more."):
                result = await structured.run(
                    question, message_history=history, model_settings=settings
                )
                assert isinstance(result.output, Person) and result.output.name
                history = result.all_messages()

    asyncio.run(run())


def test_langchain_tools_structured_output_and_a_langgraph_agent(served: Served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        return f"It is sunny in {city}."

    def llm() -> ChatOpenAI:
        return ChatOpenAI(
            base_url=f"{served.url}/v1",
            api_key=KEY,  # type: ignore[arg-type]
            model=served.model,
            max_tokens=96,  # type: ignore[call-arg]
            temperature=0,
        )

    message = llm().bind_tools([get_weather], tool_choice="get_weather").invoke(ASK[0]["content"])
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    person = llm().with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person) and person.name

    from langgraph.prebuilt import create_react_agent

    @tool(return_direct=True)
    def weather_report(city: str) -> str:
        """Get the weather in a city, as the answer."""
        return f"It is sunny in {city}."

    # The model is told to call the tool, whose result is the answer: whether a tiny
    # model calls one on its own differs between CPUs.
    forced = llm().bind_tools([weather_report], tool_choice="required")
    graph = create_react_agent(forced, [weather_report])
    out = graph.invoke({"messages": [("user", "What is the weather in Paris? Use the tool.")]})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage"], kinds
    (call,) = out["messages"][1].tool_calls
    assert out["messages"][-1].content == f"It is sunny in {call['args']['city']}."
