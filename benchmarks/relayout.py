"""What laying a llama.cpp window out again in position order costs, next to computing
the same tokens, side by side in one run.

For each context length: prefill it (timed), evict three blocks and restore them in the
opposite order (their cells land in each other's holes), then time the relayout a compute
on the whole context does first, and check that the next token's logits equal a fresh
context's. Printed: milliseconds and the ratio to the prefill.

Run: ``python benchmarks/relayout.py [--kv-type f16|q8_0] [--model gemma3-270m]``. Figures to
read, not assertions; every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from kvrt import AdmitMode, EngineConfig
from kvrt.adapters.llama import LlamaEngine

BLOCK = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-type", default="f16")
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", default="1024,2048,4096")
    args = parser.parse_args()
    extra = {"model": args.model} if args.model else {}
    engine = LlamaEngine.open(EngineConfig(kv_type=args.kv_type, **extra))
    text = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    tokens = engine.tokenize(text * 4)
    print(f"{'tokens':>7} {'prefill ms':>11} {'relayout ms':>12} {'ratio':>6}  logits vs fresh")
    for n in (int(x) for x in args.lengths.split(",")):
        ctx, fresh = engine.open_context(n + 16), engine.open_context(n + 16)
        try:
            t = time.perf_counter()
            ctx.prefill(tokens[:n])
            prefill = time.perf_counter() - t
            starts = [BLOCK, n // 2 - n // 2 % BLOCK, n - 3 * BLOCK]
            blocks = [ctx.export(s, s + BLOCK) for s in starts]
            for s in starts:
                ctx.evict(s, s + BLOCK)
            for block in reversed(blocks):
                ctx.admit(block, AdmitMode.IN_PLACE)
            t = time.perf_counter()
            ctx.relayout()
            relayout = time.perf_counter() - t
            got = ctx.prefill(tokens[n : n + 4])
            same = np.array_equal(got, fresh.prefill(tokens[: n + 4]))
            print(
                f"{n:>7} {prefill * 1e3:>11.0f} {relayout * 1e3:>12.1f} "
                f"{relayout / prefill:>6.3f}  {'identical' if same else 'DIFFER'}"
            )
        finally:
            ctx.close()
            fresh.close()


if __name__ == "__main__":
    main()
