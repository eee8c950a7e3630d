"""Replicas sharing one Redis answer as one replica: a conversation moving A -> B -> B -> A,
and a third replica restoring it all from the shared tier, get one replica's replies and
log-probabilities at temperature 0, every turn labelled exact (a real ``redis-server``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import kvrt
from kvrt.adapters.llama import LlamaEngine

from .redis_server import RedisServer

pytestmark = pytest.mark.anyio

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one sentence."}
QUESTIONS = [
    "Name a river in France.",
    "Where does it rise?",
    "Which sea does it reach?",
    "Name a city on its banks.",
]


def replica(url: str, secret: Path) -> kvrt.Config:
    flags = {"remote.url": url, "disk.budget": "0", "remote.secret_file": str(secret)}
    return kvrt.load_config(flags=flags)


def logprobs(done: kvrt.Completion) -> list[tuple[int, float, tuple[float, ...]]]:
    assert done.logprobs is not None
    return [(lp.token, lp.logprob, tuple(t.logprob for t in lp.top)) for lp in done.logprobs]


async def turn(session: kvrt.Session, messages: list[dict[str, Any]], question: str) -> Any:
    messages.append({"role": "user", "content": question})
    done = await session.chat(messages, max_tokens=12, logprobs=3)
    messages.append({"role": "assistant", "content": done.text})
    return done


async def test_a_conversation_moving_between_replicas_answers_as_one_replica(
    engine: LlamaEngine, redis_server: RedisServer, tmp_path: Path
) -> None:
    alone: list[Any] = []
    off = kvrt.load_config(flags={"disk.budget": "0"})
    async with (
        kvrt.open_runtime(engine=engine, config=off) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        messages: list[dict[str, Any]] = [SYSTEM]
        for question in QUESTIONS:
            alone.append(await turn(s, messages, question))

    secret = tmp_path / "secret"
    secret.write_text("a secret the replicas share, 32+ bytes\n")
    cfg = replica(redis_server.url, secret)
    moved: list[Any] = []
    async with (
        kvrt.open_runtime(engine=engine, config=cfg) as a,
        kvrt.open_runtime(engine=engine, config=cfg) as b,
        a.open_session(hot_tokens=1024) as on_a,
        b.open_session(hot_tokens=1024) as on_b,
    ):
        messages = [SYSTEM]
        for session, question in zip((on_a, on_b, on_b, on_a), QUESTIONS, strict=True):
            moved.append(await turn(session, messages, question))
        assert b.cold_stats().remote_hits > 0  # B restored what A computed
    for want, got in zip(alone, moved, strict=True):
        assert got.text == want.text
        assert logprobs(got) == logprobs(want)
        assert got.context.exact

    # A third replica, its RAM empty, restores the conversation from the shared tier.
    async with (
        kvrt.open_runtime(engine=engine, config=cfg) as c,
        c.open_session(hot_tokens=1024) as on_c,
    ):
        last = await on_c.chat(messages[:-1], max_tokens=12, logprobs=3)
        assert last.usage.restored_tokens > 0 and last.usage.prefilled_tokens < 16
    assert logprobs(last) == logprobs(alone[-1]) and last.context.exact
