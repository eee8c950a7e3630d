"""kvrt's OpenAI-compatible app in process, for frameworks that take an ``openai`` client:
no port, no server, and streams that stream (each event reaches the client as the
session makes it; httpx's own ``ASGITransport`` hands a response over only once it is
whole).

>>> async with kvrt.open_runtime() as rt, kvrt.serve.openai_client(rt) as client:
...     reply = await client.chat.completions.create(model=client.kvrt_model, messages=[...])

Frameworks that build a sync ``openai.OpenAI`` get its twin: :func:`sync_openai_client`
(a plain ``with``; the runtime runs on an event loop in a thread of its own) or, from async
code that hands the client to worker threads, :func:`threaded_openai_client`. Both reach the
app through anyio's blocking portal, from any thread but the event loop's own.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from types import ModuleType
from typing import Any, NoReturn, Protocol

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import sniffio
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.types import ASGIApp, Message

import kvrt

from .app import ServeConfig, create_app, model_id

__all__ = [
    "in_process_transport",
    "openai_client",
    "sync_openai_client",
    "threaded_openai_client",
]

_log = logging.getLogger("kvrt.serve")

BASE_URL = "http://kvrt.in-process"


class _Url(Protocol):
    @property
    def scheme(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def raw_path(self) -> bytes: ...
    @property
    def query(self) -> bytes: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int | None: ...


class _Headers(Protocol):
    @property
    def raw(self) -> list[tuple[bytes, bytes]]: ...


class _Request(Protocol):
    """What is read of an httpx request."""

    @property
    def method(self) -> str: ...
    @property
    def url(self) -> _Url: ...
    @property
    def headers(self) -> _Headers: ...
    def read(self) -> bytes: ...
    async def aread(self) -> bytes: ...


async def _exchange(
    app: ASGIApp, tg: anyio.abc.TaskGroup, request: _Request, body: bytes, buffer: int
) -> tuple[Message, MemoryObjectReceiveStream[Message], anyio.Event]:
    """Run ``app`` on ``request`` (whose ``body`` was read) in a task of ``tg``: the
    response's head, the messages that follow it as the app sends them, and the event that
    tells the app its client has gone."""
    send, received = anyio.create_memory_object_stream[Message](buffer)
    gone = anyio.Event()
    unread = [body]  # handed over once, then held no more (a cancelled wait below sits in
    del body  # a reference cycle with its frame until the garbage collector looks)

    async def receive() -> Message:
        if unread:
            return {"type": "http.request", "body": unread.pop(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def forward(message: Message) -> None:
        try:
            await send.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            gone.set()  # the client closed the response: nothing more is read

    url = request.url
    scope: Message = {
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
        head = {"type": None}
    if head.get("type") != "http.response.start":
        received.close()
        raise ConnectionError(f"kvrt's app sent no response head ({head.get('type')!r})")
    return head, received, gone


@functools.cache
def in_process_transport(http: ModuleType) -> Callable[..., object]:
    """The transport class, for the httpx module ``http`` (``httpx``, or ``httpx2`` that
    newer ``openai`` releases use): ``cls(app, task_group)`` runs an ASGI app in tasks of
    the group, the response handed back as soon as its head is sent and its body as it
    is written. A client that closes a response early is a disconnect to the app (a
    generation stops where it is, as with a client that leaves ``kvrt serve``)."""

    class Body(http.AsyncByteStream):  # type: ignore[misc, name-defined]
        def __init__(self, received: MemoryObjectReceiveStream[Message], gone: anyio.Event) -> None:
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
        def __init__(self, app: ASGIApp, tg: anyio.abc.TaskGroup, *, buffer: int = 32) -> None:
            self._app, self._tg, self._buffer = app, tg, buffer

        async def handle_async_request(self, request: _Request) -> object:
            try:
                body = await request.aread()
                head, received, gone = await _exchange(
                    self._app, self._tg, request, body, self._buffer
                )
            except ConnectionError as exc:
                raise http.RemoteProtocolError(str(exc)) from None
            return http.Response(
                head["status"],
                headers=head.get("headers", []),
                stream=Body(received, gone),
                request=request,
            )

    return Transport


async def _next_body(received: MemoryObjectReceiveStream[Message]) -> bytes | None:
    """The next piece of a response's body, b"" for a message that carries none, None at
    its end."""
    try:
        message = await received.receive()
    except (anyio.EndOfStream, anyio.ClosedResourceError):
        return None
    if message.get("type") != "http.response.body":
        return b""
    if not message.get("more_body", False):
        received.close()
    return bytes(message.get("body") or b"")


async def _close_body(received: MemoryObjectReceiveStream[Message], gone: anyio.Event) -> None:
    gone.set()
    received.close()


@functools.cache
def _sync_transport(http: ModuleType) -> Callable[..., object]:
    """The sync twin of :func:`in_process_transport`: ``cls(app, task_group, portal)``,
    each request and each piece of its body carried across ``portal`` to the event loop
    the app runs in."""

    class Body(http.SyncByteStream):  # type: ignore[misc, name-defined]
        def __init__(
            self,
            portal: anyio.from_thread.BlockingPortal,
            received: MemoryObjectReceiveStream[Message],
            gone: anyio.Event,
        ) -> None:
            self._portal, self._received, self._gone = portal, received, gone

        def __iter__(self) -> Iterator[bytes]:
            while (piece := self._portal.call(_next_body, self._received)) is not None:
                if piece:
                    yield piece

        def close(self) -> None:
            with contextlib.suppress(RuntimeError):  # a closed portal: the app is gone too
                self._portal.call(_close_body, self._received, self._gone)

    class Transport(http.BaseTransport):  # type: ignore[misc, name-defined]
        def __init__(
            self,
            app: ASGIApp,
            tg: anyio.abc.TaskGroup,
            portal: anyio.from_thread.BlockingPortal,
            *,
            buffer: int = 32,
        ) -> None:
            self._app, self._tg, self._portal, self._buffer = app, tg, portal, buffer

        def handle_request(self, request: _Request) -> object:
            body = request.read()
            try:
                head, received, gone = self._portal.call(
                    _exchange, self._app, self._tg, request, body, self._buffer
                )
            except ConnectionError as exc:
                raise http.RemoteProtocolError(str(exc)) from None
            return http.Response(
                head["status"],
                headers=head.get("headers", []),
                stream=Body(self._portal, received, gone),
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


def _openai() -> tuple[ModuleType, ModuleType]:
    """The ``openai`` module and the httpx module its clients are built on (``httpx``, or
    ``httpx2`` in newer releases)."""
    try:
        import openai
    except ImportError:
        raise kvrt.ConfigError(
            "kvrt's in-process clients need openai: pip install openai"
        ) from None
    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    return openai, importlib.import_module(base.__module__.split(".")[0])


class _Served:
    """kvrt's app running in one event loop: the app, the task group its requests run
    in, the api key a client uses and the model's id."""

    def __init__(self, app: ASGIApp, tg: anyio.abc.TaskGroup, api_key: str, model: str) -> None:
        self.app, self.tg, self.api_key, self.model = app, tg, api_key, model
        self.thread = threading.current_thread()
        """The event loop's thread, which a sync client must not block."""


@asynccontextmanager
async def _serving(runtime: kvrt.Runtime, config: ServeConfig | None) -> AsyncIterator[_Served]:
    """Run kvrt's app for ``runtime`` in this event loop; leaving stops any request still
    running and closes the app's server state."""
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
    key = next(iter(config.tenants()), "in-process")
    server = app.state.server
    await server.open()
    try:
        async with AsyncExitStack() as stack, anyio.create_task_group() as tg:
            stack.push_async_callback(_shielded, server.aclose)
            try:
                yield _Served(app, tg, key, model_id(runtime, config))
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The app's tasks log their own failures: a group holds what the caller's block
        # raised, which is the caller's to see as raised, not wrapped.
        if len(group.exceptions) == 1:
            _reraise(group.exceptions[0])
        raise


def _reraise(exc: BaseException) -> NoReturn:
    """Raise ``exc`` again as it was raised (its cause and context its own)."""
    kept = exc.__cause__, exc.__context__, exc.__suppress_context__
    try:
        raise exc
    finally:
        exc.__cause__, exc.__context__, exc.__suppress_context__ = kept


@asynccontextmanager
async def openai_client(
    runtime: kvrt.Runtime, config: ServeConfig | None = None, **options: object
) -> AsyncIterator[Any]:
    """An ``openai.AsyncOpenAI`` served by ``runtime`` in process (``config`` as for
    ``kvrt serve``; ``options`` go to the client), with the model's id as
    ``client.kvrt_model``. Everything the server offers works, streams included: hand it
    to the Agents SDK, pydantic-ai or LangChain where they take an OpenAI client, and its
    httpx client (``client.kvrt_http_client``) to those that take one (LiteLLM's
    ``aclient_session``).

    The app's tasks live inside this block; leaving it stops any still running."""
    openai, http = _openai()
    async with _serving(runtime, config) as served:
        transport = in_process_transport(http)(served.app, served.tg)
        async with http.AsyncClient(transport=transport, base_url=BASE_URL) as client_http:
            owner = _Owner()

            class Client(openai.AsyncOpenAI):  # type: ignore[misc, name-defined]
                """An ``AsyncOpenAI`` that serves only the event loop it was made in."""

                async def request(self, *args: object, **kwargs: object) -> object:
                    owner.check()  # before the client retries or touches the app
                    return await super().request(*args, **kwargs)

            yield _made(Client, served, client_http, options)


def _sync_client(
    portal: anyio.from_thread.BlockingPortal, served: _Served, options: dict[str, object]
) -> Any:
    openai, http = _openai()
    transport = _sync_transport(http)(served.app, served.tg, portal)

    class Client(openai.OpenAI):  # type: ignore[misc, name-defined]
        """An ``OpenAI`` that refuses the thread of the event loop its app runs in."""

        def request(self, *args: object, **kwargs: object) -> object:
            if threading.current_thread() is served.thread:  # before the client retries
                raise kvrt.InvalidArgumentError(
                    "a sync in-process client was called from the thread of the event loop "
                    "that runs kvrt's app (it would wait on itself): call it from another "
                    "thread (anyio.to_thread.run_sync), or use kvrt.serve.openai_client there"
                )
            return super().request(*args, **kwargs)

    return _made(Client, served, http.Client(transport=transport, base_url=BASE_URL), options)


def _made(
    cls: Callable[..., Any], served: _Served, client_http: object, options: dict[str, object]
) -> Any:
    """An openai client of class ``cls`` on ``client_http``, with the model's id as
    ``kvrt_model`` and its httpx client as ``kvrt_http_client``."""
    client = cls(
        base_url=f"{BASE_URL}/v1",
        api_key=options.pop("api_key", served.api_key),
        http_client=client_http,
        **options,
    )
    client.kvrt_model = served.model
    client.kvrt_http_client = client_http
    return client


@asynccontextmanager
async def threaded_openai_client(
    runtime: kvrt.Runtime, config: ServeConfig | None = None, **options: object
) -> AsyncIterator[Any]:
    """A sync ``openai.OpenAI`` served by ``runtime`` in process, for code that runs in
    other threads (a sync framework under ``anyio.to_thread.run_sync``): its requests cross
    to this event loop on a blocking portal. Called from this loop's own thread, it refuses
    (it would wait on itself). Leaving the block stops any request still running."""
    async with anyio.from_thread.BlockingPortal() as portal, _serving(runtime, config) as served:
        client = _sync_client(portal, served, options)
        try:
            yield client
        finally:
            client.close()


@contextmanager
def sync_openai_client(
    runtime_config: kvrt.Config | None = None,
    config: ServeConfig | None = None,
    *,
    model: str | None = None,
    async_backend: str = "asyncio",
    **options: object,
) -> Iterator[Any]:
    """A sync ``openai.OpenAI`` with kvrt in process, for sync programs (smolagents, DSPy,
    Instructor): a runtime opened with ``runtime_config`` (and ``model``, as
    :func:`kvrt.open_runtime` takes them) runs kvrt's app on an event loop
    (``async_backend``: asyncio or trio) in a thread of its own, and the client's requests and streams reach it
    from any thread. The model's id is ``client.kvrt_model``, its httpx client
    ``client.kvrt_http_client`` (LiteLLM's ``client_session``, for DSPy); leaving the block
    closes the runtime.

    >>> with kvrt.serve.sync_openai_client() as client:
    ...     reply = client.chat.completions.create(model=client.kvrt_model, messages=[...])
    """
    if runtime_config is not None and not isinstance(runtime_config, kvrt.Config):
        raise kvrt.ArgumentTypeError(
            f"runtime_config must be a kvrt.Config, got {type(runtime_config).__name__}"
        )
    if async_backend not in ("asyncio", "trio"):
        raise kvrt.InvalidArgumentError(
            f"async_backend must be 'asyncio' or 'trio', got {async_backend!r}"
        )
    _openai()  # a missing openai is said before a runtime opens
    with (
        anyio.from_thread.start_blocking_portal(async_backend, name="kvrt in-process") as portal,
        portal.wrap_async_context_manager(
            kvrt.open_runtime(model=model, config=runtime_config)
        ) as runtime,
        portal.wrap_async_context_manager(_serving(runtime, config)) as served,
    ):
        client = _sync_client(portal, served, options)
        try:
            yield client
        finally:
            client.close()
