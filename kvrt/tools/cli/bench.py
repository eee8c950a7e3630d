"""``kvrt bench``: kvrt measured beside the engine alone."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from kvrt import Config, ConfigError
from kvrt._units import format_size

from ._common import check_writable, common, config_from, count, int_list

__all__ = ["add", "main"]

BENCH_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

TIER_SIZES = (128, 1024, 4096)

FIDELITY_SIZES = (1024, 2048)

BENCH_PLOT = "kvrt-bench.png"

FIDELITY_PLOT = "kvrt-fidelity.png"


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
        "--tiers",
        action="store_true",
        help="only the cold tiers: blocks restored from RAM, disk and Redis next to "
        "recomputing, a restarted process, decode while spilling (two minutes)",
    )
    bench.add_argument(
        "--flash",
        action="store_true",
        help="only llama.cpp's flash attention off and on: restore bandwidth, speed and "
        "logits next to llama_cpp.Llama with the same setting (a minute)",
    )
    bench.add_argument(
        "--fidelity",
        action="store_true",
        help="only how much of a long context the model can use: passkey retrieval under "
        "full, discard, class_lru and relevance windows, then approximate hits per blend "
        "ratio (--sizes, --keys; about eleven minutes)",
    )
    bench.add_argument(
        "--keys",
        type=count(1, 100),
        default=10,
        metavar="N",
        help="passkeys per cell with --fidelity (default 10)",
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
        help="where the PNG plot goes (default kvrt-bench.png; kvrt-fidelity.png with --fidelity)",
    )
    bench.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    bench.add_argument("--json", action="store_true", help="print JSON instead of tables")
    common(bench)
    bench.set_defaults(handler=main)


def main(args: argparse.Namespace) -> None:
    import anyio
    from rich.console import Console
    from rich.progress import Progress

    from kvrt.tools.bench import own_disk_tier
    from kvrt.tools.bench.full import run_full_bench, steps_of
    from kvrt.tools.bench.quick import run_quick_bench

    config = config_from(args)
    console = Console(stderr=args.json)
    if args.tiers:
        _tiers(args, config, console)
        return
    if args.fidelity:
        _fidelity(args, config, console)
        return
    if args.flash:
        _flash(args, config, console)
        return
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
        from kvrt.tools.bench.plot import plot_bench

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


def _section(
    args: argparse.Namespace,
    console: Any,
    steps: int,
    run: Callable[[Callable[[str], None]], Any],
    show: Callable[[Any], None],
    *,
    plot: tuple[str, Callable[[Any, str], Any]] | None = None,
) -> None:
    """Run one ``kvrt bench`` section with a progress bar and a disk tier of its own, then
    print its figures (or their JSON) and, given ``plot`` (a path and a drawing function),
    draw them there."""
    import anyio
    from rich.progress import Progress

    from kvrt.tools.bench import own_disk_tier

    if plot is not None:
        check_writable(plot[0])  # before minutes of measuring, not after
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
            raise ConfigError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
        console.print(f"plot written to {written}", highlight=False)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(figures)).decode() + "\n")
    else:
        show(figures)


def _fidelity(args: argparse.Namespace, config: Config, console: Any) -> None:
    from kvrt.tools.bench.fidelity import fidelity_steps, print_fidelity, run_fidelity_bench
    from kvrt.tools.bench.plot import plot_fidelity

    sizes = FIDELITY_SIZES if args.sizes == BENCH_SIZES else tuple(args.sizes)
    if max(sizes) > 7168 or min(sizes) < 256:
        raise ConfigError("--sizes must stay between 256 and 7168 tokens with --fidelity")
    path = FIDELITY_PLOT if args.plot == BENCH_PLOT else args.plot
    _section(
        args,
        console,
        fidelity_steps(len(sizes), args.keys),
        lambda step: run_fidelity_bench(config, sizes=sizes, keys=args.keys, progress=step),
        print_fidelity,
        plot=None if args.no_plot else (path, plot_fidelity),
    )


def _flash(args: argparse.Namespace, config: Config, console: Any) -> None:
    from kvrt.tools.bench.flash import flash_steps, print_flash, run_flash_bench

    tokens = args.tokens or 2048
    if not 512 <= tokens <= 7680:
        raise ConfigError("--tokens must be between 512 and 7680 with --flash")
    _section(
        args,
        console,
        flash_steps(config.engine.kv_type),
        lambda step: run_flash_bench(config, block_tokens=tokens, progress=step),
        print_flash,
    )


def _tiers(args: argparse.Namespace, config: Config, console: Any) -> None:
    from kvrt.tools.bench.tiers import print_tiers, run_tiers_bench

    sizes = TIER_SIZES if args.sizes == BENCH_SIZES else tuple(args.sizes)
    if max(sizes) > 7680:
        raise ConfigError("--sizes must stay below 7680 tokens")
    _section(
        args,
        console,
        len(sizes) + 2,
        lambda step: run_tiers_bench(
            config,
            sizes=sizes,
            restart_tokens=args.tokens or 2048,
            decode=min(args.decode, 64),
            progress=step,
        ),
        print_tiers,
    )


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
