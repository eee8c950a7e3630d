"""``kvrt serve`` in process on a free port, and plain HTTP helpers."""

from __future__ import annotations

import functools
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import openai

import kvrt
import kvrt.serve

T = TypeVar("T")


@asynccontextmanager
async def server(**settings: Any) -> AsyncIterator[tuple[kvrt.Runtime, str]]:
    """A runtime served on a free loopback port: the runtime and the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    async with kvrt.open_runtime("llama") as rt, anyio.create_task_group() as tg:
        config = kvrt.serve.ServeConfig(**settings)
        url = await tg.start(functools.partial(kvrt.serve.serve, rt, config, sock=sock))
        try:
            yield rt, url
        finally:
            tg.cancel_scope.cancel()


def client(url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", **kwargs)


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
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
