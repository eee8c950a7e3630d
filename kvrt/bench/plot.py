"""The PNG of ``kvrt bench`` (four panels from one run's figures); it needs matplotlib.
``benchmarks/fidelity.py`` draws its own with the same helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrt import KvrtError
from kvrt.bench.full import FullBench

__all__ = ["plot_bench", "pyplot", "save_figure"]


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvrtError(
            "the bench plot needs matplotlib: pip install 'kvrt[bench]' (or pass --no-plot)"
        ) from None
    return plt


def save_figure(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_bench(bench: FullBench, path: str | Path) -> Path:
    """Draw ``bench`` into a PNG at ``path``; the path written."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    fig.suptitle(f"kvrt bench on {bench.backend}")

    ax = axes[0][0]
    c = bench.crossover
    sizes = [p.tokens for p in c.points]
    ax.loglog(sizes, [p.restore_ms for p in c.points], "o-", label="restore from cold")
    ax.loglog(sizes, [p.recompute_ms for p in c.points], "s-", label="recompute (prefill)")
    if c.measured is not None:
        ax.axvline(
            c.measured, color="grey", linestyle=":", label=f"measured crossover {c.measured}"
        )
    if c.calibrated is not None:
        ax.axvline(
            c.calibrated, color="red", linestyle="--", label=f"calibrated policy {c.calibrated}"
        )
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("ms to bring the block back")
    ax.set_title("restore vs recompute by block size")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    for system in bench.trace.systems:
        turns = range(1, len(system.ttft_ms) + 1)
        ax.semilogy(
            turns, system.ttft_ms, "o-", label=f"{system.name} ({system.total_prefill_s:.1f} s)"
        )
    ax.set_xlabel("agent turn")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("agent trace: time to first token per turn (total prefill)")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    q = bench.quick
    labels = ["restore\n(GB/s)", "memcpy\n(GB/s)", "decode kvrt\n(tok/s)", "decode raw\n(tok/s)"]
    values = [q.restore_gbps, q.numpy_copy_gbps, q.session_decode_tps, q.reference_decode_tps]
    bars = ax.bar(labels, values, color=["tab:blue", "tab:gray", "tab:blue", "tab:gray"])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_yscale("log")
    ax.set_title(
        f"bandwidth and decode; re-sent {q.segment_tokens}-token segment first token "
        f"{q.ttft_speedup:.0f}x faster restored",
        fontsize=9,
    )

    ax = axes[1][1]
    counts = [str(p.sessions) for p in bench.sessions]
    bars = ax.bar(counts, [p.tokens_per_s for p in bench.sessions], color="tab:blue")
    ax.bar_label(bars, fmt="%.0f")
    ax.set_xlabel("sessions decoding at once")
    ax.set_ylabel("aggregate tokens/s")
    twin = ax.twinx()
    twin.plot(counts, [p.peak_rss_bytes / 2**20 for p in bench.sessions], "r^-", label="peak RSS")
    twin.set_ylabel("peak RSS (MiB)", color="red")
    ax.set_title("many sessions on one model")
    return save_figure(plt, fig, path)
