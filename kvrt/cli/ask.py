"""``kvrt ask``: a question about documents however long — read into one long-context
session (computed a window at a time, with a progress bar meanwhile), then answered."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from .arguments import common, config_from, count

__all__ = ["add", "main"]

MAX_FILE_BYTES = 64 << 20
"""Bytes read from one document at most (about 16 million tokens of text)."""


def add(sub: Any) -> None:
    """Register the command."""
    ask = sub.add_parser(
        "ask",
        help="ask about documents longer than the model's context (a long-context session)",
    )
    ask.add_argument("files", nargs="+", metavar="FILE", help="text files, the context in order")
    ask.add_argument("--question", "-q", required=True, help="the question, asked after them")
    ask.add_argument(
        "--max-tokens",
        type=count(1, 4096),
        default=128,
        metavar="N",
        help="tokens of the answer at most (default 128)",
    )
    ask.add_argument("--json", action="store_true", help="print JSON instead of text")
    common(ask)
    ask.set_defaults(handler=main)


def read_documents(paths: list[str]) -> list[tuple[str, str]]:
    """Each file's name and text: UTF-8, at most :data:`MAX_FILE_BYTES`; a kvrt error naming
    the file otherwise."""
    from kvrt import InvalidArgumentError

    out = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(data) > MAX_FILE_BYTES:
            raise InvalidArgumentError(f"{path} holds more than {MAX_FILE_BYTES >> 20} MiB")
        try:
            out.append((Path(path).name, data.decode()))
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"{path} is not UTF-8 text: {exc.reason}") from None
    return out


def main(args: argparse.Namespace) -> None:
    import anyio

    from kvrt.native_bridge.memory import fix_mmap_threshold

    fix_mmap_threshold()  # a long context frees large buffers: they go back to the system
    config = config_from(args)
    documents = read_documents(args.files)
    content = "".join(f"{name}:\n{text}\n\n" for name, text in documents) + args.question
    shown = _Shown(sys.stderr)
    began = time.perf_counter()
    completion, status = anyio.run(_ask, config, content, args.max_tokens, shown)
    shown.close()
    seconds = time.perf_counter() - began
    if args.json:
        report = {"answer": completion.text, "status": status, "seconds": seconds}
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report)).decode() + "\n")
        return
    print(completion.text.strip())
    long = status.long
    how = (
        f"shown {long.shown_tokens:,} at window positions ({long.chosen_blocks} blocks chosen "
        f"for the question); computed {long.computed_tokens:,} in {long.windows} windows; "
        "approximate"
        if long is not None
        else "it fits the model's context: exact"
        if status.exact
        else "it fits the model's context"
    )
    print(
        f"kvrt ask: {status.logical_tokens:,} tokens of context, {how}; {seconds:.0f} s",
        file=sys.stderr,
    )


async def _ask(config: Any, content: str, max_tokens: int, shown: _Shown) -> tuple[Any, Any]:
    import anyio

    import kvrt

    async with kvrt.open_runtime(config=config) as rt:
        hot = min(config.engine.hot_tokens or 2048, rt.model_info.capacity.hot_context_tokens)
        async with rt.open_session(hot_tokens=hot, long_context=True) as session:

            async def watch() -> None:
                while True:
                    if (now := session.progress) is not None:
                        shown.update(*now)
                    await anyio.sleep(0.2)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                reply = session.chat(
                    [{"role": "user", "content": content}],
                    max_tokens=max_tokens,
                    temperature=0,
                )
                completion = await reply
                tg.cancel_scope.cancel()
            return completion, completion.context


class _Shown:
    """The progress of the context being read: a bar on a terminal, else a line a minute."""

    def __init__(self, stream: Any) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self.console = Console(file=stream)
        self.bar = (
            Progress(console=self.console, transient=True) if self.console.is_terminal else None
        )
        self.task: Any = None
        self.last = 0.0

    def update(self, done: int, due: int) -> None:
        if self.bar is not None:
            if self.task is None:
                self.bar.start()
                self.task = self.bar.add_task("reading the context (tokens)", total=due)
            self.bar.update(self.task, completed=done, total=due)
        elif time.monotonic() - self.last >= 60 or done == due:
            self.last = time.monotonic()
            print(f"kvrt ask: {done:,} of {due:,} tokens read", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.stop()
