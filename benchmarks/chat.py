"""Chat reuse, measured side by side: kvrt against ``llama_cpp.Llama`` with its
``LlamaRAMCache``, in process and over HTTP (``kvrt serve`` against
``python -m llama_cpp.server``), and ``kvrt serve`` under 16 streaming clients.

Run from the repository root: ``python -m benchmarks.chat [--turns 10] [--no-http] [--no-load]``. Figures to
read, not assertions; every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

import kvrt
from kvrt.bench import own_disk_tier

LLAMA_SERVER = [sys.executable, str(Path(__file__).with_name("_llama_server.py"))]
"""Starts ``llama_cpp.server`` as the benchmark's peer (its arguments follow), its weights
in the buffers kvrt loads them into."""

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

ROOT = Path(__file__).resolve().parents[1]
"""The repository root, where ``python -m benchmarks.chat`` runs."""


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

    from kvrt.adapters.llama import reference_llama

    engine: Any = llama_cpp
    llm: Any = reference_llama(str(kvrt.embedded_model_path()), n_ctx=4096, verbose=False)
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


async def load_test(base_url: str) -> str:
    """16 streaming clients, five turns each, run in a process of their own (so their
    threads do not share the server's interpreter lock)."""
    began = time.perf_counter()
    result = await anyio.run_process(
        [sys.executable, "-m", "benchmarks.chat", "--clients", base_url], check=True, cwd=ROOT
    )
    took = time.perf_counter() - began
    generated, limited = map(int, result.stdout.decode().split())
    return (
        f"16 streaming clients x 5 turns through 4 sessions: {took:.1f} s, {generated} tokens "
        f"generated, {generated / took:.0f} tokens/s aggregate, {limited} 429s waited out "
        "(Retry-After)"
    )


def run_clients(base_url: str) -> None:
    """The load test's clients (``--clients URL``): prints tokens generated and 429s."""
    import threading

    import openai

    generated = 0
    limited = 0
    lock = threading.Lock()

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
                            with lock:
                                generated += chunk.usage.completion_tokens
                    break
                except openai.RateLimitError as exc:
                    with lock:
                        limited += 1
                    time.sleep(float(exc.response.headers.get("retry-after", "1")))
            messages.append({"role": "assistant", "content": text})

    threads = [threading.Thread(target=client_run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(generated, limited)


def served(command: list[str], label: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server process on a free port; it and its base URL once it answers."""
    import tempfile
    import urllib.request

    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the server runs)
    proc = subprocess.Popen(
        [*command, "--port", str(port)], stdout=log, stderr=log, env={**os.environ}
    )
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{label} did not start: {log.read().decode()[-400:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{label} did not answer within 180 s") from None
            time.sleep(0.5)


def over_http(command: list[str], label: str, turns: int, load: bool) -> tuple[Any, str]:
    """The chat (and the load test) against a server process: rows, or why not."""
    try:
        proc, url = served(command, label)
    except RuntimeError as exc:
        return str(exc), ""
    try:
        rows = http_chat(url, turns)
        summary = anyio.run(load_test, url) if load else ""
        return rows, summary
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--clients", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.clients:
        run_clients(args.clients)
        return
    turns = min(args.turns, len(QUESTIONS))
    with own_disk_tier():
        compare(args, turns)


def compare(args: argparse.Namespace, turns: int) -> None:

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
    model = str(kvrt.embedded_model_path())
    ours_http, summary = over_http(
        [
            sys.executable,
            "-m",
            "kvrt",
            "serve",
            "--max-sessions",
            "4",
            "--max-queue",
            "8",
            "--session-tokens",
            "4096",
        ],
        "kvrt serve",
        turns,
        not args.no_load,
    )
    other, _ = over_http(
        [
            *LLAMA_SERVER,
            "--model",
            model,
            "--n_ctx",
            "4096",
            "--cache",
            "true",
        ],
        "llama_cpp.server",
        turns,
        False,
    )
    print(f"\n{turns}-turn chat over HTTP (openai client, streaming)")
    missing = [{"ttft": float("nan"), "seconds": float("nan")}] * turns
    for name, rows in (("kvrt serve", ours_http), ("llama_cpp.server", other)):
        if isinstance(rows, str):
            print(f"{name}: {rows}")
    served_rows = missing if isinstance(ours_http, str) else ours_http
    other = missing if isinstance(other, str) else other
    print("turn  kvrt serve ttft  llama_cpp.server ttft")
    for i, (a, b) in enumerate(zip(served_rows, other, strict=True)):
        print(f"{i + 1:>4}  {a['ttft'] * 1e3:>12.1f} ms  {b['ttft'] * 1e3:>18.1f} ms")
    print(
        f"total: kvrt serve {sum(r['seconds'] for r in served_rows):.2f} s, llama_cpp.server "
        f"{sum(r['seconds'] for r in other):.2f} s"
    )
    if summary:
        print("\n" + summary)


if __name__ == "__main__":
    main()
