"""What the ``python -m benchmarks.NAME`` commands share: a few settings flags over a
config file, a progress bar, a disk tier of their own, tables or JSON, one error line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
from rich.console import Console
from rich.progress import Progress

import kvrt
from kvrt.bench import own_disk_tier
from kvrt.cli.arguments import check_writable, count, int_list

__all__ = ["check_writable", "count", "int_list", "parser", "run_main", "section"]


def parser(description: str) -> argparse.ArgumentParser:
    """Flags every benchmark takes: ``--config`` and a few settings over it, ``--json``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", metavar="PATH", help="TOML or JSON config file")
    p.add_argument("--backend", help="engine backend: llama or openvino")
    p.add_argument("--model", help="a GGUF path or a model name kvrt knows")
    p.add_argument("--kv-type", dest="kv_type", help="KV cache type")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def config_of(args: argparse.Namespace) -> kvrt.Config:
    flags = {k: getattr(args, k) for k in ("backend", "model", "kv_type") if getattr(args, k)}
    return kvrt.load_config(args.config, flags=flags)


def section(
    args: argparse.Namespace,
    steps: int,
    run: Callable[[Callable[[str], None]], Any],
    show: Callable[[Any], None],
    *,
    plot: tuple[str, Callable[[Any, str], Any]] | None = None,
) -> None:
    """Run a benchmark with a progress bar and a disk tier of its own, then print its
    figures (or their JSON) and, given ``plot`` (a path and a drawing function), draw
    them there."""
    console = Console(stderr=args.json)
    if plot is not None:
        check_writable(plot[0])
    with own_disk_tier(), Progress(console=console, transient=True) as progress:
        task = progress.add_task("measuring", total=steps)

        def step(what: str) -> None:
            progress.update(task, description=what, advance=1)

        figures = anyio.run(lambda: run(step))
    if plot is not None:
        path, draw = plot
        try:
            written = draw(figures, path)
        except OSError as exc:
            raise kvrt.ConfigError(
                f"cannot write the plot to {path}: {exc.strerror or exc}"
            ) from None
        console.print(f"plot written to {written}", highlight=False)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(figures)).decode() + "\n")
    else:
        show(figures)


def run_main(
    main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None
) -> int:
    """Run a benchmark's ``main``: a kvrt error is one line on stderr and exit status 2."""
    try:
        main(argv)
    except kvrt.KvrtError as exc:
        print(f"kvrt: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
