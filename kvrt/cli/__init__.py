"""The ``kvrt`` command line, one module per command, each registering its parser and the
function that runs it: :mod:`.run` (the main demo, its agents in :mod:`.demo` and their
messages in :mod:`.messages`), :mod:`.ask`, :mod:`.bench`, :mod:`.describe` and
:mod:`.serve`, on what every command shares (:mod:`.arguments`). Dependencies run one way,
in the order of :data:`LAYERS`; the architecture test holds it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvrt import KvrtError, __version__

from . import ask, bench, describe, run, serve
from .arguments import Parser, kvrt_error

__all__ = ["main"]


def parser() -> Parser:
    top = Parser(prog="kvrt", description="Lossless long context for local LLM engines.")
    top.add_argument("--version", action="version", version=f"kvrt {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (describe, run, ask, bench, serve):
        command.add(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``kvrt`` command; the exit status (2: a kvrt error, one line on stderr)."""
    args = parser().parse_args(argv)
    try:
        args.handler(args)
    except (KvrtError, BaseExceptionGroup) as exc:
        error = kvrt_error(exc)
        if error is None:
            raise
        print(f"kvrt: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


LAYERS = (
    "run",
    "demo",
    "messages",
    "ask",
    "bench",
    "describe",
    "serve",
    "arguments",
)
"""The modules from the top down: each imports only those after it."""
