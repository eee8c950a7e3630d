"""Chat reuse, measured side by side: kvrt against ``llama_cpp.Llama`` with its
``LlamaRAMCache``, in process and over HTTP (``kvrt serve`` against
``python -m llama_cpp.server``), and ``kvrt serve`` under 16 streaming clients.

Run: ``python -m kvrt.tools.bench.chat [--turns 10] [--no-http] [--no-load]``. Figures to
read, not assertions; every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from functools import partial
from typing import Any

import anyio

import kvrt
import kvrt.serve

SYSTEM = "You are a helpful assistant. Answer in a few sentences."
QUESTIONS = [
    "What is a lighthouse for?",
    "Who kept lighthouses running in the past?",
    "Describe a storm at sea.",
    "Write a short poem about a lighthouse keeper.",
    "What replaced lamps in modern lighthouses?",
    "Name three famous lighthouses.",
    "Why are lighthouses painted in stripes?",
    "Tell me a story about a ship saved by a lighthouse.",
    "How tall is a typical lighthouse?",
    "Summarise our conversation in two sentences.",
]


def max_tokens(turn: int) -> int:
    return 160 if turn % 3 == 2 else 64  # long replies every third turn


async def kvrt_chat(turns: int) -> list[dict[str, float]]:
    rows = []
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    async with kvrt.open_runtime("llama") as rt, rt.open_session(hot_tokens=4096) as s:
        for turn, question in enumerate(QUESTIONS[:turns]):
            messages.append({"role": "user", "content": question})
            began = time.perf_counter()
            done = await s.chat(messages, max_tokens=max_tokens(turn), temperature=0)
            rows.append(
                {
                    "prompt": done.usage.prompt_tokens,
                    "prefilled": done.usage.prefilled_tokens,
                    "new": len(rt.engine.tokenize(question, add_special=False)),
                    "ttft": done.timings.time_to_first_token or 0.0,
                    "seconds": time.perf_counter() - began,
                }
            )
            messages.append({"role": "assistant", "content": done.text})
    return rows


def llama_chat(turns: int) -> list[dict[str, float]]:
    import llama_cpp

    engine: Any = llama_cpp
    llm = engine.Llama(str(kvrt.embedded_model_path()), n_ctx=4096, verbose=False)
    llm.set_cache(engine.LlamaRAMCache())
    evaluated: list[int] = []
    original = llm.eval

    def counting(tokens: Any) -> None:
        evaluated.append(len(tokens))
        original(tokens)

    llm.eval = counting
    rows = []
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    try:
        for turn, question in enumerate(QUESTIONS[:turns]):
            messages.append({"role": "user", "content": question})
            evaluated.clear()
            began = time.perf_counter()
            first = None
            text = ""
            for chunk in llm.create_chat_completion(
                messages,
                max_tokens=max_tokens(turn),
                temperature=0.0,
                top_k=1,
                repeat_penalty=1.0,
                stream=True,
            ):
                delta = chunk["choices"][0]["delta"].get("content")
                if delta and first is None:
                    first = time.perf_counter() - began
                text += delta or ""
            rows.append(
                {
                    "prefilled": evaluated[0] if evaluated else 0,
                    "ttft": first or 0.0,
                    "seconds": time.perf_counter() - began,
                }
            )
            messages.append({"role": "assistant", "content": text})
    finally:
        llm.close()
    return rows


def http_chat(base_url: str, turns: int) -> list[dict[str, float]]:
    import openai

    client: Any = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    rows = []
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(QUESTIONS[:turns]):
        messages.append({"role": "user", "content": question})
        began = time.perf_counter()
        first = None
        text = ""
        for chunk in client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens(turn),
            temperature=0,
            stream=True,
        ):
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta and first is None:
                first = time.perf_counter() - began
            text += delta or ""
        rows.append({"ttft": first or 0.0, "seconds": time.perf_counter() - began})
        messages.append({"role": "assistant", "content": text})
    return rows


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


async def kvrt_http(turns: int, load: bool) -> tuple[list[dict[str, float]], str]:
    sock = free_socket()
    async with kvrt.open_runtime("llama") as rt, anyio.create_task_group() as tg:
        config = kvrt.serve.ServeConfig(max_sessions=4, max_queue=8, hot_tokens=4096)
        url = await tg.start(partial(kvrt.serve.serve, rt, config, sock=sock))
        rows = await anyio.to_thread.run_sync(http_chat, f"{url}/v1", turns)
        summary = ""
        if load:
            summary = await load_test(f"{url}/v1")
        tg.cancel_scope.cancel()
    return rows, summary


async def load_test(base_url: str) -> str:
    import openai

    generated = 0
    limited = 0

    def client_run(i: int) -> None:
        nonlocal generated, limited
        client: Any = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(5):
            messages.append({"role": "user", "content": f"Client {i}: {QUESTIONS[turn]}"})
            while True:
                try:
                    stream = client.chat.completions.create(
                        model=model,
                        messages=messages,
                        max_tokens=32,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    text = ""
                    for chunk in stream:
                        if chunk.choices:
                            text += chunk.choices[0].delta.content or ""
                        if chunk.usage is not None:
                            generated += chunk.usage.completion_tokens
                    break
                except openai.RateLimitError:
                    limited += 1
                    time.sleep(0.2)
            messages.append({"role": "assistant", "content": text})

    began = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(16):
            tg.start_soon(
                partial(anyio.to_thread.run_sync, client_run, i, limiter=anyio.CapacityLimiter(16))
            )
    took = time.perf_counter() - began
    return (
        f"16 streaming clients x 5 turns through 4 sessions: {took:.1f} s, {generated} tokens "
        f"generated, {generated / took:.0f} tokens/s aggregate, {limited} 429s retried"
    )


def llama_server_chat(turns: int) -> list[dict[str, float]] | str:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(kvrt.embedded_model_path()),
            "--port",
            str(port),
            "--n_ctx",
            "4096",
            "--cache",
            "true",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        import urllib.request

        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                return f"llama_cpp.server did not start: {(proc.stderr.read() if proc.stderr else '')[-300:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    return "llama_cpp.server did not answer within 120 s"
                time.sleep(0.5)
        return http_chat(f"http://127.0.0.1:{port}/v1", turns)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--no-load", action="store_true")
    args = parser.parse_args(argv)
    turns = min(args.turns, len(QUESTIONS))

    ours = anyio.run(kvrt_chat, turns)
    theirs = llama_chat(turns)
    print(f"{turns}-turn chat, in process (greedy; replies of 64 and 160 tokens)")
    print("turn  new msg  kvrt prefilled  llama+RAMCache prefilled  kvrt ttft  llama ttft")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        print(
            f"{i + 1:>4}  {a['new']:>7.0f}  {a['prefilled']:>14.0f}  {b['prefilled']:>24.0f}"
            f"  {a['ttft'] * 1e3:>7.1f} ms  {b['ttft'] * 1e3:>7.1f} ms"
        )
    print(
        f"total: kvrt {sum(r['seconds'] for r in ours):.2f} s, "
        f"{sum(r['prefilled'] for r in ours):.0f} tokens prefilled; llama_cpp+LlamaRAMCache "
        f"{sum(r['seconds'] for r in theirs):.2f} s, {sum(r['prefilled'] for r in theirs):.0f} "
        "tokens prefilled"
    )
    if args.no_http:
        return
    served, summary = anyio.run(kvrt_http, turns, not args.no_load)
    other = llama_server_chat(turns)
    print(f"\n{turns}-turn chat over HTTP (openai client, streaming)")
    if isinstance(other, str):
        print(other)
        other = [{"ttft": float("nan"), "seconds": float("nan")}] * turns
    print("turn  kvrt serve ttft  llama_cpp.server ttft")
    for i, (a, b) in enumerate(zip(served, other, strict=True)):
        print(f"{i + 1:>4}  {a['ttft'] * 1e3:>12.1f} ms  {b['ttft'] * 1e3:>18.1f} ms")
    print(
        f"total: kvrt serve {sum(r['seconds'] for r in served):.2f} s, llama_cpp.server "
        f"{sum(r['seconds'] for r in other):.2f} s"
    )
    if summary:
        print("\n" + summary)


if __name__ == "__main__":
    main()
