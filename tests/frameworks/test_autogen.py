"""AutoGen's ``AssistantAgent`` with a tool against ``kvrt serve``, at its defaults. AutoGen
needs ``model_info`` for a model it does not know: what kvrt's models can do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support.server import kvrt_serve

pytestmark = [pytest.mark.frameworks, pytest.mark.subprocess, pytest.mark.model]

MODEL_INFO: dict[str, Any] = {
    "vision": False,
    "function_calling": True,  # tools, with the grammar holding calls to their schemas
    "json_output": True,  # response_format json_object
    "structured_output": True,  # response_format json_schema
    "family": "unknown",
}


def test_an_autogen_assistant_agent_with_a_tool(tmp_path: Path) -> None:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    seen: list[dict[str, Any]] = []

    async def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append({"a": a, "b": b})
        return a + b

    class Calling(OpenAIChatCompletionClient):
        """The agent's client, its model told to call a tool where it is given tools
        (``tool_choice="required"``): whether a tiny model calls one on its own differs
        between CPUs (measured: SmolLM2 answered in text on two machines)."""

        async def create(self, messages: Any, **kwargs: Any) -> Any:
            if kwargs.get("tools"):
                kwargs["tool_choice"] = "required"
            return await super().create(messages, **kwargs)

    async def run(url: str) -> Any:
        client = Calling(
            model="smollm2",
            base_url=f"{url}/v1",
            api_key="unused",
            temperature=0,
            model_info=MODEL_INFO,  # type: ignore[arg-type]
        )
        agent = AssistantAgent(
            "calc", model_client=client, tools=[add], system_message="Use the add tool for sums."
        )
        try:
            return await agent.run(task="What is 3 + 4?")
        finally:
            await client.close()

    log = tmp_path / "serve.log"
    flags = ("--state", "none", "--model-name", "smollm2")
    with kvrt_serve(log, *flags, env={"KVRT_DISK_BUDGET": "0"}) as url:
        result = anyio.run(run, url, backend="asyncio")  # AutoGen calls asyncio directly
    kinds = [type(m).__name__ for m in result.messages]
    assert "ToolCallExecutionEvent" in kinds, kinds
    assert seen and set(seen[0]) == {"a", "b"}, seen  # declared keys only
