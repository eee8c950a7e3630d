"""Tests of a tiny agent, on trio, against the real model."""

from __future__ import annotations

import pytest
import trio

import kvrt

pytestmark = pytest.mark.trio


async def answer(session: kvrt.Session, messages: list[dict[str, str]]) -> str:
    done = await session.chat(messages, max_tokens=32, temperature=0)
    return done.text


async def test_the_agent_answers(runtime: kvrt.Runtime) -> None:
    async with runtime.open_session(hot_tokens=512) as session:
        text = await answer(session, [{"role": "user", "content": "Say hello."}])
    assert text


async def test_a_second_turn_reuses_the_first(runtime: kvrt.Runtime) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    async with runtime.open_session(hot_tokens=512) as session:
        first = await session.chat(messages, max_tokens=16, temperature=0)
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "Another one?"},
        ]
        second = await session.chat(messages, max_tokens=16, temperature=0)
    assert second.usage.cached_tokens >= first.usage.prompt_tokens + len(first.tokens)


async def test_agents_run_side_by_side(runtime: kvrt.Runtime) -> None:
    texts: list[str] = []

    async def agent(question: str) -> None:
        async with runtime.open_session(hot_tokens=512) as session:
            texts.append(await answer(session, [{"role": "user", "content": question}]))

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for question in ("Count to three.", "Name a fruit.", "Say goodbye."):
                nursery.start_soon(agent, question)
    assert len(texts) == 3 and all(texts)
