"""kvrt's OpenAI-compatible app in process, for frameworks that take an ``openai`` client:
no port, no server, and streams that stream (each event reaches the client as the
session makes it; httpx's own ``ASGITransport`` hands a response over only once it is
whole).

>>> async with kvrt.open_runtime() as rt, kvrt.serve.openai_client(rt) as client:
...     reply = await client.chat.completions.create(model=client.kvrt_model, messages=[...])
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from types import ModuleType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import sniffio
from anyio.streams.memory import MemoryObjectReceiveStream

import kvrt

from .app import ServeConfig, create_app, model_id

__all__ = ["in_process_transport", "openai_client"]

_log = logging.getLogger("kvrt.serve")

BASE_URL = "http://kvrt.in-process"


async def _exchange(
    app: Any, tg: anyio.abc.TaskGroup, request: Any, buffer: int
) -> tuple[dict[str, Any], MemoryObjectReceiveStream[dict[str, Any]], anyio.Event]:
    """Run ``app`` on ``request`` in a task of ``tg``: the response's head, the messages
    that follow it as the app sends them, and the event that tells the app its client
    has gone."""
    body = await request.aread()
    send, received = anyio.create_memory_object_stream[dict[str, Any]](buffer)
    gone = anyio.Event()
    read = False

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def forward(message: dict[str, Any]) -> None:
        try:
            await send.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            gone.set()  # the client closed the response: nothing more is read

    url = request.url
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": url.scheme,
        "path": url.path,
        "raw_path": url.raw_path.split(b"?", 1)[0],
        "query_string": url.query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "client": ("127.0.0.1", 0),
        "server": (url.host, url.port or 80),
    }

    async def run() -> None:
        async with send:
            try:
                await app(scope, receive, forward)
            except Exception:  # the app has answered 500; its error is never the caller's
                _log.exception("kvrt's app failed on %s %s", request.method, url.path)

    tg.start_soon(run)
    try:
        head = await received.receive()
    except anyio.EndOfStream:
        head = {}
    if head.get("type") != "http.response.start":
        received.close()
        raise ConnectionError(f"kvrt's app sent no response head ({head.get('type')!r})")
    return head, received, gone


@functools.cache
def in_process_transport(http: ModuleType) -> type[Any]:
    """The transport class, for the httpx module ``http`` (``httpx``, or ``httpx2`` that
    newer ``openai`` releases use): ``cls(app, task_group)`` runs an ASGI app in tasks of
    the group, the response handed back as soon as its head is sent and its body as it
    is written. A client that closes a response early is a disconnect to the app (a
    generation stops where it is, as with a client that leaves ``kvrt serve``)."""

    class Body(http.AsyncByteStream):  # type: ignore[misc, name-defined]
        def __init__(
            self, received: MemoryObjectReceiveStream[dict[str, Any]], gone: anyio.Event
        ) -> None:
            self._received, self._gone = received, gone

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for message in self._received:
                if message.get("type") != "http.response.body":
                    continue
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break

        async def aclose(self) -> None:
            self._gone.set()  # the app sees its client leave, and stops its work
            self._received.close()

    class Transport(http.AsyncBaseTransport):  # type: ignore[misc, name-defined]
        def __init__(self, app: Any, tg: anyio.abc.TaskGroup, *, buffer: int = 32) -> None:
            self._app, self._tg, self._buffer = app, tg, buffer

        async def handle_async_request(self, request: Any) -> Any:
            try:
                head, received, gone = await _exchange(self._app, self._tg, request, self._buffer)
            except ConnectionError as exc:
                raise http.RemoteProtocolError(str(exc)) from None
            return http.Response(
                head["status"],
                headers=head.get("headers", []),
                stream=Body(received, gone),
                request=request,
            )

    return Transport


class _Owner:
    """The event loop (and thread) an in-process client belongs to: its app's tasks run
    in that loop's task group, which no other loop or thread may touch."""

    def __init__(self) -> None:
        self.thread = threading.current_thread()
        self.library = sniffio.current_async_library()
        self.token = anyio.lowlevel.current_token()

    def check(self) -> None:
        """Raise at once when called from another event loop or thread."""
        here = threading.current_thread()
        try:
            token = anyio.lowlevel.current_token()
            library = sniffio.current_async_library()
        except (RuntimeError, sniffio.AsyncLibraryNotFoundError):
            token, library = None, "no anyio-compatible"
        if here is self.thread and token == self.token:
            return
        raise kvrt.InvalidArgumentError(
            f"this in-process client belongs to the {self.library} event loop of thread "
            f"{self.thread.name!r}, and was used from the {library} event loop of thread "
            f"{here.name!r}: open a kvrt.serve.openai_client in each event loop that uses one"
        )


async def _shielded(close: Callable[[], Awaitable[None]]) -> None:
    with anyio.CancelScope(shield=True):
        await close()


@asynccontextmanager
async def openai_client(
    runtime: kvrt.Runtime, config: ServeConfig | None = None, **options: Any
) -> AsyncIterator[Any]:
    """An ``openai.AsyncOpenAI`` served by ``runtime`` in process (``config`` as for
    ``kvrt serve``; ``options`` go to the client), with the model's id as
    ``client.kvrt_model``. Everything the server offers works, streams included: hand it
    to the Agents SDK, pydantic-ai or LangChain where they take an OpenAI client.

    The app's tasks live inside this block; leaving it stops any still running."""
    try:
        import openai
    except ImportError:
        raise kvrt.ConfigError(
            "kvrt.serve.openai_client needs openai: pip install openai"
        ) from None
    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    http = importlib.import_module(base.__module__.split(".")[0])
    if not isinstance(runtime, kvrt.Runtime):
        raise kvrt.ArgumentTypeError(
            f"runtime must be a kvrt.Runtime (from kvrt.open_runtime), got {type(runtime).__name__}"
        )
    if config is not None and not isinstance(config, ServeConfig):
        raise kvrt.ArgumentTypeError(
            f"config must be a kvrt.serve.ServeConfig, got {type(config).__name__}"
        )
    config = config or ServeConfig()
    app = create_app(runtime, config)
    keys = config.tenants()
    server = app.state.server
    await server.open()
    async with AsyncExitStack() as stack, anyio.create_task_group() as tg:
        stack.push_async_callback(_shielded, server.aclose)
        transport = in_process_transport(http)(app, tg)
        async with http.AsyncClient(transport=transport, base_url=BASE_URL) as client_http:
            owner = _Owner()

            class Client(openai.AsyncOpenAI):
                """An ``AsyncOpenAI`` that serves only the event loop it was made in."""

                async def request(self, *args: Any, **kwargs: Any) -> Any:
                    owner.check()  # before the client retries or touches the app
                    return await super().request(*args, **kwargs)

            client = Client(
                base_url=f"{BASE_URL}/v1",
                api_key=options.pop("api_key", next(iter(keys), "in-process")),
                http_client=client_http,
                **options,
            )
            client.kvrt_model = model_id(runtime, config)  # type: ignore[attr-defined]
            try:
                yield client
            finally:
                tg.cancel_scope.cancel()
