"""``kvrt run``: the main demo, concurrent agent sessions whose context outgrows the hot
window."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from typing import Any

import msgspec

from kvrt import format_size

from .arguments import common, config_from, count

__all__ = ["add", "main"]


def add(sub: Any) -> None:
    """Register the command."""
    run = sub.add_parser(
        "run",
        help="the main demo: concurrent agent sessions whose context outgrows the hot window",
    )
    run.add_argument(
        "--sessions",
        type=int,
        default=3,
        choices=range(1, 5),
        metavar="N",
        help="sessions at once (1-4, default 3)",
    )
    run.add_argument(
        "--max-tokens",
        type=count(0, 4096),
        default=32,
        metavar="N",
        help="tokens generated per turn (default 32)",
    )
    run.add_argument("--json", action="store_true", help="print JSON instead of tables")
    common(run)
    run.set_defaults(handler=main)


def main(args: argparse.Namespace) -> None:
    from kvrt.native_bridge.memory import fix_mmap_threshold

    fix_mmap_threshold()  # what kvrt frees goes back to the system (see the module)
    import anyio
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvrt.cli.demo import run_demo

    config = config_from(args)
    # engine.hot_tokens caps the window the capacity resolves; the demo's default is 512.
    hot = min(config.engine.hot_tokens or 512, 8192)
    console = Console(stderr=True)
    total = args.sessions * 3
    with contextlib.ExitStack() as stack:
        if config.disk.path is None and config.disk.budget != 0:
            # A first run is a first run: the demo's disk tier is a fresh folder of its own,
            # not the one earlier runs filled (give --disk-path to keep blocks across runs).
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrt-run-"))
            config = msgspec.structs.replace(
                config, disk=msgspec.structs.replace(config.disk, path=folder)
            )
            note = "disk tier: a fresh folder for this run (--disk-path keeps one across runs)"
        else:
            note = f"disk tier: {config.disk.path or 'off'} (blocks earlier runs left are restored)"
        if console.is_terminal:
            progress = stack.enter_context(Progress(console=console, transient=True))
            task = progress.add_task(f"{args.sessions} sessions x 3 turns", total=total)

            def advanced(name: str, turn: int) -> None:
                progress.advance(task)
        else:  # a log or a pipe: a line a turn
            began, done = time.perf_counter(), 0

            def advanced(name: str, turn: int) -> None:
                nonlocal done
                done += 1
                if done == 1:  # the runtime opened: say where its disk tier is
                    print(f"kvrt run: {note}", file=sys.stderr, flush=True)
                print(
                    f"kvrt run: session {name} turn {turn} done ({done}/{total}, "
                    f"{time.perf_counter() - began:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

        report = anyio.run(
            lambda: run_demo(
                config,
                sessions=args.sessions,
                hot_tokens=hot,
                max_tokens=args.max_tokens,
                on_progress=advanced,
            )
        )
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report)).decode() + "\n")
        return
    out = Console()
    for session in report.sessions:
        table = Table(title=f"session {session.name} (hot window {session.hot_budget} tokens)")
        columns = (
            "turn",
            "context",
            "reused",
            "restored",
            "prefilled",
            "evicted",
            "hot",
            "cold",
            "s",
        )
        for column in columns:
            table.add_column(column, justify="right")
        for t in session.turns:
            st = t.status
            figures = (
                st.logical_tokens,
                st.reused_tokens,
                st.restored_tokens,
                st.prefilled_tokens,
                st.evicted_tokens,
                st.hot_tokens,
                st.cold_tokens,
            )
            table.add_row(str(t.turn), *map(str, figures), f"{t.seconds:.1f}")
        out.print(table)
        for t in session.turns:
            out.print(f"  [bold]turn {t.turn}[/bold] ({t.file}): {t.text!r}", highlight=False)
    out.print(note)
    out.print(
        "reused, restored and prefilled count work: a block computed, pushed out of the hot "
        "window and brought back within one turn counts in both (so a first turn restores "
        "too); cold: tokens parked in the cold store"
    )
    out.print(
        f"{len(report.sessions)} sessions, {report.combined_logical_tokens} context tokens in all over hot "
        f"windows of {report.hot_tokens}; cold store: {report.cold_entries} blocks, "
        f"{format_size(report.cold_bytes)}; {report.seconds:.1f} s"
    )
