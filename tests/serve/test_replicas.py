"""Replicas sharing one Redis answer as one replica: a conversation moving A -> B -> B -> A,
and a third replica restoring it all from the shared tier, get one replica's replies and
log-probabilities at temperature 0, every turn labelled exact (a real ``redis-server``),
in process and as ``kvrt serve`` processes behind the openai client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import openai
import pytest

import kvrt
from kvrt.adapters.llama import LlamaEngine
from tests.support.redis import RedisServer
from tests.support.server import kvrt_serve

pytestmark = pytest.mark.model

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


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])  # the kvrt serve test below: asyncio
async def test_a_conversation_moving_between_replicas_answers_as_one_replica(
    engine: LlamaEngine, redis_server: RedisServer, tmp_path: Path, anyio_backend: str
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


@contextmanager
def serving(
    tmp_path: Path, name: str, *flags: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """``kvrt serve`` on the embedded model as a process of its own: its base URL. Its log
    may hold no traceback."""
    environment = {"KVRT_CACHE_DIR": str(tmp_path / name), **(env or {})}
    # the run's kernel probe records, so a replica reads them instead of probing again
    (tmp_path / name).mkdir(exist_ok=True)
    kernels = tmp_path / name / "kernels"
    if not kernels.exists():
        kernels.symlink_to(Path(os.environ["KVRT_CACHE_DIR"]) / "kernels")
    flags = ("--max-sessions", "2", "--model-name", "smollm2", *flags)
    with kvrt_serve(tmp_path / f"{name}.log", *flags, env=environment) as url:
        yield url


def chat_turns(urls: list[str]) -> list[tuple[str, list[Any], bool]]:
    """The conversation through chat completions, each turn on the next of ``urls``:
    each reply's text, log-probabilities (with alternatives) and exactness."""
    messages: list[dict[str, Any]] = [SYSTEM]
    out = []
    for url, question in zip(urls, QUESTIONS, strict=True):
        messages.append({"role": "user", "content": question})
        done = openai.OpenAI(
            base_url=f"{url}/v1", api_key="-", max_retries=0
        ).chat.completions.create(
            model="smollm2",
            messages=cast(Any, messages),
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
        choice = done.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        probs = [
            (t.token, t.logprob, [a.logprob for a in t.top_logprobs])
            for t in choice.logprobs.content
        ]
        extra = (done.usage.model_extra or {}) if done.usage is not None else {}
        out.append((choice.message.content or "", probs, bool(extra["kvrt"]["exact"])))
        messages.append({"role": "assistant", "content": choice.message.content or ""})
    return out


def response_turns(urls: list[str], how: str) -> list[tuple[str, list[Any], bool]]:
    """The conversation through the Responses API, continued by ``previous_response_id``
    or by a ``conversation``, each turn on the next of ``urls``."""
    out = []
    previous: str | None = None
    conversation = None
    if how == "conversation":
        first = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key="-", max_retries=0)
        conversation = first.conversations.create(items=[]).id
    for url, question in zip(urls, QUESTIONS, strict=True):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        extra: dict[str, Any] = {}
        if how == "previous" and previous is not None:
            extra["previous_response_id"] = previous
        if conversation is not None:
            extra["conversation"] = conversation
        done = c.responses.create(
            model="smollm2",
            instructions=SYSTEM["content"],
            input=question,
            max_output_tokens=8,
            temperature=0,
            top_logprobs=3,
            include=["message.output_text.logprobs"],
            **extra,
        )
        previous = done.id
        part = done.output[0].content[0]
        probs = [
            (t.token, t.logprob, [a.logprob for a in t.top_logprobs]) for t in part.logprobs or []
        ]
        usage = (done.usage.model_extra or {}) if done.usage is not None else {}
        out.append((done.output_text, probs, bool(usage["kvrt"]["exact"])))
    return out


@pytest.mark.subprocess
def test_two_kvrt_serve_replicas_on_one_redis_answer_as_one(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Chat completions, ``previous_response_id`` and ``conversation`` (the Agents SDK's
    two ways) moving A -> B -> B -> A give one replica's replies and log-probabilities;
    kept responses and conversations are on the shared server, so a restarted replica
    (or the other) reads them."""
    shared = ("--remote-url", redis_server.url, "--disk-budget", "0")
    env = {"KVRT_REMOTE_SECRET": "a secret the replicas share, long enough"}
    with (
        serving(tmp_path, "alone", "--disk-budget", "0") as alone,
        serving(tmp_path, "a", *shared, env=env) as a,
        serving(tmp_path, "b", *shared, env=env) as b,
    ):
        order = [a, b, b, a]
        want = chat_turns([alone] * 4)
        got = chat_turns(order)
        assert got == want and all(exact for *_, exact in got)
        for how in ("previous", "conversation"):
            want = response_turns([alone] * 4, how)
            got = response_turns(order, how)
            assert got == want and all(exact for *_, exact in got), how
        kept = openai.OpenAI(base_url=f"{a}/v1", api_key="-", max_retries=0)
        last = kept.responses.create(model="smollm2", input="Thanks.", max_output_tokens=2)
    with serving(tmp_path, "b-again", *shared, env=env) as b:  # every replica restarted
        other = openai.OpenAI(base_url=f"{b}/v1", api_key="-", max_retries=0)
        assert other.responses.retrieve(last.id).id == last.id
        again = other.responses.create(
            model="smollm2", input="Bye.", previous_response_id=last.id, max_output_tokens=2
        )
        assert again.status in ("completed", "incomplete") and again.output_text
