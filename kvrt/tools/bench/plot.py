"""The PNGs of ``kvrt bench`` (four panels from one run's figures) and of ``kvrt bench
--fidelity`` (two panels); both need matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrt import KvrtError
from kvrt.tools.bench.fidelity import CONDITIONS, FidelityBench
from kvrt.tools.bench.full import FullBench

__all__ = ["plot_bench", "plot_fidelity"]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvrtError(
            "the bench plot needs matplotlib: pip install 'kvrt[bench]' (or pass --no-plot)"
        ) from None
    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_fidelity(bench: FidelityBench, path: str | Path) -> Path:
    """Draw ``bench`` into a PNG at ``path``: exact match per condition, task and context
    size (mean over depths); quality and agent-trace time per blend ratio."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    fig.suptitle("kvrt bench --fidelity")
    groups = sorted({(c.task, c.context_tokens) for c in bench.cells})
    names = [name for name, _, _ in CONDITIONS]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        means = []
        for task, size in groups:
            cells = [
                c
                for c in bench.cells
                if (c.task, c.context_tokens, c.condition) == (task, size, name)
            ]
            means.append(100 * sum(c.exact_match for c in cells) / max(1, len(cells)))
        left.bar([g + k * width for g in range(len(groups))], means, width, label=name)
    left.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    left.set_xticklabels([f"{task}\n{size} tokens" for task, size in groups])
    left.set_ylabel("exact match (%), mean over needle depths")
    left.set_title("passkey retrieval by hot-window condition")
    left.set_ylim(0, 130)
    left.legend(fontsize=8, ncol=3, loc="upper center")
    rows = [r for r in bench.blend if r.ratio is not None and r.trace_seconds is not None]
    if rows:
        ratios = [r.ratio for r in rows]
        right.plot(ratios, [r.gold_logprob for r in rows], "o-", label="gold log-prob (blend)")
        full = [r.gold_logprob for r in bench.blend if r.ratio is None]
        if full:
            right.axhline(full[0], color="grey", linestyle=":", label="gold log-prob (full)")
        right.set_xlabel("blend ratio (share of each run of approximate hits computed)")
        right.set_ylabel("mean gold log-prob (nats)")
        twin = right.twinx()
        twin.plot(ratios, [r.trace_seconds for r in rows], "r^-", label="agent trace")
        twin.set_ylabel("agent trace, total time to first token (s)", color="red")
        right.legend(fontsize=8, loc="lower right")
    right.set_title("approximate hits after a distractor")
    return _save(plt, fig, path)


def plot_bench(bench: FullBench, path: str | Path) -> Path:
    """Draw ``bench`` into a PNG at ``path``; the path written."""
    plt = _pyplot()
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
    return _save(plt, fig, path)
