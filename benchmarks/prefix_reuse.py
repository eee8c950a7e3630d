"""Exact reuse to the token: an agent trace whose contexts diverge inside blocks, served by
kvrt and by ``llama_cpp.Llama`` with ``LlamaRAMCache`` (whole-prompt states, the longest
prefix to the token), side by side in one run.

Each turn sends a system prompt, a repo map, the files open, the last exchanges and a
question; files are edited in their middle now and then, and a question is sometimes
asked again in other words (a retry). kvrt serves it two ways: one session that holds
the whole context hot, and a new session each turn (as a server without affinity would:
everything comes back from the cold store). Printed: tokens computed, seconds, and
the bytes each holds for reuse at the end (kvrt's cold store, LlamaRAMCache's states).

Run: ``python benchmarks/prefix_reuse.py [--turns 10]``. Figures to read, not assertions;
every figure is measured in this run. Uses kvrt's public API only.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

import kvrt
import kvrt.models

SYSTEM = "You are a coding agent. Read the files you are shown and answer in one sentence."
REPO_MAP = "Repository map:\n" + "".join(
    f"- pkg/module_{i}.py: parsers and helpers for feature {i}\n" for i in range(30)
)


def source(n: int, version: int) -> str:
    lines = [f"def f{n}_{i}(x):\n    return x * {i} + {n}  # step {i}\n" for i in range(24)]
    if version:  # an edit in the middle of the file
        lines[12] = f"def f{n}_12(x):\n    return x * 12 - {version}  # edited\n"
    return "".join(lines)


def trace(turns: int) -> list[list[kvrt.Segment]]:
    opened = [[0], [0], [0, 1], [0, 1], [1], [1, 2], [2], [2], [0, 2], [0, 2]]
    versions = {0: 0, 1: 0, 2: 0}
    contexts: list[list[kvrt.Segment]] = []
    history: list[kvrt.Segment] = []
    for t in range(turns):
        files = opened[t % len(opened)]
        if t % 3 == 2:
            versions[files[0]] += 1  # the agent edited a file
        retry = t % 4 == 3
        ask = f"Turn {t}: what does f{files[-1]}_{t % 7} return?"
        question = kvrt.Segment(
            f"user-{t}", ask.replace("what does", "tell me what") if retry else ask
        )
        contexts.append(
            [
                kvrt.Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
                kvrt.Segment("repo_map", REPO_MAP, cache_class=kvrt.CacheClass.REPO_MAP),
                *(kvrt.Segment(f"file-{n}", source(n, versions[n])) for n in files),
                *history,
                question,
            ]
        )
        reply = kvrt.Segment(f"assistant-{t}", f"It returns x times {t % 7} plus {files[-1]}.")
        history = [*history, question, reply][-4:]
    return contexts


async def kvrt_trace(
    contexts: list[list[kvrt.Segment]], *, fresh: bool, hot: int, model: str | None = None
) -> dict[str, Any]:
    computed, began = 0, time.perf_counter()
    config = kvrt.Config(disk=kvrt.DiskConfig(budget=0))
    async with kvrt.open_runtime(config=config, model=model) as rt:
        tokenize = rt.engine.tokenize
        prompts = [
            [t for i, seg in enumerate(c) for t in tokenize(seg.text, add_special=i == 0)]
            for c in contexts
        ]
        if fresh:
            for segments in contexts:
                async with rt.open_session(hot_tokens=hot) as s:
                    computed += (await s.ensure_context(segments)).prefilled_tokens
        else:
            async with rt.open_session(hot_tokens=hot) as s:
                for segments in contexts:
                    computed += (await s.ensure_context(segments)).prefilled_tokens
        held = rt.cold_stats().bytes
    return {
        "computed": computed,
        "seconds": time.perf_counter() - began,
        "bytes": held,
        "prompts": prompts,
    }


def ram_cache_trace(prompts: list[list[int]], model: str | None = None) -> dict[str, Any]:
    from llama_cpp.llama_cache import LlamaRAMCache

    from kvrt.adapters.llama import reference_llama

    llm = reference_llama(
        model or str(kvrt.embedded_model_path()),
        n_ctx=max(len(p) for p in prompts) + 16,
        verbose=False,
        flash_attn=False,
    )
    cache = LlamaRAMCache(capacity_bytes=2 << 30)
    llm.set_cache(cache)
    computed = 0
    evaluate = llm.eval

    def counting(tokens: Any) -> None:
        nonlocal computed
        computed += len(tokens)
        evaluate(tokens)

    llm.eval = counting  # type: ignore[method-assign]
    began = time.perf_counter()
    for prompt in prompts:
        for _ in llm.create_completion(prompt, max_tokens=1, temperature=0.0, stream=True):
            pass
    seconds = time.perf_counter() - began
    held = cache.cache_size
    llm.close()
    return {"computed": computed - len(prompts), "seconds": seconds, "bytes": held}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2)")
    args = parser.parse_args()
    contexts = trace(args.turns)
    one = await kvrt_trace(contexts, fresh=False, hot=4096, model=args.model)
    each = await kvrt_trace(contexts, fresh=True, hot=4096, model=args.model)
    prompts = one["prompts"]
    ram = await anyio.to_thread.run_sync(ram_cache_trace, prompts, args.model)
    total = sum(len(p) for p in prompts)
    print(f"{args.turns} turns, {total} context tokens in all (largest {max(map(len, prompts))})")
    print(f"{'system':<44} {'computed':>9} {'seconds':>8} {'held MiB':>9}")
    rows = [
        ("kvrt, one session", one),
        ("kvrt, a new session each turn", each),
        ("llama_cpp.Llama + LlamaRAMCache", ram),
    ]
    for name, r in rows:
        print(f"{name:<44} {r['computed']:>9} {r['seconds']:>8.2f} {r['bytes'] / 2**20:>9.1f}")


if __name__ == "__main__":
    anyio.run(main)
