"""Tools and structured output, measured side by side in one run.

- Constrained decoding's cost: decode tokens/s of the same greedy reply length with and
  without a JSON Schema grammar, on llama.cpp and OpenVINO, and the difference per token
  (the token mask and the matcher's step).
- A 10-step tool loop (each step sends the whole loop back, the calls as structured
  ``tool_calls``, as agent frameworks do): tokens computed per step by kvrt in process,
  by ``kvrt serve`` (its ``usage.kvrt.prefilled_tokens``), and by ``llama_cpp.server``
  with ``--chat_format chatml-function-calling`` and its prompt cache on (its own log's
  ``prompt eval`` counts), on the same model; and by ``kvrt serve`` again with the calls'
  arguments sent back re-serialized (``{"city":"Paris"}``), as pydantic-ai does.
  ``--serve-only`` runs the two ``kvrt serve`` loops alone: run it from another
  checkout's folder (``python /path/to/benchmarks/tool_loop.py --serve-only``) to measure
  that checkout's server beside this one.

Run: ``python benchmarks/tool_loop.py [--steps 10] [--no-http]``. Figures to read, not
assertions; every figure is measured in this run. Uses kvrt's public API only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio

import kvrt

LLAMA_SERVER = [sys.executable, str(Path(__file__).with_name("_llama_server.py"))]
"""Starts ``llama_cpp.server`` as the benchmark's peer (its arguments follow), its weights
in the buffers kvrt loads them into."""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CHOICE = {"type": "function", "function": {"name": "get_weather"}}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Quito", "Bern", "Doha", "Riga", "Baku"]
SYSTEM = "You answer questions about the weather."
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
OFF = kvrt.Config(disk=kvrt.DiskConfig(budget=0))


async def grammar_cost(backend: str, n: int = 48) -> dict[str, float]:
    """Decode speed of ``n`` tokens free and under a JSON Schema (the same prompt)."""
    async with kvrt.open_runtime(backend, config=OFF) as rt, rt.open_session(hot_tokens=1024) as s:
        prompt = [kvrt.Segment("p", "Describe a person as JSON: ")]
        grammar = kvrt.Grammar.json_schema(PERSON)
        await s.ensure_context(prompt)
        await s.generate(max_tokens=4, stop_at_end=False)  # warm up; the vocabulary read
        await s.ensure_context(prompt)
        await s.generate(max_tokens=2, grammar=grammar)
        rates: dict[str, list[float]] = {"free": [], "grammar": []}
        for _ in range(3):
            for kind in ("free", "grammar"):
                await s.ensure_context(prompt)
                done = await s.generate(
                    max_tokens=n,
                    stop_at_end=False,
                    grammar=grammar if kind == "grammar" else None,
                )
                rate = done.timings.decode_tokens_per_second
                if rate is not None and done.usage.completion_tokens >= 8:
                    rates[kind].append(rate)
    free, constrained = max(rates["free"]), max(rates["grammar"])
    return {
        "free_tps": free,
        "grammar_tps": constrained,
        "overhead_ms": (1 / constrained - 1 / free) * 1e3,
    }


def tool_message(
    call_id: str,
    name: str,
    arguments: str,
    step: int,
    content: str | None = None,
    result: str | None = None,
) -> list[dict[str, Any]]:
    """The assistant's call and the tool's answer (``result``, by default the weather in
    the step's city), as a framework sends them back."""
    return [
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call_id,
            "content": result if result is not None else f"Sunny, 21 C in {CITIES[step]}.",
        },
    ]


def start_messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]


async def loop_in_process(steps: int) -> list[dict[str, float]]:
    rows = []
    messages = start_messages()
    async with kvrt.open_runtime("llama", config=OFF) as rt, rt.open_session(hot_tokens=4096) as s:
        for step in range(steps):
            began = time.perf_counter()
            done = await s.chat(
                messages, tools=[WEATHER], tool_choice=CHOICE, max_tokens=64, temperature=0
            )
            call = done.tool_calls[0]
            rows.append(
                {
                    "prompt": done.usage.prompt_tokens,
                    "computed": done.usage.prompt.prefilled,
                    "seconds": time.perf_counter() - began,
                }
            )
            messages += tool_message(call.id, call.name, call.arguments, step)
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(command: list[str], port: int, log: Any) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(command, stdout=log, stderr=log, env={**os.environ})
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[2]} did not start")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{command[2]} did not answer") from None
            time.sleep(0.5)


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return dict(json.loads(r.read()))


def compact(arguments: str) -> str:
    """Arguments as pydantic-ai and others send them back: parsed and written again
    without spaces (``{"city":"Paris"}`` for ``{"city": "Paris"}``)."""
    return json.dumps(json.loads(arguments), separators=(",", ":"))


def loop_over_http(
    port: int,
    model: str,
    steps: int,
    counted: Any,
    content: str | None = None,
    resend: Any = None,
) -> list[dict[str, float]]:
    rows = []
    messages = start_messages()
    for step in range(steps):
        began = time.perf_counter()
        body = post(
            port,
            {
                "model": model,
                "messages": messages,
                "tools": [WEATHER],
                "tool_choice": CHOICE,
                "max_tokens": 64,
                "temperature": 0,
            },
        )
        seconds = time.perf_counter() - began
        message = body["choices"][0]["message"]
        call = (message.get("tool_calls") or [None])[0]
        if call is None:
            raise RuntimeError(f"step {step + 1}: no tool call ({message.get('content')!r})")
        rows.append(
            {
                "prompt": body["usage"]["prompt_tokens"],
                "computed": counted(body),
                "seconds": seconds,
            }
        )
        fn = call["function"]
        arguments = resend(fn["arguments"]) if resend is not None else fn["arguments"]
        messages += tool_message(call["id"], fn["name"], arguments, step, content)
    return rows


def kvrt_serve_loop(steps: int, resend: Any = None) -> list[dict[str, float]]:
    """The loop against ``kvrt serve`` (the kvrt of the working folder), the calls sent
    back as they came or through ``resend``."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        command = [
            sys.executable,
            "-m",
            "kvrt",
            "serve",
            "--port",
            str(port),
            "--disk-budget",
            "0",
            "--session-tokens",
            "4096",
        ]
        proc = serve(command, port, log)
        try:
            model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())
            return loop_over_http(
                port,
                model["data"][0]["id"],
                steps,
                lambda body: body["usage"]["kvrt"]["prefilled_tokens"],
                resend=resend,
            )
        finally:
            proc.terminate()
            proc.wait(timeout=60)


EVAL = re.compile(rb"prompt eval time =\s+[\d.]+ ms /\s+(\d+) tokens")


def llama_server_loop(steps: int) -> list[dict[str, float]]:
    """The loop against llama-cpp-python's server; tokens computed per request from the
    ``prompt eval`` lines its llama.cpp context prints (``--verbose``)."""
    port = free_port()
    model = str(kvrt.embedded_model_path())
    with tempfile.NamedTemporaryFile() as log:
        command = [
            *LLAMA_SERVER, "--model", model, "--port", str(port),
            "--n_ctx", "4096", "--chat_format", "chatml-function-calling", "--cache", "true",
            "--verbose", "true",
        ]  # fmt: skip
        proc = serve(command, port, log)
        seen = 0

        def counted(_: dict[str, Any]) -> int:
            nonlocal seen
            with open(log.name, "rb") as f:
                counts = [int(m.group(1)) for m in EVAL.finditer(f.read())]
            new, seen = counts[seen:], len(counts)
            return sum(new)

        try:  # its request schema refuses an assistant message's null content: ""
            return loop_over_http(port, "model", steps, counted, content="")
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def table(title: str, columns: dict[str, list[dict[str, float]] | str]) -> None:
    print(f"\n{title}")
    names = list(columns)
    print("step  prompt  " + "  ".join(f"{n:>22}" for n in names))
    ok = {n: r for n, r in columns.items() if not isinstance(r, str)}
    first = next(iter(ok.values()), [])
    for i, row in enumerate(first):
        cells = []
        for n in names:
            rows = columns[n]
            if isinstance(rows, str) or i >= len(rows):
                cells.append(f"{'—':>22}")
            else:
                cells.append(f"{rows[i]['computed']:>8.0f} tok {rows[i]['seconds']:>8.2f} s")
        print(f"{i + 1:>4}  {row['prompt']:>6.0f}  " + "  ".join(cells))
    for n, rows in columns.items():
        if isinstance(rows, str):
            print(f"{n}: {rows}")
        else:
            later = rows[1:]
            print(
                f"{n}: {sum(r['computed'] for r in rows):.0f} tokens computed in all, "
                f"{sum(r['computed'] for r in later) / max(1, len(later)):.1f} a step after the "
                f"first, {sum(r['seconds'] for r in rows):.2f} s"
            )


def attempt(fn: Any, *args: Any) -> list[dict[str, float]] | str:
    try:
        return list(fn(*args))
    except Exception as exc:  # a peer that is missing or fails is reported, not fatal
        return f"not measured: {exc}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument(
        "--serve-only",
        action="store_true",
        help="only the kvrt serve loops (run from another checkout's folder to compare it)",
    )
    args = parser.parse_args(argv)
    steps = max(1, min(args.steps, len(CITIES)))
    if args.serve_only:
        table(
            f"{steps}-step tool loop against kvrt serve: tokens computed per step (and seconds)",
            {
                "calls sent back as made": attempt(kvrt_serve_loop, steps),
                "calls re-serialized": attempt(kvrt_serve_loop, steps, compact),
            },
        )
        return
    print("constrained decoding (greedy, 48 tokens, a 4-field JSON Schema)")
    for backend in ("llama", "openvino"):
        cost = anyio.run(grammar_cost, backend)
        print(
            f"{backend:>9}: {cost['free_tps']:.1f} tokens/s free, {cost['grammar_tps']:.1f} "
            f"under the grammar: {cost['overhead_ms']:.2f} ms a token"
        )
    columns: dict[str, list[dict[str, float]] | str] = {
        "kvrt in process": anyio.run(loop_in_process, steps)
    }
    if not args.no_http:
        columns["kvrt serve"] = attempt(kvrt_serve_loop, steps)
        columns["kvrt serve, re-serialized"] = attempt(kvrt_serve_loop, steps, compact)
        columns["llama_cpp.server"] = attempt(llama_server_loop, steps)
    table(f"{steps}-step tool loop: tokens computed per step (and seconds)", columns)


if __name__ == "__main__":
    main()
