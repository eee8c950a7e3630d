"""LlamaIndex and Instructor against kvrt in process, at their defaults, run by
``test_fresh_environment.py`` in an environment of their own (kvrt beside
``llama-index-llms-openai`` and ``instructor``, which pin the ``openai`` and ``jiter``
releases kvrt must leave them). Prints one JSON line of what happened."""

from __future__ import annotations

import json
from typing import Any

import anyio
import instructor
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.openai import OpenAI
from pydantic import BaseModel

import kvrt
import kvrt.serve

calls: list[dict[str, Any]] = []


def add(a: int, b: int) -> int:
    """Add two integers."""
    calls.append({"a": a, "b": b})
    return a + b


class Person(BaseModel):
    name: str
    age: int


class Address(BaseModel):
    street: str
    city: str


class Customer(BaseModel):
    name: str
    address: Address


async def prefilled(client: Any) -> int:
    metrics = str(await client.get("http://kvrt.in-process/metrics", cast_to=str))
    return int(float(metrics.split('kvrt_tokens_total{kind="prefilled"} ')[1].split()[0]))


async def main() -> None:
    config = kvrt.Config(disk=kvrt.DiskConfig(budget=0))
    # LlamaIndex's OpenAI class knows OpenAI's model names only: kvrt answers to one.
    serve = kvrt.serve.ServeConfig(model_name="gpt-4o-mini")
    async with (
        kvrt.open_runtime(config=config) as rt,
        kvrt.serve.openai_client(rt, serve) as client,
    ):
        llm = OpenAI(model=client.kvrt_model, async_openai_client=client, temperature=0)
        steps: list[int] = []
        create = client.chat.completions.create

        async def counted(*args: Any, **kwargs: Any) -> Any:
            # The agent's first step is told to call a tool (whether a tiny model calls
            # one on its own differs between CPUs); the steps after it are the model's.
            if kwargs.get("tools") and not steps:
                kwargs["tool_choice"] = "required"
            before = await prefilled(client)
            reply = await create(*args, **kwargs)
            if kwargs.get("stream"):

                async def drained() -> Any:
                    async for chunk in reply:
                        yield chunk
                    steps.append(await prefilled(client) - before)

                return drained()
            steps.append(await prefilled(client) - before)
            return reply

        client.chat.completions.create = counted
        agent = FunctionAgent(tools=[add], llm=llm, system_prompt="Use the add tool for sums.")
        answer = await agent.run("What is 3 + 4?")
        agent_steps = list(steps)
        person = await llm.astructured_predict(
            Person, PromptTemplate("Invent a person named {name}."), name="Ada"
        )
        patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
        customer = await patched.chat.completions.create(
            model=client.kvrt_model,
            response_model=Customer,
            messages=[{"role": "user", "content": "Invent a customer who lives in Paris."}],
            temperature=0,
            max_tokens=96,
        )
    print(
        json.dumps(
            {
                "calls": calls,
                "steps": agent_steps,
                "answer": str(answer),
                "person": person.model_dump(),
                "instructor": customer.model_dump(),
            }
        )
    )


anyio.run(main)
