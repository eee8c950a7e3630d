"""``kvrt serve``: an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from functools import partial
from pathlib import Path
from typing import Any

from kvrt import ConfigError, check_policies, read_small_file
from kvrt.native_bridge.memory import fix_mmap_threshold

from .arguments import common, config_from, count, seconds, size

__all__ = ["add", "main"]

MAX_KEYS_BYTES = 1 << 20
"""The largest API keys' file read (a key a line: thousands of keys)."""


def add(sub: Any) -> None:
    """Register the command."""
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1)")
    serve.add_argument("--port", type=count(0, 65535), default=8000, help="port (default 8000)")
    serve.add_argument(
        "--max-sessions",
        type=count(1, 256),
        default=4,
        metavar="N",
        help="sessions kept live at once (default 4)",
    )
    serve.add_argument(
        "--max-queue",
        type=count(0, 100_000),
        default=16,
        metavar="N",
        help="requests waiting for a session before 429s (default 16)",
    )
    serve.add_argument(
        "--idle-sessions",
        type=count(0, 256),
        default=None,
        metavar="N",
        help="idle sessions kept live when a request takes one and no other is served; the "
        "others go to the cold store and free their memory (default: all)",
    )
    serve.add_argument(
        "--session-tokens",
        type=count(64),
        default=None,
        metavar="N",
        help="each session's hot window in tokens (default: the runtime's)",
    )
    serve.add_argument(
        "--model-name",
        default=None,
        metavar="ID",
        help="model id clients send (default: file name)",
    )
    serve.add_argument(
        "--stall-timeout",
        type=seconds,
        default=30.0,
        metavar="S",
        help="seconds a streaming client may hold bytes it has not read before its stream is "
        "closed and its session freed, however slow the engine (default 30)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        metavar="KEYS",
        help="require 'Authorization: Bearer KEY' on every route but /health: one key, "
        "several separated by commas, or '@PATH', a file of one key a line, each optionally "
        "followed by its tenant's name ('KEY NAME'); each tenant reuses only its own cache "
        "(default: $KVRT_API_KEY)",
    )
    serve.add_argument(
        "--send-buffer",
        type=count(4096, 2**26),
        default=65536,
        metavar="BYTES",
        help="each connection's socket send buffer (default 65536)",
    )
    serve.add_argument(
        "--max-grammar-bytes",
        type=size(1024, 2**26),
        default=256 * 1024,
        metavar="SIZE",
        help="largest JSON Schema (response format, tool parameters) compiled for a "
        "request; larger ones are a 400 before anything is compiled (default 256KiB)",
    )
    serve.add_argument(
        "--grammar-timeout",
        type=seconds,
        default=10.0,
        metavar="S",
        help="seconds reading a request and compiling its grammars may take, off the event "
        "loop; past them the request is a 400 (default 10)",
    )
    serve.add_argument(
        "--response-store",
        type=size(0, 2**40),
        default=64 * 2**20,
        metavar="SIZE",
        help="what each tenant's kept responses (for previous_response_id) may take; the "
        "least recently used go first (default 64MiB)",
    )
    serve.add_argument(
        "--conversation-store",
        type=size(0, 2**40),
        default=256 * 2**20,
        metavar="SIZE",
        help="what each tenant's conversations may take; past it items are refused until "
        "some are deleted (default 256MiB)",
    )
    serve.add_argument(
        "--state",
        default=None,
        metavar="PATH",
        help="SQLite database of kept responses and conversations, to outlive restarts "
        "(default: $KVRT_CACHE_DIR/state.sqlite3, beside the disk tier's blocks; none: "
        "memory only); with --remote-url they live on that server, shared by the replicas",
    )
    serve.add_argument(
        "--loop",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="event loop (default asyncio)",
    )
    common(serve)
    serve.set_defaults(handler=main)


def _state(given: str | None) -> str | None:
    """``--state``: a database file, ``none``, or the default beside the blocks."""
    if given is not None:
        return None if given.lower() == "none" else given
    from kvrt.cold import default_disk_path

    return str(default_disk_path().parent / "state.sqlite3")


def main(args: argparse.Namespace) -> None:
    fix_mmap_threshold()  # a long-lived process: what kvrt frees goes back to the system
    import anyio

    from kvrt import open_runtime
    from kvrt.serve import ServeConfig, listen, model_id, serve

    config = config_from(args)
    check_policies(config)
    settings = ServeConfig(
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        max_queue=args.max_queue,
        idle_sessions=args.idle_sessions,
        hot_tokens=args.session_tokens,
        model_name=args.model_name,
        stall_timeout=args.stall_timeout,
        send_buffer=args.send_buffer,
        max_grammar_bytes=args.max_grammar_bytes,
        grammar_timeout=args.grammar_timeout,
        response_store_bytes=args.response_store,
        conversation_store_bytes=args.conversation_store,
        state_path=_state(args.state),
        api_keys=_api_keys(args),
    )
    # Bound before the model loads: a port in use is one line and exit status 2, at once.
    sock = listen(args.host, args.port, send_buffer=args.send_buffer)

    async def main() -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_runtime(config=config) as rt, anyio.create_task_group() as tg:
                url = await tg.start(partial(serve, rt, settings, sock=sock))
                print(f"kvrt serve: {url}/v1 (model {model_id(rt, settings)})", flush=True)
                async for signum in signals:
                    print(f"kvrt serve: stopping ({signal.Signals(signum).name})", flush=True)
                    tg.cancel_scope.cancel()
                    break

    anyio.run(main, backend=args.loop)


def _api_keys(args: argparse.Namespace) -> dict[str, str]:
    """The keys ``kvrt serve`` accepts, each with its tenant: ``--api-key``, else
    ``$KVRT_API_KEY``; a comma list (``k1,k2``), or ``@PATH``, a file of one key a line
    with an optional tenant name after it (``KEY NAME``; blank lines and ``#`` comments
    skipped). A key without a name is a tenant of its own, named by its digest."""
    given = args.api_key if args.api_key is not None else os.environ.get("KVRT_API_KEY")
    if not given:
        return {}
    if given.startswith("@"):
        raw = read_small_file(Path(given[1:]), MAX_KEYS_BYTES, "the API keys' file")
        try:
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise ConfigError(f"the API keys' file {given[1:]} is not UTF-8 text: {exc}") from None
        entries = [
            (n, line.strip())
            for n, line in enumerate(lines, 1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
        where = f"{given[1:]}, line"
    else:
        entries = [(n, part.strip()) for n, part in enumerate(given.split(","), 1)]
        where = "--api-key, key"
    keys: dict[str, str] = {}
    for n, entry in entries:
        key, _, name = entry.partition(" ")
        name = name.strip()
        if not key or not key.isprintable() or not name.isprintable():
            raise ConfigError(f"{where} {n}: a key must be printable text without spaces")
        if key in keys:
            raise ConfigError(f"{where} {n}: the key appears twice")
        keys[key] = name or "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    if not keys:
        raise ConfigError(f"no API key in {given[1:] if given.startswith('@') else '--api-key'}")
    return keys
