"""One ``kvrt serve`` shared by clients with heavy schemas and clients with small chats,
measured side by side in one run.

Four clients send, back to back, requests under the heaviest JSON Schema the server
accepts (a response format just under ``max_grammar_bytes``: hundreds of optional
properties, each described), or the schema that once stalled the server (8,000
properties, 1.2 MB: now refused before it is compiled). Meanwhile a fifth client times
``GET /health`` and a small chat (two tokens). The same two are timed with the server
alone first; the ratios are the figures to read.

Each engine-turn policy named (``--policies``, default ``least_served,fifo``) gets a
server of its own, measured the same way: the policy decides whether the small chat's
engine calls wait behind the heavy requests' decoding steps.

Run: ``python -m benchmarks.shared_server [--model PATH] [--rounds 10]``. Figures to
read, not assertions; every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.tool_loop import free_port, serve

HEAVY_CLIENTS = 4


def schema(properties: int, description: int) -> dict[str, Any]:
    """An object of ``properties`` optional string properties, each described by
    ``description`` characters."""
    props = {
        f"field_{i:05d}": {"type": "string", "maxLength": 20, "description": "d" * description}
        for i in range(properties)
    }
    return {"type": "object", "properties": props, "additionalProperties": False}


LOADS = {
    "the largest accepted schema (490 optional properties, 231 KB)": schema(490, 400),
    "the schema that stalled it (8,000 properties, 1.2 MB: refused)": schema(8000, 130),
}


def call(port: int, method: str, path: str, body: dict[str, Any] | bytes | None = None) -> int:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def timed(fn: Any, *args: Any) -> float:
    began = time.perf_counter()
    fn(*args)
    return time.perf_counter() - began


def probe(port: int, model: str, rounds: int) -> dict[str, list[float]]:
    """``/health`` and a two-token chat, ``rounds`` times each, in seconds."""
    small = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 2,
        "temperature": 0,
    }
    found: dict[str, list[float]] = {"health": [], "chat": []}
    for _ in range(rounds):
        found["health"].append(timed(call, port, "GET", "/health"))
        found["chat"].append(timed(call, port, "POST", "/v1/chat/completions", small))
        time.sleep(0.1)
    return found


def load(port: int, model: str, fmt: dict[str, Any], stop: threading.Event, out: list[int]) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Fill in the form."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": fmt}},
    }
    # Encoded once: the clients share the server's cores, and encoding a 1.6 MB body for
    # every request would take them a whole core, measured against the server.
    data = json.dumps(body).encode()
    while not stop.is_set():
        out.append(call(port, "POST", "/v1/chat/completions", data))


def under_load(
    port: int, model: str, fmt: dict[str, Any], rounds: int, settle: float
) -> dict[str, Any]:
    stop = threading.Event()
    statuses: list[int] = []
    clients = [
        threading.Thread(target=load, args=(port, model, fmt, stop, statuses))
        for _ in range(HEAVY_CLIENTS)
    ]
    for client in clients:
        client.start()
    time.sleep(settle)  # the heavy requests under way
    began = time.perf_counter()
    found: dict[str, Any] = probe(port, model, rounds)
    took = time.perf_counter() - began
    stop.set()
    for client in clients:
        client.join()
    found["heavy"] = statuses
    found["heavy_per_s"] = len(statuses) / max(took, 1e-9)
    return found


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1e3:7.1f} ms, max {max(values) * 1e3:7.1f} ms"


def measure(model_path: str | None, policy: str, rounds: int, settle: float = 2.0) -> None:
    """One server, with ``policy`` picking the engine's next call: the probes alone, then
    under each load."""
    port = free_port()
    command = [sys.executable, "-m", "kvrt", "serve", "--port", str(port), "--disk-budget", "0"]
    command += ["--max-sessions", str(HEAVY_CLIENTS + 1), "--max-queue", "16"]
    command += ["--engine-turn-policy", policy]
    if model_path:
        command += ["--model", model_path]
    with tempfile.TemporaryDirectory() as tmp, (Path(tmp) / "serve.log").open("wb") as log:
        proc = serve(command, port, log)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
                model = json.loads(r.read())["data"][0]["id"]
            probe(port, model, 2)  # warm: sessions open, the vocabulary read
            alone = probe(port, model, rounds)
            print(f"\nengine turns: {policy}")
            print(f"  alone: /health {ms(alone['health'])}; 2-token chat {ms(alone['chat'])}")
            for title, fmt in LOADS.items():
                size = len(json.dumps(fmt))
                found = under_load(port, model, fmt, rounds, settle)
                codes = sorted(set(found["heavy"]))
                ratio = statistics.median(found["chat"]) / statistics.median(alone["chat"])
                print(f"  {HEAVY_CLIENTS} clients sending {title}, {size:,} bytes of JSON")
                print(
                    f"    their requests: {len(found['heavy'])} answered "
                    f"({found['heavy_per_s']:.1f}/s), statuses {codes}"
                )
                print(f"    /health      {ms(found['health'])}")
                print(f"    2-token chat {ms(found['chat'])}: {ratio:.2f}x its time alone")
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a GGUF model (default: the embedded one)")
    parser.add_argument("--rounds", type=int, default=10, help="probes of each kind (10)")
    parser.add_argument(
        "--policies",
        default="least_served,fifo",
        help="engine-turn policies to compare, one server each (least_served,fifo)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds the load runs before the probes begin (2)",
    )
    args = parser.parse_args(argv)
    for policy in args.policies.split(","):
        measure(args.model, policy, args.rounds, args.settle)


if __name__ == "__main__":
    main()
