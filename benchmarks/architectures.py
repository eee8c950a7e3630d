"""What kvrt does on each architecture llama.cpp runs, measured on the zoo's tiny models.

For every variant of :mod:`kvrt.testing.zoo`: whether it loads (or the reason it is
refused), its layer kinds and RoPE, who turns its keys when a block moves, then, measured
in this run against contexts that never evicted:

- **in place**: three blocks evicted and restored in the opposite order, the next
  token's logits against a context that never evicted them (max |Δ|; 0 is bit-identical);
  on a recurrent model (no KV, nothing to evict), the first half's block restored with
  its checkpoint into a new context that computes the rest, against computing it all;
- **turned** (one-layer variants, where keys and values depend only on a token and its
  position, so a moved key must equal one computed there): a range slid out and admitted
  at the tail, keys turned as kvrt turns them on this model, against the same tokens at
  the same positions computed afresh;
- **llama.cpp's shift** (one-layer variants): a range moved by llama.cpp's own key shift
  alone, in a child process (it may kill it), against the same computed afresh.

Run: ``python -m benchmarks.architectures [--kv-type f16] [--markdown]``. Figures to read,
not assertions; the suite checks the claims (``tests/engine/test_architectures.py``).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import msgspec
import numpy as np

import kvrt
from kvrt import AdmitMode, EvictMode
from kvrt.native_bridge.llama import LlamaModel
from kvrt.native_bridge.llama_context import MAIN_SEQ, LlamaContext
from kvrt.testing import zoo

from ._common import run_main

TEXT = (
    "The lighthouse keeper of Arden Point kept a logbook. Every evening she wrote down the "
    "colour of the sky, the height of the waves and the names of the ships that passed. "
) * 24
PROBE = " The keeper"


class Row(msgspec.Struct, kw_only=True):
    variant: str
    architecture: str
    about: str
    refused: str | None = None
    layers: str = ""
    rope: str = ""
    key_shift: str = ""
    context_dependent: str | None = None
    in_place_delta: float | None = None
    moved_delta: float | None = None
    engine_shift: str | None = None
    """llama.cpp's own shift on a one-layer variant: its max |Δ|, or how it died."""


def _delta(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def _in_place(engine: kvrt.backend.Engine, tokens: list[int], probe: list[int]) -> float:
    """Three blocks out and back in the opposite order, against a context that never
    evicted (both computed in the same pieces)."""
    most = engine.facts.max_block_tokens or 64
    size = min(64, most)
    ctx, mirror = engine.open_context(1024), engine.open_context(1024)
    try:
        for c in (ctx, mirror):
            c.prefill(tokens)
        starts = [size, len(tokens) // 2 - len(tokens) // 2 % size, len(tokens) - 3 * size]
        blocks = [ctx.export(s, s + size) for s in starts]
        for s in starts:
            ctx.evict(s, s + size, EvictMode.GAP)
        for block in reversed(blocks):
            ctx.admit(block, AdmitMode.IN_PLACE)
        return _delta(ctx.prefill(probe), mirror.prefill(probe))
    finally:
        ctx.close()
        mirror.close()


def _resumed(engine: kvrt.backend.Engine, tokens: list[int], probe: list[int]) -> float:
    """A recurrent model's (no KV, nothing to evict): a block ending with its checkpoint,
    restored into a new context that computes the rest, against computing it all."""
    cut = len(tokens) // 2
    ctx, other, mirror = (engine.open_context(1024) for _ in range(3))
    try:
        ctx.prefill(tokens[:cut])
        other.admit(ctx.export(0, cut), AdmitMode.IN_PLACE)
        other.prefill(tokens[cut:])
        mirror.prefill(tokens)
        return _delta(other.prefill(probe), mirror.prefill(probe))
    finally:
        for c in (ctx, other, mirror):
            c.close()


def _moved(engine: kvrt.backend.Engine, tokens: list[int], probe: list[int]) -> float:
    a, b = 30, 50
    ctx, fresh = engine.open_context(1024), engine.open_context(1024)
    try:
        ctx.prefill(tokens)
        block = ctx.export(a, b)
        ctx.evict(a, b, EvictMode.SLIDE)
        ctx.admit(block, AdmitMode.TAIL)
        got = ctx.prefill(probe)
        return _delta(got, fresh.prefill([*tokens[:a], *tokens[b:], *tokens[a:b], *probe]))
    finally:
        ctx.close()
        fresh.close()


def _engine_shift_in_child(path: str, kv_type: str) -> str:
    """llama.cpp's own shift measured in a child process, which it may kill."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.architectures", "--engine-shift", path, kv_type],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == 0:
        return f"{float(done.stdout.strip().splitlines()[-1]):.3g}"
    if done.returncode < 0:
        return f"crashes ({signal.Signals(-done.returncode).name})"
    return f"fails (exit {done.returncode})"


def _engine_shift(path: str, kv_type: str) -> float:
    """llama.cpp's own shift of a one-layer model (nothing of kvrt in between)."""
    model = LlamaModel(path)
    tokens = model.tokenize(TEXT, add_special=True, parse_special=False)[:200]
    probe = model.tokenize(PROBE, add_special=False, parse_special=False)
    try:
        shifted, fresh = (
            LlamaContext(model, n_ctx=1024, n_batch=512, kv_type=kv_type) for _ in range(2)
        )
        shifted.decode(tokens, 0)
        shifted.seq_rm(MAIN_SEQ, 0, 20)
        shifted.seq_add(MAIN_SEQ, 20, len(tokens), -20)
        shifted.decode(probe, len(tokens) - 20)
        fresh.decode([*tokens[20:], *probe], 0)
        return _delta(shifted.logits(), fresh.logits())
    finally:
        model.close(close_contexts=True)


def measure(name: str, folder: str, kv_type: str) -> Row:
    v = zoo.VARIANTS[name]
    row = Row(variant=name, architecture=v.architecture, about=v.about)
    path = str(zoo.write(name, folder))
    config = kvrt.load_config(flags={"model": path, "kv_type": kv_type})
    try:
        engine = kvrt.load_engine("llama", config=config)
    except kvrt.KvrtError as exc:
        row.refused = str(exc).split(": ", 1)[-1]
        return row
    try:
        facts = engine.facts
        row.layers = ", ".join(facts.layer_kinds) or f"{facts.n_layers} layers"
        row.rope = facts.rope or ""
        row.key_shift = facts.key_shift
        row.context_dependent = facts.context_dependent_kv
        tokens = engine.tokenize(TEXT)[:600]
        probe = engine.tokenize(PROBE, add_special=False)
        restore = _resumed if facts.recurrent == "recurrent" else _in_place
        row.in_place_delta = restore(engine, tokens, probe)
        if facts.key_shift != "none" and v.layers == 1:
            row.moved_delta = _moved(engine, tokens[:200], probe)
        if v.layers == 1:
            row.engine_shift = _engine_shift_in_child(path, kv_type)
    finally:
        engine.close()
    return row


def _fmt(x: float | None) -> str:
    return "—" if x is None else ("0" if x == 0 else f"{x:.3g}")


def markdown(rows: Sequence[Row], kv_type: str) -> str:
    head = (
        f"| variant ({kv_type} KV) | layers | RoPE | keys turned by | restored in place Δ "
        "| turned Δ | llama.cpp's own shift Δ |\n|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r.refused:
            lines.append(f"| {r.variant} | refused: {r.refused} | | | | | |")
            continue
        lines.append(
            f"| {r.variant} | {r.layers} | {r.rope} | {r.key_shift} | {_fmt(r.in_place_delta)} "
            f"| {_fmt(r.moved_delta)} | {r.engine_shift or '—'} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-type", default="f16", help="KV cache type (default f16)")
    parser.add_argument("--variants", help="comma-separated zoo names (default: all)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--engine-shift", nargs=2, metavar=("GGUF", "KV"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_shift:  # the child of _engine_shift_in_child
        print(_engine_shift(*args.engine_shift))
        return
    names = args.variants.split(",") if args.variants else list(zoo.VARIANT_NAMES)
    unknown = [n for n in names if n not in zoo.VARIANTS]
    if unknown:
        raise kvrt.ConfigError(f"unknown zoo variants: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="kvrt-zoo-") as folder:
        rows = [measure(n, folder, args.kv_type) for n in names]
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(rows)).decode() + "\n")
    else:
        sys.stdout.write(markdown(rows, args.kv_type))


if __name__ == "__main__":
    sys.exit(run_main(main))
