"""kvrt's app in process through ``kvrt.serve.openai_client`` and its sync twins: the real
``openai`` clients and the frameworks that take one (pydantic-ai, the Agents SDK,
LangChain), with streams that stream. The clients run under asyncio and trio; the
frameworks call asyncio directly, so they run on asyncio only."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

import kvrt
import kvrt.serve
from tests.support.models import NO_DISK

pytestmark = [pytest.mark.anyio, pytest.mark.model]

ASK = [{"role": "user", "content": "Count from one to twenty in words."}]


async def test_streams_arrive_as_they_are_made_and_a_closed_one_frees_its_session(
    anyio_backend: str,
) -> None:
    async with kvrt.open_runtime() as rt, kvrt.serve.openai_client(rt) as client:
        started = time.perf_counter()
        stream = await client.chat.completions.create(
            model=client.kvrt_model, messages=ASK, max_tokens=24, temperature=0, stream=True
        )
        arrivals, text = [], ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
                text += chunk.choices[0].delta.content
        assert len(arrivals) >= 10 and text
        # Buffered (httpx's ASGITransport) every chunk lands at once, at the end, within
        # microseconds of each other; streamed, 24 tokens take a fifth of a second or more
        # to decode on any machine the suite runs on (slower machines only spread them more).
        assert arrivals[-1] - arrivals[0] > 0.05, arrivals[-1] - started
        whole = await client.chat.completions.create(
            model=client.kvrt_model, messages=ASK, max_tokens=24, temperature=0
        )
        assert whole.choices[0].message.content == text  # the same greedy answer
        stream = await client.chat.completions.create(
            model=client.kvrt_model, messages=ASK, max_tokens=200, temperature=0, stream=True
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        with anyio.fail_after(30):
            again = await client.chat.completions.create(
                model=client.kvrt_model, messages=ASK, max_tokens=2, temperature=0
            )
        assert again.choices[0].message.content
        root = str(client.base_url).removesuffix("/").removesuffix("/v1")
        metrics = await client.get(f"{root}/metrics", cast_to=str)
        assert 'kvrt_clients_gone_total{when="answer"} 1' in str(metrics)
        for bad in ((None,), (rt, "a config")):
            with pytest.raises(kvrt.ArgumentTypeError):
                async with kvrt.serve.openai_client(*bad):
                    pass


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # it calls asyncio.create_task
@pytest.mark.frameworks
async def test_a_pydantic_ai_agent_in_process(anyio_backend: str) -> None:
    import pydantic_ai
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async with kvrt.open_runtime() as rt, kvrt.serve.openai_client(rt) as client:
        model = OpenAIChatModel(client.kvrt_model, provider=OpenAIProvider(openai_client=client))
        agent = pydantic_ai.Agent(model, instructions="Answer briefly.")
        settings: Any = {"max_tokens": 12, "temperature": 0}
        pieces = []
        async with agent.run_stream("Name a colour.", model_settings=settings) as run:
            async for piece in run.stream_text(delta=True):
                pieces.append(piece)
        assert pieces and "".join(pieces)


@pytest.mark.frameworks
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_agents_sdk_agent_and_a_langchain_model_in_process(anyio_backend: str) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from langchain_openai import ChatOpenAI

    set_tracing_disabled(True)
    async with kvrt.open_runtime() as rt, kvrt.serve.openai_client(rt) as client:
        agent = Agent(
            name="brief",
            instructions="Answer briefly.",
            model=OpenAIResponsesModel(model=client.kvrt_model, openai_client=client),
            # The SDK fails a run whose answer is cut at max_tokens (`response.incomplete`):
            # a question SmolLM2 answers in six tokens.
            model_settings=ModelSettings(max_tokens=16, temperature=0),
        )
        streamed = Runner.run_streamed(agent, "What is 2 + 2?")
        kinds = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in kinds and streamed.final_output
        llm = ChatOpenAI(
            model=client.kvrt_model,
            api_key="in-process",  # type: ignore[arg-type]
            root_async_client=client,
            async_client=client.chat.completions,
            max_tokens=8,  # type: ignore[call-arg]
            temperature=0,
        )
        chunks = [c.content async for c in llm.astream("Name a colour.")]
        assert len(chunks) > 1 and "".join(str(c) for c in chunks)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_client_used_from_another_loop_or_thread_refuses_at_once(
    anyio_backend: str,
) -> None:
    """Its app's tasks run in the owner's loop: another loop (in another thread) gets an
    error naming the loop the client belongs to, at once, and the owner goes on."""
    import asyncio

    import trio

    async with kvrt.open_runtime() as rt, kvrt.serve.openai_client(rt) as client:

        async def use() -> Any:
            return await client.chat.completions.create(
                model=client.kvrt_model, messages=ASK, max_tokens=2
            )

        for run in (lambda: asyncio.run(use()), lambda: trio.run(use)):
            began = time.perf_counter()
            with pytest.raises(kvrt.InvalidArgumentError, match="belongs to the asyncio event"):
                await anyio.to_thread.run_sync(run)
            assert time.perf_counter() - began < 5  # no retries, no wait
        with anyio.fail_after(60):
            assert (await use()).choices[0].message.content
    with pytest.raises(kvrt.SessionClosedError, match="the runtime is closed"):
        async with kvrt.serve.openai_client(rt):
            pass


def _streamed(client: Any, max_tokens: int = 24) -> tuple[list[float], str]:
    stream = client.chat.completions.create(
        model=client.kvrt_model, messages=ASK, max_tokens=max_tokens, temperature=0, stream=True
    )
    arrivals, text = [], ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            text += chunk.choices[0].delta.content
    return arrivals, text


def test_the_sync_client_streams_from_any_thread_and_frees_a_closed_streams_session(
    anyio_backend: str,
) -> None:
    """A sync program's ``openai.OpenAI`` with kvrt in process: its event loop (asyncio or
    trio) runs in a thread of its own, and any thread may call it."""
    with kvrt.serve.sync_openai_client(NO_DISK, async_backend=anyio_backend) as client:
        got: list[tuple[list[float], str]] = []
        worker = threading.Thread(target=lambda: got.append(_streamed(client)))
        worker.start()
        worker.join(120)
        (arrivals, text) = got[0]
        assert len(arrivals) >= 10 and arrivals[-1] - arrivals[0] > 0.05  # as they are made
        whole = client.chat.completions.create(
            model=client.kvrt_model, messages=ASK, max_tokens=24, temperature=0
        )
        assert whole.choices[0].message.content == text
        stream = client.chat.completions.create(
            model=client.kvrt_model, messages=ASK, max_tokens=200, temperature=0, stream=True
        )
        for seen, _ in enumerate(stream):
            if seen == 3:
                break
        stream.close()
        began = time.perf_counter()
        again = client.chat.completions.create(
            model=client.kvrt_model, messages=ASK, max_tokens=2, temperature=0
        )
        assert again.choices[0].message.content and time.perf_counter() - began < 30
        metrics = client.get("http://kvrt.in-process/metrics", cast_to=str)
        assert 'kvrt_clients_gone_total{when="answer"} 1' in str(metrics)
    # what the block raises comes out as raised, not inside an exception group
    with pytest.raises(KeyError, match="mine"), kvrt.serve.sync_openai_client(NO_DISK):
        raise KeyError("mine")
    with (
        pytest.raises(kvrt.InvalidArgumentError, match="async_backend must be"),
        kvrt.serve.sync_openai_client(async_backend="curio"),
    ):
        pass
    with (
        pytest.raises(kvrt.ArgumentTypeError, match=r"must be a kvrt\.Config"),
        kvrt.serve.sync_openai_client("a config"),  # type: ignore[arg-type]
    ):
        pass


async def test_a_threaded_client_serves_worker_threads_and_refuses_its_loop(
    anyio_backend: str,
) -> None:
    """From async code, a sync client for a framework that runs in worker threads; called
    from the event loop's own thread it would wait on itself, so it refuses at once."""
    async with (
        kvrt.open_runtime(config=NO_DISK) as rt,
        kvrt.serve.threaded_openai_client(rt) as client,
    ):
        arrivals, text = await anyio.to_thread.run_sync(_streamed, client)
        assert len(arrivals) >= 10 and text
        began = time.perf_counter()
        with pytest.raises(kvrt.InvalidArgumentError, match="would wait on itself"):
            client.chat.completions.create(model=client.kvrt_model, messages=ASK, max_tokens=2)
        assert time.perf_counter() - began < 1  # no retries
        with pytest.raises(KeyError, match="mine"):
            async with kvrt.serve.openai_client(rt):
                raise KeyError("mine")
