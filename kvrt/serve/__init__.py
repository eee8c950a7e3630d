"""``kvrt serve``: an OpenAI-compatible server over a runtime.

``/v1/chat/completions`` (streamed over server-sent events or not), ``/v1/completions``,
``/v1/responses`` (and kept responses read back), ``/v1/conversations``, ``/v1/models``,
``/health`` and ``/metrics`` (Prometheus text), served by Starlette on Hypercorn, under
asyncio or trio; or in process through :func:`openai_client`. Requests need no header to reuse KV: a request whose
messages extend an earlier one's finds that session (or the cold store); ``X-Session-Id``
pins a conversation to a session of its own. Uses only kvrt's public API.

>>> async with kvrt.open_runtime() as rt:
...     await kvrt.serve.serve(rt, kvrt.serve.ServeConfig(port=8000))

The modules: the app in process for frameworks that take an ``openai`` client
(:mod:`.inprocess`), the ASGI application and its routing table (:mod:`.app`), API keys
and tenants (:mod:`.auth`), the server that lends each request's exchange a session and
streams its events, naming no API (:mod:`.server`), reading a request
(:mod:`.reading`), ``/metrics`` (:mod:`.metrics`), the bounded session pool
(:mod:`.pool`), replies streamed as server-sent events (:mod:`.streaming`) to clients
whose connection state says what they took (:mod:`.stall`), and how the server serves
(:mod:`.config`). One exchange per API surface is in :mod:`kvrt.serve.exchanges`, the
surfaces' pure translators in :mod:`kvrt.serve.protocol`, the server's own state in
:mod:`kvrt.serve.state`.
Dependencies run one way, in the order of :data:`LAYERS`; the architecture test holds it.
"""

from __future__ import annotations

import socket
from typing import Any

import anyio
import sniffio
from anyio.abc import TaskStatus
from hypercorn.config import Config as HypercornConfig

import kvrt

from .app import ServeConfig, Server, create_app, model_id
from .inprocess import openai_client, sync_openai_client, threaded_openai_client

__all__ = [
    "ServeConfig",
    "Server",
    "create_app",
    "listen",
    "model_id",
    "openai_client",
    "serve",
    "sync_openai_client",
    "threaded_openai_client",
]


async def serve(
    runtime: kvrt.Runtime,
    config: ServeConfig | None = None,
    *,
    sock: socket.socket | None = None,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``runtime`` until cancelled; ``task_status.started`` gets the base URL.

    ``sock``, a bound and listening socket (:func:`listen`), is served instead of
    ``config.host``/``port`` (tests bind port 0 and read the port from it).
    """
    config = config or ServeConfig()
    app = create_app(runtime, config)
    server: Server = app.state.server
    await server.open()  # a state store that cannot be used is refused before listening
    hc = HypercornConfig()
    if sock is None:
        sock = listen(config.host, config.port, send_buffer=config.send_buffer)
    host, port = sock.getsockname()[:2]
    hc.bind = [f"fd://{sock.detach()}"]  # the server owns the socket from here
    hc.accesslog = None
    hc.graceful_timeout = 2.0
    url = f"http://{host}:{port}"
    stop = anyio.Event()
    trio = sniffio.current_async_library() == "trio"
    try:
        async with anyio.create_task_group() as tg:
            if trio:
                await tg.start(_run_trio, app, hc, stop)
            else:
                tg.start_soon(_run_asyncio, app, hc, stop)
                await _listening(host, port)
            task_status.started(url)
            try:
                await anyio.sleep_forever()
            finally:
                stop.set()  # the server stops on its own, gracefully (graceful_timeout)
    finally:
        with anyio.CancelScope(shield=True):
            await server.aclose()


def listen(host: str, port: int, *, send_buffer: int = 65536) -> socket.socket:
    """A socket bound to ``host``:``port`` and listening, whose connections write through
    a send buffer of ``send_buffer`` bytes (so a client that stops reading is noticed
    after about that much unread: see ``ServeConfig.stall_timeout``); a
    :class:`kvrt.ConfigError` naming the address when it cannot be had (in use, no such
    host)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise kvrt.ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise kvrt.ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another port or host)"
        ) from None
    return sock


# The server runs shielded and stops when ``stop`` is set: cancelling Hypercorn from
# outside leaves its connection tasks half torn down on asyncio.


async def _run_trio(
    app: Any, hc: HypercornConfig, stop: anyio.Event, *, task_status: TaskStatus[object]
) -> None:
    from hypercorn.trio import serve as run

    with anyio.CancelScope(shield=True):
        await run(app, hc, shutdown_trigger=stop.wait, task_status=task_status)


async def _run_asyncio(app: Any, hc: HypercornConfig, stop: anyio.Event) -> None:
    from hypercorn.asyncio import serve as run

    with anyio.CancelScope(shield=True):
        await run(app, hc, shutdown_trigger=stop.wait)


async def _listening(host: str, port: int) -> None:
    """Wait until the server accepts connections."""
    with anyio.fail_after(30):
        while True:
            try:
                stream = await anyio.connect_tcp(host, port)
            except OSError:
                await anyio.sleep(0.02)
                continue
            await stream.aclose()
            return


LAYERS = (
    "inprocess",
    "app",
    "auth",
    "server",
    "reading",
    "metrics",
    "pool",
    "streaming",
    "stall",
    "config",
)
"""The modules from the top down: each imports only those after it."""
