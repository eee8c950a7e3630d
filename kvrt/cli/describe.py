"""``kvrt describe``: a model's KV shape and the capacity kvrt resolves for it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from kvrt import ModelInfo, check_policies, describe_model, format_size

from .arguments import common, config_from

__all__ = ["add", "main"]


def add(sub: Any) -> None:
    """Register the command."""
    describe = sub.add_parser(
        "describe", help="show a model's KV shape and the capacity kvrt resolves for it"
    )
    describe.add_argument(
        "model_path", nargs="?", metavar="MODEL", help="GGUF file (default: embedded)"
    )
    describe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common(describe)
    describe.set_defaults(handler=main)


def main(args: argparse.Namespace) -> None:
    config = config_from(args, {"model": args.model_path})
    check_policies(config)  # as run and bench do
    info = describe_model(config)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(info)).decode() + "\n")
    else:
        print_info(info, long_context=config.session.long_context)


_NAMES = {
    "global": "global",
    "windowed": "sliding-window",
    "recurrent": "recurrent",
    "global+recurrent": "attention beside a recurrent mixer",
}
_LETTERS = {"global": "g", "windowed": "w", "recurrent": "r", "global+recurrent": "b"}


def _kinds(n_layers: int, kinds: tuple[str, ...]) -> str:
    """Layer kinds counted, then laid out one letter a layer (g global, w windowed, r
    recurrent, b both attention and a recurrent mixer):
    ``6: 2 global, 4 sliding-window (wwgwwg)``."""
    counts = {k: kinds.count(k) for k in (*_NAMES, *kinds) if k in kinds}
    text = f"{n_layers}: " + ", ".join(f"{n} {_NAMES.get(k, k)}" for k, n in counts.items())
    if len(counts) > 1 and len(kinds) <= 64:
        text += f" ({''.join(_LETTERS.get(k, k[0]) for k in kinds)})"
    return text


_TURNS = {
    "engine": "keys turned by the engine's own shift",
    "kvrt": "keys turned by kvrt (the engine's own shift would scale or crash here)",
    "none": "not available: no key shift fits this model and KV type",
}


def _dependent(m: Any, hot: int) -> str:
    """What depends on the context size, and what this hot window gets (llama.cpp sizes a
    context's cells in multiples of 256 and compares that with the original context)."""
    text = str(m.context_dependent_kv)
    if m.rope_original_context:
        cells = -(-hot // 256) * 256
        table = "long" if cells > m.rope_original_context else "short"
        text += f"; a {hot:,}-token hot window uses the {table} ones"
    return text


def _kernels(k: Any, together: int, together_bytes: int = 0) -> str:
    """The kernel probe's verdict, with what it measured, and what sessions do with it."""
    text = str(k.reason)
    st = k.setting
    if st is not None and st.steps:
        exact = (
            "exact"
            if k.batch_exact
            else f"inexact (max |Δ| {max(s.max_delta for s in st.steps):.3g})"
        )
        costs = ", ".join(
            f"{s.sequences}: {s.serial_ms:.1f} -> {s.batched_ms:.1f} ms" for s in st.steps
        )
        text += f"; sequences decoded together {exact}, a step one by one -> together {costs}"
    if together > 1:
        text += f"; sessions generating at once step together, up to {together} a step"
        if together_bytes:
            text += (
                f" (their streams hold up to {format_size(together_bytes)} beside the "
                "sessions' own windows)"
            )
    else:
        text += "; each session steps alone"
    if k.probe is not None:
        text += (
            f"; probed once in {k.probe.seconds:.1f} s on {k.probe.cpu}, {k.probe.threads} threads"
        )
    return text


def _restores(m: Any) -> str:
    exact = "bit-exact" if m.exact_in_place else f"approximate ({m.kv_type} re-quantizes)"
    if m.kernels is not None and not m.kernels.exact:
        exact = "approximate (the kernels are inexact here: see kernels)"
    if m.recurrent == "recurrent":
        return (
            f"a shared prefix: the recurrent state after its last block comes back {exact} "
            "and the rest is computed from there; nothing is paged out of the window"
        )
    if m.checkpoint_bytes:
        return (
            f"in place {exact}, with the recurrent state checkpointed after the block; at "
            "other positions not available (the recurrent state has seen the positions)"
        )
    return (
        f"in place {exact}; at other positions approximate, {_TURNS.get(m.key_shift, m.key_shift)}"
    )


def _held(m: Any, budget: int, tokens: int) -> str:
    """What a cold tier's budget holds: tokens of KV, or a recurrent model's checkpoints."""
    if m.recurrent == "recurrent":
        return f"{budget // m.checkpoint_bytes:,} checkpoints"
    return f"{tokens:,} tokens"


def print_info(info: ModelInfo, *, long_context: bool = False) -> None:
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
    if m.layer_kinds:
        layers = _kinds(m.n_layers, m.layer_kinds)
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
        ("RoPE", m.rope or f"base {rope}"),
        *(
            [("context-dependent KV", _dependent(m, c.hot_context_tokens))]
            if m.context_dependent_kv
            else []
        ),
        ("KV type", m.kv_type + (", flash attention" if m.flash_attention else "")),
        *(
            [("kernels", _kernels(m.kernels, info.together, info.together_bytes))]
            if m.kernels is not None
            else []
        ),
        ("KV bytes per token", kv_bytes),
        *(
            [
                (
                    "recurrent state",
                    f"{m.recurrent} model: {sum('recurrent' in k for k in m.layer_kinds)} of "
                    f"{m.n_layers} layers recurrent; a checkpoint is "
                    f"{m.checkpoint_bytes:,} bytes, carried by each cold block",
                )
            ]
            if m.checkpoint_bytes
            else []
        ),
        ("restores", _restores(m)),
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
            f"{format_size(c.host_cold_budget_bytes)} ({_held(m, c.host_cold_budget_bytes, c.cold_store_tokens)})",
        ),
        (
            "disk tier",
            (
                f"{format_size(c.disk_budget_bytes)} "
                f"({_held(m, c.disk_budget_bytes, c.disk_store_tokens)}) in {c.disk_path}"
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
        (
            "long context",
            (
                f"{c.hot_context_tokens + c.cold_store_tokens + c.disk_store_tokens:,} tokens "
                "(hot + cold + disk; approximate past the planner context)"
                if long_context
                else "off (session.long_context)"
            ),
        ),
    ]
    for key, value in rows:
        table.add_row(key, value)
    for note in c.notes:
        table.add_row("note", note)
    Console().print(table)
