"""``kvrt serve`` against real clients: the ``openai`` package, pydantic-ai, raw HTTP."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import anyio
import openai
import pytest

from tests.support.models import tiny
from tests.support.server import client, get, off_loop, post, server

pytestmark = [pytest.mark.anyio, pytest.mark.model]

SYSTEM = "You are a helpful assistant. Answer briefly."


async def test_six_turn_conversation_reuses_every_earlier_turn(anyio_backend: str) -> None:
    async with server() as (rt, url):

        def talk() -> list[Any]:
            c = client(url)
            model = c.models.list().data[0].id
            messages: list[Any] = [{"role": "system", "content": SYSTEM}]
            out = []
            for turn in range(6):
                messages.append({"role": "user", "content": f"Tell me fact number {turn + 1}."})
                r = c.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=40,
                    temperature=0,
                )
                out.append(r)
                messages.append(
                    {"role": "assistant", "content": r.choices[0].message.content or ""}
                )
            return out

        replies = await off_loop(talk)
        for before, after in itertools.pairwise(replies):
            assert before.usage is not None and after.usage is not None
            cached = after.usage.prompt_tokens_details.cached_tokens
            assert cached >= before.usage.prompt_tokens + before.usage.completion_tokens
            breakdown = (after.usage.model_extra or {})["kvrt"]
            assert breakdown["prefilled_tokens"] <= 24, breakdown
        assert {r.choices[0].finish_reason for r in replies} <= {"stop", "length"}
        metrics = await off_loop(get, url, "/metrics")
        assert 'kvrt_requests_total{route="chat",status="200"} 6' in metrics
        lines = metrics.splitlines()
        reused = next(x for x in lines if x.startswith('kvrt_tokens_total{kind="reused"}'))
        assert int(reused.split()[-1]) > 0
        health = json.loads(await off_loop(get, url, "/health"))
        assert health["status"] == "ok" and health["busy"] == 0
        assert rt.cold_stats().bytes <= rt.cold_stats().budget_bytes


async def test_a_reply_sent_back_in_other_words_costs_only_itself(anyio_backend: str) -> None:
    """A framework that keeps each reply its own way (a tool call kept as JSON content, an
    edited answer) sends back a conversation the session holds all of but its last reply:
    that session is lent again, and only the reply as sent and the new message are
    computed, where a fresh session would compute everything after the last cold block."""
    async with server(engine=tiny(), max_sessions=4) as (_rt, url):

        def talk() -> list[Any]:
            c = client(url)
            model = c.models.list().data[0].id
            messages: list[Any] = [{"role": "system", "content": SYSTEM}]
            out = []
            for turn in range(5):
                messages.append({"role": "user", "content": f"Tell me fact number {turn + 1}."})
                r = c.chat.completions.create(
                    model=model, messages=messages, max_tokens=12, temperature=0
                )
                out.append(r)
                kept = json.dumps({"fact": turn + 1, "text": r.choices[0].message.content})
                messages.append({"role": "assistant", "content": kept})
            return out

        replies = await off_loop(talk)
        for before, after in itertools.pairwise(replies):
            assert before.usage is not None and after.usage is not None
            new = after.usage.prompt_tokens - before.usage.prompt_tokens  # reply + question
            prefilled = (after.usage.model_extra or {})["kvrt"]["prefilled_tokens"]
            assert prefilled <= new, (prefilled, new)
        health = json.loads(await off_loop(get, url, "/health"))
        assert health["sessions"] == 1, health


async def test_idle_sessions_go_to_the_cold_store_and_come_back_exact(anyio_backend: str) -> None:
    """Two conversations taking turns on a server that keeps no idle session live: each
    request closes the other's session (its blocks go to the cold store), so one session
    holds memory at a time, and the conversation that comes back is restored rather than
    computed again, to the same replies and log-probabilities as a server keeping both."""

    async def talk(
        idle: int | None,
    ) -> tuple[list[tuple[str, list[float], dict[str, Any]]], list[int]]:
        async with server(engine=tiny(), idle_sessions=idle) as (_rt, url):

            def run() -> tuple[list[tuple[str, list[float], dict[str, Any]]], list[int]]:
                c = client(url)
                model = c.models.list().data[0].id
                rules = " ".join(f"Rule {i}: answer in plain words." for i in range(40))
                talks: list[list[Any]] = [
                    [{"role": "system", "content": f"You are agent {a}. {rules}"}]
                    for a in ("A", "B")
                ]
                out, sessions = [], []
                for turn in range(3):
                    for messages in talks:
                        messages.append({"role": "user", "content": f"Step {turn}?"})
                        r = c.chat.completions.create(
                            model=model, messages=messages, max_tokens=6, temperature=0,
                            logprobs=True,
                        )  # fmt: skip
                        choice = r.choices[0]
                        text = choice.message.content or ""
                        messages.append({"role": "assistant", "content": text})
                        assert choice.logprobs is not None and choice.logprobs.content
                        logprobs = [t.logprob for t in choice.logprobs.content]
                        assert r.usage is not None
                        out.append((text, logprobs, (r.usage.model_extra or {})["kvrt"]))
                        sessions.append(json.loads(get(url, "/health"))["sessions"])
                return out, sessions

            return await off_loop(run)

    parked, parked_sessions = await talk(0)
    live, live_sessions = await talk(None)  # the default: idle sessions stay live
    assert parked_sessions == [1] * 6 and live_sessions == [1, 2, 2, 2, 2, 2]
    for (text, logprobs, _), (text_live, logprobs_live, _) in zip(parked, live, strict=True):
        assert (text, logprobs) == (text_live, logprobs_live)
    for (_, _, usage), (_, _, usage_live) in zip(parked[2:], live[2:], strict=True):
        assert usage["restored_tokens"] > usage_live["restored_tokens"] + 100
        # at most the tail after the last whole block is computed again
        assert usage["prefilled_tokens"] < usage_live["prefilled_tokens"] + 32, usage


async def test_streaming_with_stop_sequences_and_usage(anyio_backend: str) -> None:
    async with server() as (_, url):

        def run() -> tuple[str, str, str, Any]:
            c = client(url)
            model = c.models.list().data[0].id
            messages: list[Any] = [
                {"role": "user", "content": "Count from one to ten in words, comma separated."}
            ]
            full = c.chat.completions.create(
                model=model, messages=messages, max_tokens=40, temperature=0
            )
            text = full.choices[0].message.content or ""
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            parts, finish, usage = [], "", None
            for chunk in c.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=40,
                temperature=0,
                stop=[stop],
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage
            return text, stop, "".join(parts) + "|" + finish, usage

        text, stop, streamed, usage = await off_loop(run)
        assert streamed == text[: text.index(stop)] + "|stop"
        assert usage is not None and usage.completion_tokens > 0


async def test_bad_requests_get_openai_style_400s(anyio_backend: str) -> None:
    async with server() as (_, url):
        model = (await off_loop(lambda: client(url).models.list())).data[0].id
        good = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        cases: list[tuple[bytes, str | None]] = [
            (b"{not json", None),
            (json.dumps({**good, "model": "gpt-4o"}).encode(), "model"),
            (json.dumps({**good, "max_tokens": 0}).encode(), "max_tokens"),
            (json.dumps({**good, "max_tokens": 10**9}).encode(), "max_tokens"),
            (json.dumps({**good, "messages": []}).encode(), "messages"),
            (
                json.dumps({**good, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
                "messages[0].role",  # the parameter kvrt's error carries, to the field
            ),
            (json.dumps({**good, "n": 2}).encode(), "n"),
            (json.dumps({**good, "temperature": -1}).encode(), "temperature"),
            (json.dumps({"model": model}).encode(), "messages"),
        ]
        for body, param in cases:
            status, answer, _ = await off_loop(post, url, "/v1/chat/completions", body)
            assert status == 400, (body, answer)
            assert answer["error"]["type"] == "invalid_request_error"
            assert answer["error"]["message"]
            if param is not None:
                assert answer["error"]["param"] == param, answer
        status, answer, _ = await off_loop(
            post, url, "/v1/chat/completions", json.dumps(good).encode()
        )
        assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant"
        status, answer, _ = await off_loop(
            post, url, "/v1/completions", json.dumps({"model": model, "prompt": ""}).encode()
        )
        assert status == 400 and answer["error"]["param"] == "prompt"


async def test_full_server_answers_429_and_a_dropped_stream_frees_its_session(
    anyio_backend: str,
) -> None:
    async with server(max_sessions=1, max_queue=0, retry_after=2) as (rt, url):
        model = (await off_loop(lambda: client(url).models.list())).data[0].id
        opened = anyio.Event()
        release = anyio.Event()

        def hold_stream(token: anyio.from_thread.BlockingPortal | None = None) -> int:
            stream = client(url).chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Write a long story about a dragon."}],
                max_tokens=400,
                temperature=0,
                stream=True,
            )
            seen = 0
            for _ in stream:
                seen += 1
                if seen == 3:
                    anyio.from_thread.run_sync(opened.set)
                    anyio.from_thread.run(release.wait)
                    break
            stream.close()  # the client goes away mid-stream
            return seen

        async with anyio.create_task_group() as tg:
            tg.start_soon(off_loop, hold_stream)
            await opened.wait()
            body = json.dumps(
                {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
            )
            status, answer, headers = await off_loop(
                post, url, "/v1/chat/completions", body.encode()
            )
            assert status == 429 and headers.get("Retry-After") == "2"
            assert answer["error"]["type"] == "rate_limit_exceeded"
            with pytest.raises(openai.RateLimitError):
                await off_loop(
                    lambda: client(url, max_retries=0).chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
                    )
                )
            release.set()
        with anyio.fail_after(30):
            while json.loads(await off_loop(get, url, "/health"))["busy"]:
                await anyio.sleep(0.05)
        status, answer, _ = await off_loop(post, url, "/v1/chat/completions", body.encode())
        assert status == 200, answer  # the session the dropped stream held serves again
        assert rt.cold_stats().bytes <= rt.cold_stats().budget_bytes


async def test_session_id_header_pins_conversations(anyio_backend: str) -> None:
    async with server(max_sessions=2) as (_, url):

        def run() -> list[int]:
            c = client(url)
            model = c.models.list().data[0].id
            cached: list[Any] = []
            talks = {
                "a": [{"role": "system", "content": SYSTEM}],
                "b": [{"role": "user", "content": "Hello!"}],
            }
            for turn in range(2):
                for pin, messages in talks.items():
                    messages.append({"role": "user", "content": f"Question {turn} for {pin}."})
                    r = c.chat.completions.create(
                        model=model,
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=12,
                        temperature=0,
                        extra_headers={"X-Session-Id": pin},
                    )
                    messages.append(
                        {"role": "assistant", "content": r.choices[0].message.content or ""}
                    )
                    assert r.usage is not None
                    cached.append(r.usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]
            return cached

        cached = await off_loop(run)
        assert cached[:2] == [0, 0] and all(c > 0 for c in cached[2:])
        health = json.loads(await off_loop(get, url, "/health"))
        assert health["sessions"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # both loops serve in the tests above
async def test_sixteen_streaming_clients_five_turns_each(anyio_backend: str) -> None:
    """A bounded load: 16 clients stream five turns each through four sessions; the only
    errors are deliberate 429s, which the clients retry. (On the zoo's llama: the load,
    not the model's text.)"""
    async with server(engine=tiny(), max_sessions=4, max_queue=6) as (rt, url):
        model = (await off_loop(lambda: client(url).models.list())).data[0].id
        tokens: list[int] = []
        limited = 0

        def converse(i: int) -> int:
            nonlocal limited
            c = client(url, max_retries=0)
            messages = [{"role": "system", "content": SYSTEM}]
            for turn in range(5):
                messages.append(
                    {"role": "user", "content": f"Client {i}, turn {turn}: say a word."}
                )
                while True:
                    try:
                        stream: Any = c.chat.completions.create(
                            model=model,
                            messages=messages,  # type: ignore[arg-type]
                            max_tokens=12,
                            temperature=0,
                            stream=True,
                        )
                        text = "".join(
                            ch.choices[0].delta.content or "" for ch in stream if ch.choices
                        )
                        break
                    except openai.RateLimitError:
                        limited += 1
                        time.sleep(0.2)
                messages.append({"role": "assistant", "content": text})
                tokens.append(len(text))
            return turn

        began = time.perf_counter()
        with anyio.fail_after(400):
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(off_loop, converse, i)
        took = time.perf_counter() - began
        assert len(tokens) == 80
        metrics = await off_loop(get, url, "/metrics")
        assert 'kvrt_requests_total{route="chat",status="200"} 80' in metrics
        stats = rt.cold_stats()
        assert stats.bytes <= stats.budget_bytes
        print(f"16 clients x 5 turns: {took:.1f} s, {limited} 429s retried")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # pydantic-ai runs on asyncio only
async def test_pydantic_ai_agent_talks_to_kvrt_serve(anyio_backend: str) -> None:
    import pydantic_ai
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async with server() as (_, url):
        model_id = (await off_loop(lambda: client(url).models.list())).data[0].id
        model = OpenAIChatModel(
            model_id, provider=OpenAIProvider(base_url=f"{url}/v1", api_key="x")
        )
        agent = pydantic_ai.Agent(model, instructions=SYSTEM)
        first = await agent.run(
            "What is the capital of France?", model_settings={"max_tokens": 24, "temperature": 0}
        )
        assert isinstance(first.output, str) and first.output
        second = await agent.run(
            "And of Spain?",
            message_history=first.all_messages(),
            model_settings={"max_tokens": 24, "temperature": 0},
        )
        assert second.output
        assert second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.subprocess
def test_kvrt_serve_command_serves_until_interrupted() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrt", "serve", "--port", str(port), "--loop", "trio"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                health = json.loads(get(url, "/health"))
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline
                time.sleep(0.2)
        c = client(url)
        r = c.chat.completions.create(
            model=health["model"], messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
        assert r.choices[0].message.role == "assistant"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130), out
    assert f"http://127.0.0.1:{port}/v1" in out
