"""Agent frameworks' tool loops against ``kvrt serve``, at their defaults: tokens the
server computed for each model request of each loop, measured side by side in one run.

Each framework runs one agent with a weather tool over four user turns (each turn a tool
call and an answer: eight model requests), the history kept the framework's way: the
openai client resending the loop by hand with the arguments re-serialized as pydantic-ai
does, pydantic-ai (``message_history``), the OpenAI Agents SDK (``previous_response_id``,
on the Responses API), LangChain with LangGraph (``MemorySaver``), smolagents
(``agent.run(..., reset=False)``), LiteLLM streaming its tool calls (assembled by its own
``stream_chunk_builder``), DSPy's ``ReAct``, Haystack's ``Agent`` and AutoGen's
``AssistantAgent`` (each keeping its messages), and, where ``openai<3`` is installed,
LlamaIndex's ``FunctionAgent`` (one ``Context``, which keeps no history between runs) and
Instructor in tools mode, each against a server of its own. The server's own counter (``kvrt_tokens_total{kind="prefilled"}`` in
``/metrics``) is read after each request.

Run: ``python benchmarks/frameworks.py`` — from another checkout's folder
(``python /path/to/benchmarks/frameworks.py``) to measure that checkout's server. Figures
to read, not assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any

from benchmarks.tool_loop import compact, free_port, serve, tool_message

TURNS = ["Paris", "Rome", "Oslo", "Lima"]
PREFILLED = re.compile(r'kvrt_tokens_total\{kind="prefilled"\} (\d+)')


class Counter:
    """The server's prefilled-token counter, read after each model request."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.steps: list[int] = []
        self._last = self._read()

    def _read(self) -> int:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            found = PREFILLED.search(r.read().decode())
        return int(found.group(1)) if found else 0

    async def hook(self, response: Any) -> None:
        if response.request.url.path.endswith(("/chat/completions", "/responses")):
            await response.aread()
            await asyncio.to_thread(self.count)

    def sync_hook(self, response: Any) -> None:
        if response.request.url.path.endswith(("/chat/completions", "/responses")):
            response.read()
            self.count()

    def count(self) -> None:
        now = self._read()
        self.steps.append(now - self._last)
        self._last = now


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
"""The weather tool as the loops that write their own requests send it."""


def weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny, 21 C in {city}."


def counted_client(url: str, counter: Counter) -> Any:
    """An ``AsyncOpenAI`` whose every response is counted by ``counter``."""
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", http_client=counted_async_http(counter)
    )


def counted_async_http(counter: Counter) -> Any:
    """An async httpx client (openai's own flavour: ``httpx``, or ``httpx2`` in newer
    releases) whose every response is counted."""
    import openai

    return openai.DefaultAsyncHttpxClient(event_hooks={"response": [counter.hook]}, timeout=600)


def counted_sync_http(counter: Counter) -> Any:
    """A sync httpx client (openai's own flavour) whose every response is counted."""
    import openai

    return openai.DefaultHttpxClient(event_hooks={"response": [counter.sync_hook]}, timeout=600)


async def raw_openai(url: str, model: str, counter: Counter) -> None:
    client = counted_client(url, counter)
    messages: list[dict[str, Any]] = []
    for city in TURNS:
        messages.append({"role": "user", "content": f"What is the weather in {city}?"})
        for choice in ({"type": "function", "function": {"name": "weather"}}, "none"):
            r = await client.chat.completions.create(
                model=model, messages=messages, tools=[WEATHER_TOOL], tool_choice=choice,
                max_tokens=48, temperature=0,
            )  # fmt: skip
            message = r.choices[0].message
            if message.tool_calls:
                call = message.tool_calls[0]
                arguments = compact(call.function.arguments)
                said = json.loads(arguments).get("city", city)
                messages += tool_message(call.id, "weather", arguments, 0, result=weather(said))
            else:
                messages.append({"role": "assistant", "content": message.content or ""})


async def pydantic_ai_loop(url: str, model: str, counter: Counter) -> None:
    import pydantic_ai
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    chat = OpenAIChatModel(
        model, provider=OpenAIProvider(openai_client=counted_client(url, counter))
    )
    agent = pydantic_ai.Agent(chat, instructions="Answer with the weather tool.")
    agent.tool_plain(weather)
    history: list[Any] = []
    settings: Any = {"max_tokens": 48, "temperature": 0}
    for city in TURNS:
        result = await agent.run(
            f"What is the weather in {city}?", message_history=history, model_settings=settings
        )
        history = result.all_messages()


async def agents_sdk_loop(url: str, model: str, counter: Counter) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[function_tool(weather)],
        model=OpenAIResponsesModel(model=model, openai_client=counted_client(url, counter)),
        model_settings=ModelSettings(max_tokens=48, temperature=0),
        reset_tool_choice=True,
    )
    previous = None
    for city in TURNS:
        result = await Runner.run(
            agent, f"What is the weather in {city}?", previous_response_id=previous, max_turns=3
        )
        previous = result.last_response_id


async def langgraph_loop(url: str, model: str, counter: Counter) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.checkpoint.memory import MemorySaver
    from langgraph.prebuilt import create_react_agent

    client = counted_client(url, counter)
    llm = ChatOpenAI(
        model=model, api_key="unused",  # type: ignore[arg-type]
        root_async_client=client, async_client=client.chat.completions,
        max_tokens=48, temperature=0,  # type: ignore[call-arg]
    )  # fmt: skip
    graph = create_react_agent(llm, [tool(weather)], checkpointer=MemorySaver())
    config: Any = {"configurable": {"thread_id": "one"}, "recursion_limit": 6}
    for city in TURNS:
        await graph.ainvoke(
            {"messages": [("user", f"What is the weather in {city}?")]}, config=config
        )


async def smolagents_loop(url: str, model: str, counter: Counter) -> None:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool  # type: ignore[untyped-decorator]
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: the city
        """
        return weather(city)

    chat = OpenAIServerModel(
        model_id=model, api_base=f"{url}/v1", api_key="unused", max_tokens=48, temperature=0,
        client_kwargs={"http_client": counted_sync_http(counter)},
    )  # fmt: skip
    agent = ToolCallingAgent(tools=[get_weather], model=chat, max_steps=3, verbosity_level=0)

    def run() -> None:
        for i, city in enumerate(TURNS):
            agent.run(f"What is the weather in {city}?", reset=i == 0)

    await asyncio.to_thread(run)


async def litellm_streamed_loop(url: str, model: str, counter: Counter) -> None:
    import litellm

    def run() -> None:
        litellm.client_session = counted_sync_http(counter)
        messages: list[dict[str, Any]] = []
        for city in TURNS:
            messages.append({"role": "user", "content": f"What is the weather in {city}?"})
            for choice in ("required", "none"):
                chunks = list(
                    litellm.completion(
                        model="openai/" + model, api_base=f"{url}/v1", api_key="unused",
                        messages=messages, tools=[WEATHER_TOOL], tool_choice=choice, stream=True,
                        max_tokens=48, temperature=0,
                    )
                )  # fmt: skip
                built: Any = litellm.stream_chunk_builder(chunks)
                message = built.choices[0].message
                if message.tool_calls:
                    call = message.tool_calls[0]
                    said = json.loads(call.function.arguments).get("city", city)
                    messages += [
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": call.id, "type": "function", "function": {
                                "name": call.function.name,
                                "arguments": call.function.arguments}}]},
                        {"role": "tool", "tool_call_id": call.id, "content": weather(said)},
                    ]  # fmt: skip
                else:
                    messages.append({"role": "assistant", "content": message.content or ""})
        litellm.client_session = None

    await asyncio.to_thread(run)


async def dspy_react_loop(url: str, model: str, counter: Counter) -> None:
    import dspy
    import litellm

    def run() -> None:
        litellm.client_session = counted_sync_http(counter)
        lm = dspy.LM(
            "openai/" + model, api_base=f"{url}/v1", api_key="unused", engine="litellm",
            cache=False, temperature=0, max_tokens=96,
        )  # fmt: skip
        react = dspy.ReAct("question -> answer", tools=[weather], max_iters=2)
        with dspy.context(lm=lm):
            for city in TURNS:
                react(question=f"What is the weather in {city}?")
        litellm.client_session = None

    await asyncio.to_thread(run)


async def haystack_loop(url: str, model: str, counter: Counter) -> None:
    from haystack.components.agents import Agent
    from haystack.components.generators.chat import OpenAIChatGenerator
    from haystack.dataclasses import ChatMessage, ChatRole
    from haystack.tools import tool
    from haystack.utils import Secret

    def run() -> None:
        generator = OpenAIChatGenerator(
            model=model, api_key=Secret.from_token("unused"), api_base_url=f"{url}/v1",
            generation_kwargs={"temperature": 0, "max_tokens": 48},
            http_client_kwargs={"event_hooks": {"response": [counter.sync_hook]}},
        )  # fmt: skip
        agent = Agent(
            chat_generator=generator, tools=[tool(weather)],
            system_prompt="Answer with the weather tool.", max_agent_steps=3,
        )  # fmt: skip
        agent.warm_up()
        messages: list[Any] = []
        for city in TURNS:
            messages.append(ChatMessage.from_user(f"What is the weather in {city}?"))
            # the agent's messages begin with its system prompt, which each run adds again
            kept = agent.run(messages=messages)["messages"]
            messages = [m for m in kept if not m.is_from(ChatRole.SYSTEM)]

    await asyncio.to_thread(run)


async def autogen_loop(url: str, model: str, counter: Counter) -> None:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    # http_client reaches AsyncOpenAI (AutoGen passes on its keyword arguments), untyped
    client = OpenAIChatCompletionClient(  # type: ignore[call-arg]
        model=model, base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=48,
        model_info={"vision": False, "function_calling": True, "json_output": True,
                    "structured_output": True, "family": "unknown"},
        http_client=counted_async_http(counter),
    )  # fmt: skip
    agent = AssistantAgent(
        "weather", model_client=client, tools=[weather],
        system_message="Answer with the weather tool.",
    )  # fmt: skip
    try:
        for city in TURNS:  # the agent keeps its own history between runs
            await agent.run(task=f"What is the weather in {city}?")
    finally:
        await client.close()


async def llama_index_loop(url: str, model: str, counter: Counter) -> None:
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.workflow import Context
    from llama_index.llms.openai import OpenAI

    llm = OpenAI(
        model=model, async_openai_client=counted_client(url, counter), temperature=0,
        max_tokens=48,
    )  # fmt: skip
    agent = FunctionAgent(tools=[weather], llm=llm, system_prompt="Answer with the weather tool.")
    context = Context(agent)
    for city in TURNS:
        await agent.run(f"What is the weather in {city}?", ctx=context)


async def instructor_loop(url: str, model: str, counter: Counter) -> None:
    import instructor
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        sky: str

    patched = instructor.from_openai(counted_client(url, counter), mode=instructor.Mode.TOOLS)
    messages: list[dict[str, Any]] = []
    for city in TURNS:
        messages.append({"role": "user", "content": f"Describe the weather in {city}."})
        reply = await patched.chat.completions.create(
            model=model, response_model=Weather, messages=messages, temperature=0,
            max_tokens=48,
        )  # fmt: skip
        messages.append({"role": "assistant", "content": reply.model_dump_json()})


LOOPS: dict[str, Callable[[str, str, Counter], Coroutine[Any, Any, None]]] = {
    "openai client, re-serialized calls": raw_openai,
    "pydantic-ai": pydantic_ai_loop,
    "Agents SDK (Responses)": agents_sdk_loop,
    "LangGraph": langgraph_loop,
    "smolagents ToolCallingAgent": smolagents_loop,
    "LiteLLM, streamed tool calls": litellm_streamed_loop,
    "DSPy ReAct": dspy_react_loop,
    "Haystack Agent": haystack_loop,
    "AutoGen AssistantAgent": autogen_loop,
    # These two need ``openai<3``: run them from an environment of their own with
    # ``llama-index-llms-openai`` and ``instructor`` (``--only llamaindex,instructor``).
    "LlamaIndex FunctionAgent": llama_index_loop,
    "Instructor, tools mode": instructor_loop,
}


# LlamaIndex's OpenAI class knows OpenAI's model names only (it looks up their windows).
SERVE_FLAGS: dict[str, list[str]] = {"LlamaIndex FunctionAgent": ["--model-name", "gpt-4o-mini"]}


def measure(name: str, loop: Callable[[str, str, Counter], Coroutine[Any, Any, None]]) -> None:
    """One framework's loop against a server of its own (nothing cached by another)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvrt", "serve", "--port", str(port), "--disk-budget", "0"]
    command += ["--session-tokens", "4096", *SERVE_FLAGS.get(name, [])]
    with tempfile.TemporaryFile() as log:
        proc = serve(command, port, log)
        try:
            with urllib.request.urlopen(f"{url}/v1/models") as r:
                model = json.loads(r.read())["data"][0]["id"]
            counter = Counter(url)
            try:
                asyncio.run(loop(url, model, counter))
                note = ""
            except ImportError as exc:
                print(f"\n{name}: skipped ({exc.name} is not installed in this environment)")
                return
            except Exception as exc:  # a framework that fails is reported, not fatal
                note = f" (stopped: {type(exc).__name__}: {str(exc)[:80]})"
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    steps = counter.steps
    later = steps[1:]
    mean = sum(later) / len(later) if later else 0.0
    print(f"\n{name}: {len(steps)} requests{note}")
    print("  " + " ".join(f"{n}" for n in steps))
    print(f"  first {steps[0] if steps else 0}, then {mean:.1f} a request on average")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", default="", help="comma-separated parts of framework names (e.g. haystack,dspy)"
    )
    wanted = [w.strip().lower() for w in parser.parse_args().only.split(",") if w.strip()]
    print("tokens computed by kvrt serve for each model request, in order")
    for name, loop in LOOPS.items():
        squashed = name.lower().replace(" ", "")
        if not wanted or any(w.replace(" ", "") in squashed for w in wanted):
            measure(name, loop)


if __name__ == "__main__":
    main()
