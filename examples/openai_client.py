"""The ``openai`` client against ``kvrt serve``: any OpenAI-compatible framework works
the same way, pointed at the server's base URL.

Start the server in one shell, then run this in another::

    kvrt serve --port 8000
    python examples/openai_client.py http://127.0.0.1:8000/v1

Without an argument it starts a server in-process on a free port and talks to it.
"""

from __future__ import annotations

import socket
import sys
from functools import partial

import anyio
import openai

import kvrt
import kvrt.serve


def converse(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed")
    model = client.models.list().data[0].id
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
    ]
    for question in ("Name a planet.", "How far is it from the sun?", "Thanks!"):
        messages.append({"role": "user", "content": question})
        stream = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, cached = "", 0
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
        print(f"> {question}\n{text}\n  [cached prompt tokens: {cached}]")
        messages.append({"role": "assistant", "content": text})


async def serve_and_converse() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    async with kvrt.open_runtime() as rt, anyio.create_task_group() as tg:
        url = await tg.start(partial(kvrt.serve.serve, rt, sock=sock))
        await anyio.to_thread.run_sync(converse, f"{url}/v1")
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        converse(sys.argv[1])
    else:
        anyio.run(serve_and_converse)
