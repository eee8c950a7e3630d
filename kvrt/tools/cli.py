"""The ``kvrt`` command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from kvrt import __version__
from kvrt._config import CONFIG_ENV, SETTINGS, Config, load_config
from kvrt._describe import ModelInfo, describe_model
from kvrt._errors import ConfigError, KvrtError
from kvrt._runtime import check_policies
from kvrt._units import format_size

__all__ = ["main"]

LOCAL_CONFIG = "kvrt.toml"
"""Read from the working directory when neither --config nor $KVRT_CONFIG names a file."""
BENCH_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TIER_SIZES = (128, 1024, 4096)
FIDELITY_SIZES = (1024, 2048)
BENCH_PLOT = "kvrt-bench.png"
FIDELITY_PLOT = "kvrt-fidelity.png"

_HELP = {
    "cold": "host-RAM cold store budget, e.g. 2GiB (default: 25%% of free RAM)",
    "max": "cap on memory kvrt plans for, e.g. 8GiB",
    "reserve": "memory left for everything else, e.g. 1GiB",
    "headroom": "fraction of usable memory kept free, e.g. 0.1 or 10%%",
    "overhead": "fixed per-context overhead to plan for",
    "backend": "engine backend: llama or openvino",
    "openvino_profile": "OpenVINO compile settings: deterministic or default",
    "require_exact": "refuse a KV precision whose restores cannot be bit-exact (true/false)",
    "model": "path of a GGUF model (default: the embedded SmolLM2-135M-Instruct)",
    "kv_type": "KV cache type: f32, f16, bf16, q8_0, ... (OpenVINO: f32, f16, bf16, u8)",
    "flash_attention": "llama.cpp flash attention: auto, on or off (default auto)",
    "chat_template": "a Jinja chat template file (or tokenizer_config.json) to use instead "
    "of the model's own",
    "threads": "engine threads (default: physical cores)",
    "context": "logical context a request asks for (caps hot and planner context)",
    "hot_tokens": "cap on the hot window in tokens",
    "batch": "prefill batch size in tokens",
    "parallel": "engine calls that may run at once across sessions",
    "block_tokens": "tokens per cold-store block",
    "sink_tokens": "leading tokens that never leave the hot window",
    "recent_tokens": "trailing tokens that never leave the hot window",
    "hot_eviction": "hot eviction policy by name (class_lru, relevance, score_lru)",
    "cold_victim": "cold victim policy by name (class_lru)",
    "cold_admission": "which evicted blocks keep KV bytes (all, skip_small_volatile)",
    "restore": "restore-vs-recompute policy (always, never, size_threshold, calibrated)",
    "approximate": "approximate-hit policy (never, allow, stable_only, blend:R)",
    "partial_window": "partial-window KV once its prefix fits hot (recompute, keep)",
    "write_through": "blocks copied to the cold store once computed (stable, none, all)",
    "message_class": "a chat message's cache class by role (system_pinned, volatile)",
    "cold_wait": "seconds an eviction waits for room in a full cold store",
}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML or JSON config file (default: $KVRT_CONFIG, else ./{LOCAL_CONFIG} if there is one)",
    )
    group = parser.add_argument_group("settings (override the config file and KVRT_* variables)")
    for s in SETTINGS:
        group.add_argument(s.flag, dest=f"set_{s.name}", metavar="VALUE", help=_HELP.get(s.name))


def _config_from(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
    flags = {s.name: getattr(args, f"set_{s.name}") for s in SETTINGS}
    flags.update({k: v for k, v in (extra or {}).items() if v is not None})
    path = args.config
    if path is None and not os.environ.get(CONFIG_ENV) and Path(LOCAL_CONFIG).is_file():
        path = LOCAL_CONFIG
    return load_config(path, flags=flags)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit 2 (``--help`` shows usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvrt: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvrt",
        description="Lossless long context for local LLM engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvrt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    describe = sub.add_parser(
        "describe", help="show a model's KV shape and the capacity kvrt resolves for it"
    )
    describe.add_argument(
        "model_path", nargs="?", metavar="MODEL", help="GGUF file (default: embedded)"
    )
    describe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _common(describe)

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
        type=_count(0, 4096),
        default=32,
        metavar="N",
        help="tokens generated per turn (default 32)",
    )
    run.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _common(run)

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
        type=_count(1, 100),
        default=10,
        metavar="N",
        help="passkeys per cell with --fidelity (default 10)",
    )
    bench.add_argument(
        "--tokens",
        type=_count(16, 7168),
        default=None,
        metavar="N",
        help="re-sent segment size (default 2048; 1024 with --quick)",
    )
    bench.add_argument(
        "--decode",
        type=_count(1, 1024),
        default=64,
        metavar="N",
        help="tokens to decode (default 64)",
    )
    bench.add_argument(
        "--sizes",
        type=_int_list,
        default=BENCH_SIZES,
        metavar="N,N,...",
        help="block sizes for restore vs recompute (default 16,32,...,4096)",
    )
    bench.add_argument(
        "--turns",
        type=_count(1, 200),
        default=20,
        metavar="N",
        help="agent trace turns (default 20)",
    )
    bench.add_argument(
        "--sessions",
        type=_int_list,
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
    _common(bench)

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1)")
    serve.add_argument("--port", type=_count(0, 65535), default=8000, help="port (default 8000)")
    serve.add_argument(
        "--max-sessions",
        type=_count(1, 256),
        default=4,
        metavar="N",
        help="sessions kept live at once (default 4)",
    )
    serve.add_argument(
        "--max-queue",
        type=_count(0, 100_000),
        default=16,
        metavar="N",
        help="requests waiting for a session before 429s (default 16)",
    )
    serve.add_argument(
        "--session-tokens",
        type=_count(64),
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
        type=_seconds,
        default=30.0,
        metavar="S",
        help="seconds a streaming client may leave a chunk unread before its stream is "
        "closed and its session freed (default 30)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $KVRT_API_KEY; '@PATH' reads it from a file)",
    )
    serve.add_argument(
        "--send-buffer",
        type=_count(4096, 2**26),
        default=65536,
        metavar="BYTES",
        help="each connection's socket send buffer (default 65536): a client that stops "
        "reading is noticed once it and the client's receive buffer are full",
    )
    serve.add_argument(
        "--loop",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="event loop (default asyncio)",
    )
    _common(serve)
    return parser


def _print_info(info: ModelInfo) -> None:
    from rich.console import Console
    from rich.table import Table

    m, c = info.model, info.capacity
    table = Table(title=f"kvrt describe — {m.name or m.architecture}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    swa = "none"
    rope = f"{m.rope_freq_base:,.0f}" if m.rope_freq_base else "—"
    if m.rope_freq_base_swa and m.rope_freq_base_swa != m.rope_freq_base:
        rope += f" (sliding-window layers {m.rope_freq_base_swa:,.0f})"
    layers = str(m.n_layers)
    kv_bytes = f"{m.kv_bytes_per_token:,}"
    if m.sliding_window or m.sliding_window_live:
        swa = f"GGUF {m.sliding_window or '—'}, live {m.sliding_window_live or '—'}"
    if m.n_swa_layers:
        n_global = m.n_layers - m.n_swa_layers
        swa = f"{m.sliding_window_live:,} tokens over {m.n_swa_layers} layers" + (
            ", kept full size" if m.swa_full else ""
        )
        layers = f"{m.n_layers}: {n_global} global, {m.n_swa_layers} sliding-window"
        dense = m.kv_bytes_per_token - m.kv_bytes_per_token_swa
        kv_bytes += (
            f" (global {dense:,} = {n_global} x {dense // max(n_global, 1):,}; sliding "
            f"{m.kv_bytes_per_token_swa:,} = {m.n_swa_layers} x "
            f"{m.kv_bytes_per_token_swa // m.n_swa_layers:,})"
        )
    rows = [
        ("model", m.path),
        ("backend", m.backend),
        ("architecture", m.architecture),
        ("layers", layers),
        ("heads / KV heads", f"{m.n_head} / {m.n_head_kv}"),
        ("head dim", str(m.head_dim)),
        ("vocabulary", str(m.n_vocab)),
        ("trained context", f"{m.trained_context} tokens"),
        ("sliding window", swa),
        ("RoPE base", rope),
        ("KV type", m.kv_type + (", flash attention" if m.flash_attention else "")),
        ("KV bytes per token", kv_bytes),
        *(
            [("cold bytes per token", f"{m.cold_bytes_per_token:,} (as the state reads back)")]
            if m.cold_bytes_per_token and m.cold_bytes_per_token != m.kv_bytes_per_token
            else []
        ),
        ("weights", format_size(m.weight_bytes)),
        ("fingerprint", m.fingerprint),
        ("free host memory", format_size(info.memory.host_free_bytes)),
        ("usable for kvrt", format_size(c.usable_bytes)),
        (
            "host cold budget",
            f"{format_size(c.host_cold_budget_bytes)} ({c.cold_store_tokens:,} tokens)",
        ),
        (
            "disk tier",
            (
                f"{format_size(c.disk_budget_bytes)} ({c.disk_store_tokens:,} tokens) in {c.disk_path}"
                if c.disk_budget_bytes
                else "off (disk.budget 0)"
            ),
        ),
        (
            "hot context",
            f"{c.hot_context_tokens:,} tokens (limited by {', '.join(c.hot_limited_by)})",
        ),
        (
            "planner context",
            f"{c.planner_effective_context:,} tokens (limited by {', '.join(c.planner_limited_by)})",
        ),
        ("effective context", f"{c.effective_context:,} tokens (dense)"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    for note in c.notes:
        table.add_row("note", note)
    Console().print(table)


def _run(args: argparse.Namespace) -> None:
    import anyio
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvrt.tools.demo import run_demo

    config = _config_from(args)
    # engine.hot_tokens caps the window the capacity resolves; the demo's default is 512.
    hot = min(config.engine.hot_tokens or 512, 8192)
    console = Console(stderr=args.json)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"{args.sessions} sessions x 3 turns", total=args.sessions * 3)
        report = anyio.run(
            lambda: run_demo(
                config,
                sessions=args.sessions,
                hot_tokens=hot,
                max_tokens=args.max_tokens,
                on_progress=lambda name, turn: progress.advance(task),
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
    out.print(
        f"{len(report.sessions)} sessions, {report.combined_logical_tokens} context tokens in all over hot "
        f"windows of {report.hot_tokens}; cold store: {report.cold_entries} blocks, "
        f"{format_size(report.cold_bytes)}; {report.seconds:.1f} s"
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _bench(args: argparse.Namespace) -> None:
    import anyio
    from rich.console import Console
    from rich.progress import Progress

    from kvrt.tools.bench import own_disk_tier
    from kvrt.tools.bench.full import run_full_bench, steps_of
    from kvrt.tools.bench.quick import run_quick_bench

    config = _config_from(args)
    console = Console(stderr=args.json)
    if args.tiers:
        _bench_tiers(args, config, console)
        return
    if args.fidelity:
        _bench_fidelity(args, config, console)
        return
    if args.flash:
        _bench_flash(args, config, console)
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
            _check_writable(args.plot)  # before minutes of measuring, not after
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


def _bench_section(
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
        _check_writable(plot[0])  # before minutes of measuring, not after
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


def _bench_fidelity(args: argparse.Namespace, config: Config, console: Any) -> None:
    from kvrt.tools.bench.fidelity import fidelity_steps, print_fidelity, run_fidelity_bench
    from kvrt.tools.bench.plot import plot_fidelity

    sizes = FIDELITY_SIZES if args.sizes == BENCH_SIZES else tuple(args.sizes)
    if max(sizes) > 7168 or min(sizes) < 256:
        raise ConfigError("--sizes must stay between 256 and 7168 tokens with --fidelity")
    path = FIDELITY_PLOT if args.plot == BENCH_PLOT else args.plot
    _bench_section(
        args,
        console,
        fidelity_steps(len(sizes), args.keys),
        lambda step: run_fidelity_bench(config, sizes=sizes, keys=args.keys, progress=step),
        print_fidelity,
        plot=None if args.no_plot else (path, plot_fidelity),
    )


def _bench_flash(args: argparse.Namespace, config: Config, console: Any) -> None:
    from kvrt.tools.bench.flash import flash_steps, print_flash, run_flash_bench

    tokens = args.tokens or 2048
    if not 512 <= tokens <= 7680:
        raise ConfigError("--tokens must be between 512 and 7680 with --flash")
    _bench_section(
        args,
        console,
        flash_steps(config.engine.kv_type),
        lambda step: run_flash_bench(config, block_tokens=tokens, progress=step),
        print_flash,
    )


def _bench_tiers(args: argparse.Namespace, config: Config, console: Any) -> None:
    from kvrt.tools.bench.tiers import print_tiers, run_tiers_bench

    sizes = TIER_SIZES if args.sizes == BENCH_SIZES else tuple(args.sizes)
    if max(sizes) > 7680:
        raise ConfigError("--sizes must stay below 7680 tokens")
    _bench_section(
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


def _check_writable(path: str) -> None:
    """Refuse a --plot path that cannot be written (the file is made, or left, as it was)."""
    target = Path(path)
    existed = target.exists()
    try:
        with target.open("ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
    if not existed:
        target.unlink(missing_ok=True)


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


def _serve(args: argparse.Namespace) -> None:
    import anyio

    from kvrt import open_runtime
    from kvrt.serve import ServeConfig, listen, model_id, serve

    config = _config_from(args)
    check_policies(config)
    settings = ServeConfig(
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        max_queue=args.max_queue,
        hot_tokens=args.session_tokens,
        model_name=args.model_name,
        stall_timeout=args.stall_timeout,
        send_buffer=args.send_buffer,
        api_key=_api_key(args),
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


def _kvrt_error(exc: BaseException) -> KvrtError | None:
    """The kvrt error behind ``exc`` (groups from concurrent sessions unwrapped), or None
    when something else went wrong too."""
    if isinstance(exc, KvrtError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [_kvrt_error(e) for e in exc.exceptions]
        if found and all(e is not None for e in found):
            return found[0]
    return None


def _api_key(args: argparse.Namespace) -> str | None:
    """The key ``kvrt serve`` requires: ``--api-key``, else ``$KVRT_API_KEY``; ``@PATH``
    reads it from a file (its first line)."""
    given = args.api_key if args.api_key is not None else os.environ.get("KVRT_API_KEY")
    if not given:
        return None
    if given.startswith("@"):
        try:
            given = Path(given[1:]).read_text().strip().splitlines()[0]
        except (OSError, IndexError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the API key from {given[1:]}: {exc}") from None
    key = given.strip()
    if not key or not key.isprintable() or " " in key:
        raise ConfigError("the API key must be printable text without spaces")
    return key


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0 (at most a day)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, at most 86400, got {text}")
    return value


def _count(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"expected a number {bounds}, got {value}")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            _run(args)
        elif args.command == "bench":
            _bench(args)
        elif args.command == "serve":
            _serve(args)
        elif args.command == "describe":
            config = _config_from(args, {"model": args.model_path})
            check_policies(config)  # as run and bench do
            info = describe_model(config)
            if args.json:
                sys.stdout.write(msgspec.json.format(msgspec.json.encode(info)).decode() + "\n")
            else:
                _print_info(info)
    except (KvrtError, BaseExceptionGroup) as exc:
        error = _kvrt_error(exc)
        if error is None:
            raise
        print(f"kvrt: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
