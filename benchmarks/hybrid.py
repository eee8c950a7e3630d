"""Hybrid and recurrent models on kvrt, measured on the zoo's tiny random-weight fixtures
(:mod:`kvrt.testing.zoo`), side by side in one run:

- **bytes**: a checkpoint of the recurrent state, a block's attention KV, and the block's
  cold bytes (its KV and the checkpoint after its last token);
- **restore against compute**: a context of ``--tokens`` tokens in blocks of
  ``--block`` tokens, each block checkpointed, restored into a new engine context from its
  cold blocks against computed there (best of three each, then two more tokens computed
  on both, whose logits are checked bit for bit equal);
- **agent trace**: the turns of :mod:`benchmarks.prefix_reuse` (files edited in their
  middle, questions asked again in other words): tokens computed and seconds by kvrt with
  one session, by kvrt with a new session each turn (everything comes back from the cold
  store), and by ``llama_cpp.Llama`` with ``LlamaRAMCache``, its own prompt cache.

Run: ``python -m benchmarks.hybrid [--variants granitehybrid,lfm2,mamba2] [--turns 10]
[--json]``. Figures to read, not assertions: random weights compute at the speed of the
fixtures' size, not of a real model's; the ratios are what carry over. The suite checks
the claims (``tests/session/test_hybrid_sessions.py``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
import numpy as np

import kvrt
from kvrt.testing import zoo

from . import prefix_reuse
from ._common import run_main, section

DEFAULT = ("granitehybrid", "lfm2", "nemotron-h", "falcon-h1", "mamba2")


class Trace(msgspec.Struct, kw_only=True):
    computed: int
    seconds: float
    held_bytes: int


class Row(msgspec.Struct, kw_only=True):
    variant: str
    about: str
    kind: str
    checkpoint_bytes: int
    block_kv_bytes: int
    block_cold_bytes: int
    restore_ms: float
    compute_ms: float
    one_session: Trace
    new_sessions: Trace
    llama_ram_cache: Trace


def _best(fn: Callable[[], None], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def restore_vs_compute(engine: kvrt.backend.Engine, n: int, block: int) -> tuple[int, float, float]:
    """A block's cold bytes, and seconds to restore ``n`` tokens from cold blocks and to
    compute them, in a new context each (the logits after both checked equal)."""
    text = " ".join(f"step {i}: the keeper lit lamp {i % 7}." for i in range(n))
    tokens = engine.tokenize(text)[:n]
    probe = engine.tokenize(" The keeper", add_special=False)[:2]
    source = engine.open_context(n + 16)
    ctx = engine.open_context(n + 16)
    try:
        source.prefill(tokens, keep_state_at=list(range(block, n, block)))
        blocks = source.export_run([(s, min(s + block, n)) for s in range(0, n, block)])

        def restore() -> None:
            ctx.clear()
            ctx.admit_run(blocks)

        def compute() -> None:
            ctx.clear()
            ctx.prefill(tokens)

        restored = _best(restore)
        got = ctx.prefill(probe).copy()
        computed = _best(compute)
        want = ctx.prefill(probe)
        if not np.array_equal(got, want):
            raise kvrt.EngineError(
                f"restored and computed contexts differ: max |Δ| {np.abs(got - want).max()}"
            )
        return blocks[0].meta.n_bytes, restored, computed
    finally:
        source.close()
        ctx.close()


def _trace(found: dict[str, Any]) -> Trace:
    return Trace(
        computed=found["computed"], seconds=round(found["seconds"], 3), held_bytes=found["bytes"]
    )


async def measure(
    name: str, folder: str, args: argparse.Namespace, step: Callable[[str], None]
) -> Row:
    v = zoo.VARIANTS[name]
    path = str(zoo.write(name, folder))
    step(f"{name}: restore against compute")
    engine = kvrt.load_engine("llama", model=path)
    try:
        facts = engine.facts
        cold, restored, computed = await anyio.to_thread.run_sync(
            restore_vs_compute, engine, args.tokens, args.block
        )
    finally:
        engine.close()
    contexts = prefix_reuse.trace(args.turns)
    step(f"{name}: agent trace, one session")
    one = await prefix_reuse.kvrt_trace(contexts, fresh=False, hot=4096, model=path)
    step(f"{name}: agent trace, a new session each turn")
    each = await prefix_reuse.kvrt_trace(contexts, fresh=True, hot=4096, model=path)
    step(f"{name}: agent trace, llama_cpp.Llama")
    ram = await anyio.to_thread.run_sync(prefix_reuse.ram_cache_trace, one["prompts"], path)
    return Row(
        variant=name,
        about=v.about,
        kind=facts.recurrent or "attention",
        checkpoint_bytes=facts.checkpoint_bytes,
        block_kv_bytes=facts.kv_bytes_per_token * args.block,
        block_cold_bytes=cold,
        restore_ms=round(restored * 1e3, 3),
        compute_ms=round(computed * 1e3, 3),
        one_session=_trace(one),
        new_sessions=_trace(each),
        llama_ram_cache=_trace(ram),
    )


def show(rows: Sequence[Row], args: argparse.Namespace) -> None:
    print(
        f"| variant | checkpoint B | KV B / {args.block}-token block | cold B / block "
        f"| restore {args.tokens} tokens ms | compute ms | compute / restore |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.variant} ({r.kind}) | {r.checkpoint_bytes:,} | {r.block_kv_bytes:,} "
            f"| {r.block_cold_bytes:,} | {r.restore_ms:.2f} | {r.compute_ms:.2f} "
            f"| {r.compute_ms / max(r.restore_ms, 1e-9):.1f}x |"
        )
    print()
    print(f"Agent trace ({args.turns} turns): tokens computed / seconds / bytes held for reuse")
    print(
        "| variant | kvrt, one session | kvrt, a new session each turn "
        "| llama_cpp.Llama + LlamaRAMCache |"
    )
    print("|---|---|---|---|")

    def cell(t: Trace) -> str:
        return f"{t.computed:,} / {t.seconds:.2f} s / {t.held_bytes / 2**20:.1f} MiB"

    for r in rows:
        print(
            f"| {r.variant} | {cell(r.one_session)} | {cell(r.new_sessions)} "
            f"| {cell(r.llama_ram_cache)} |"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants", help=f"comma-separated zoo names (default: {','.join(DEFAULT)})"
    )
    parser.add_argument("--turns", type=int, default=10, help="agent trace turns (default 10)")
    parser.add_argument("--tokens", type=int, default=1024, help="context restored (default 1024)")
    parser.add_argument("--block", type=int, default=256, help="block tokens (default 256)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    names = args.variants.split(",") if args.variants else list(DEFAULT)
    unknown = [n for n in names if n not in zoo.VARIANTS]
    if unknown:
        raise kvrt.ConfigError(f"unknown zoo variants: {', '.join(unknown)}")
    plain = [n for n in names if not zoo.VARIANTS[n].recurrent]
    if plain:
        raise kvrt.ConfigError(f"not hybrid or recurrent: {', '.join(plain)}")
    if not 2 <= args.block <= args.tokens <= 4096 or args.turns < 1:
        raise kvrt.ConfigError("need 2 <= --block <= --tokens <= 4096 and --turns >= 1")

    with tempfile.TemporaryDirectory(prefix="kvrt-zoo-") as folder:

        async def run(step: Callable[[str], None]) -> list[Row]:
            return [await measure(n, folder, args, step) for n in names]

        section(args, 4 * len(names), run, lambda rows: show(rows, args))


if __name__ == "__main__":
    import sys

    sys.exit(run_main(main))
