"""``kvrt serve`` in process or as a process of its own on a free port, and plain HTTP
helpers."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import openai

import kvrt
import kvrt.serve

T = TypeVar("T")


@asynccontextmanager
async def server(
    *, engine: kvrt.backend.Engine | None = None, **settings: Any
) -> AsyncIterator[tuple[kvrt.Runtime, str]]:
    """A runtime served on a free loopback port (on ``engine``, else the embedded model
    loaded for it): the runtime and the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    opened = kvrt.open_runtime("llama") if engine is None else kvrt.open_runtime(engine=engine)
    async with opened as rt, anyio.create_task_group() as tg:
        config = kvrt.serve.ServeConfig(**settings)
        url = await tg.start(functools.partial(kvrt.serve.serve, rt, config, sock=sock))
        try:
            yield rt, url
        finally:
            tg.cancel_scope.cancel()


def client(url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", **kwargs)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args))


def post(url: str, path: str, body: bytes) -> tuple[int, dict[str, Any], Any]:
    request = urllib.request.Request(
        url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return str(response.read().decode())


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def kvrt_serve(log: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``kvrt serve`` as a process of its own on a free port, with ``flags``: its base URL
    once ``/health`` answers. Stopped on exit, when its log (``log``) must hold no
    traceback."""
    port = free_port()
    args = [sys.executable, "-m", "kvrt", "serve", "--port", str(port), *flags]
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
