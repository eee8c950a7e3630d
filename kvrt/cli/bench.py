"""``kvrt bench``: kvrt measured beside the engine alone, quick or full. The research
benchmarks (the cold tiers, flash attention, long-context fidelity, chat, engine
agreement) live outside the wheel, in the repository's ``benchmarks/``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from kvrt import ConfigError, format_size

from .arguments import check_writable, common, config_from, count, int_list

__all__ = ["add", "main"]

BENCH_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


BENCH_PLOT = "kvrt-bench.png"


def add(sub: Any) -> None:
    """Register the command."""
    bench = sub.add_parser(
        "bench",
        help="measure kvrt beside the engine alone: restore vs recompute, an agent trace, "
        "bandwidth, decode, many sessions",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="only restore bandwidth, time to first token and decode (a minute)",
    )
    bench.add_argument(
        "--tokens",
        type=count(16, 7168),
        default=None,
        metavar="N",
        help="re-sent segment size (default 2048; 1024 with --quick)",
    )
    bench.add_argument(
        "--decode",
        type=count(1, 1024),
        default=64,
        metavar="N",
        help="tokens to decode (default 64)",
    )
    bench.add_argument(
        "--sizes",
        type=int_list,
        default=BENCH_SIZES,
        metavar="N,N,...",
        help="block sizes for restore vs recompute (default 16,32,...,4096)",
    )
    bench.add_argument(
        "--turns",
        type=count(1, 200),
        default=20,
        metavar="N",
        help="agent trace turns (default 20)",
    )
    bench.add_argument(
        "--sessions",
        type=int_list,
        default=(1, 4, 8),
        metavar="N,N,...",
        help="session counts to decode at once (default 1,4,8)",
    )
    bench.add_argument(
        "--plot",
        default=BENCH_PLOT,
        metavar="PATH",
        help="where the PNG plot goes (default kvrt-bench.png)",
    )
    bench.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    bench.add_argument("--json", action="store_true", help="print JSON instead of tables")
    common(bench)
    bench.set_defaults(handler=main)


def main(args: argparse.Namespace) -> None:
    import anyio
    from rich.console import Console
    from rich.progress import Progress

    from kvrt.bench import own_disk_tier
    from kvrt.bench.full import run_full_bench, steps_of
    from kvrt.bench.quick import run_quick_bench

    config = config_from(args)
    console = Console(stderr=args.json)
    if args.quick:
        total = 5
    else:
        total = steps_of(args.sizes, args.turns, args.sessions)
        if max(args.sizes) + 512 > 8192:
            raise ConfigError("--sizes must stay below 7680 tokens")
        if max(args.sessions) > 16:
            raise ConfigError("--sessions must stay at 16 or below")
        if not args.no_plot:
            check_writable(args.plot)  # before minutes of measuring, not after
    with own_disk_tier(), Progress(console=console, transient=True) as progress:
        task = progress.add_task("measuring", total=total)

        def step(what: str) -> None:
            progress.update(task, description=what, advance=1)

        if args.quick:
            figures: Any = anyio.run(
                lambda: run_quick_bench(
                    config, tokens=args.tokens or 1024, decode=args.decode, progress=step
                )
            )
        else:
            figures = anyio.run(
                lambda: run_full_bench(
                    config,
                    sizes=args.sizes,
                    turns=args.turns,
                    tokens=args.tokens or 2048,
                    decode=args.decode,
                    sessions=args.sessions,
                    progress=step,
                )
            )
    if not args.quick and not args.no_plot:
        from kvrt.bench.plot import plot_bench

        try:
            written = plot_bench(figures, args.plot)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the plot to {args.plot}: {exc.strerror or exc}"
            ) from None
        figures = msgspec.structs.replace(figures, plot=str(written))
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(figures)).decode() + "\n")
        return
    if args.quick:
        Console().print(_quick_table(figures))
    else:
        _print_full(figures)


def _quick_table(f: Any) -> Any:
    from rich.table import Table

    table = Table(
        title=f"kvrt bench --quick on {f.backend} ({f.segment_tokens}-token segment, "
        f"{format_size(f.restore_bytes)})"
    )
    for column, justify in (
        ("measure", "left"),
        ("kvrt", "right"),
        ("reference", "right"),
        ("ratio", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    table.add_row(
        "restore through a session (GB/s) vs numpy copy",
        f"{f.restore_gbps:.2f}",
        f"{f.numpy_copy_gbps:.2f}",
        f"{f.restore_gbps / f.numpy_copy_gbps:.2f}x",
    )
    table.add_row(
        "time to first token, re-sent segment (ms): restored vs recomputed",
        f"{f.ttft_restored_ms:.0f}",
        f"{f.ttft_recomputed_ms:.0f}",
        f"{f.ttft_speedup:.1f}x faster",
    )
    table.add_row(
        f"greedy decode (tokens/s): session vs {f.reference}",
        f"{f.session_decode_tps:.1f}",
        f"{f.reference_decode_tps:.1f}",
        f"{f.decode_ratio:.2f}x",
    )
    return table


def _print_full(b: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    c = b.crossover
    table = Table(title=f"restore vs recompute by block size (blocks start at position {c.start})")
    for column in ("tokens", "bytes", "restore ms", "recompute ms", "restore faster by"):
        table.add_column(column, justify="right")
    for p in c.points:
        table.add_row(
            str(p.tokens),
            format_size(p.n_bytes),
            f"{p.restore_ms:.2f}",
            f"{p.recompute_ms:.1f}",
            f"{p.speedup:.1f}x",
        )
    out.print(table)
    out.print(
        f"measured crossover: {c.measured if c.measured is not None else 'none'} tokens; "
        f"the calibrated policy restores from {c.calibrated if c.calibrated is not None else 'no size'} "
        f"tokens on (fitted from {c.calibrated_restores} restores and {c.calibrated_prefills} prefills)"
    )
    t = b.trace
    table = Table(
        title=f"agent trace: {t.turns} turns, contexts of {min(t.context_tokens)}-"
        f"{max(t.context_tokens)} tokens (kvrt hot window {t.kvrt_hot_tokens})"
    )
    for column in ("system", "total prefill s", "median first token ms", "vs kvrt"):
        table.add_column(column, justify="right")
    for column in ("vs kvrt, approximate",):
        table.add_column(column, justify="right")
    for system in t.systems:
        ratio = t.prefill_ratios.get(system.name)
        loose = t.approximate_prefill_ratios.get(system.name)
        table.add_row(
            system.name,
            f"{system.total_prefill_s:.2f}",
            f"{system.median_ttft_ms:.0f}",
            "-" if ratio is None else f"{ratio:.2f}x slower",
            "-" if loose is None else f"{loose:.2f}x slower",
        )
    out.print(table)
    out.print(
        f"kvrt over the trace: {t.kvrt_restored_tokens} tokens restored exactly, "
        f"{t.kvrt_prefilled_tokens} prefilled; with approximate hits allowed, "
        f"{t.approximate_restored_tokens} restored approximately, "
        f"{t.approximate_prefilled_tokens} prefilled"
    )
    out.print(_quick_table(b.quick))
    table = Table(title="many sessions on one model, decoding at once")
    for column in ("sessions", "aggregate tok/s", "vs one", "peak RSS", "cold peak / budget"):
        table.add_column(column, justify="right")
    for p in b.sessions:
        table.add_row(
            str(p.sessions),
            f"{p.tokens_per_s:.1f}",
            f"{p.ratio_to_one:.2f}x",
            format_size(p.peak_rss_bytes),
            f"{format_size(p.cold_peak_bytes)} / {format_size(p.cold_budget_bytes)}",
        )
    out.print(table)
    table = Table(title="read against the goals (figures, not assertions)")
    for column in ("figure", "goal", "measured", "met"):
        table.add_column(column)
    for g in b.goals:
        table.add_row(g.figure, g.goal, g.measured, "yes" if g.met else "no")
    out.print(table)
    if b.plot:
        out.print(f"plot: {b.plot}")
