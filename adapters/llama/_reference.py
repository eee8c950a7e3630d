"""The engine without kvrt, for benchmarks that measure kvrt beside it."""

from __future__ import annotations

import time

from kvrt._config import EngineConfig

__all__ = ["REFERENCE_NAME", "reference_greedy_tps"]

REFERENCE_NAME = "llama_cpp.Llama"


def reference_greedy_tps(
    path: str, prompt: list[int], n: int, config: EngineConfig | None = None
) -> float:
    """Greedy decode tokens/s of ``llama_cpp.Llama`` itself after ``prompt``."""
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=len(prompt) + n + 8, verbose=False)
    llm.eval(prompt)  # prefill first: generate() then finds the prompt cached and only decodes
    got = 0
    started = time.perf_counter()
    for _ in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        got += 1
        if got >= n:
            break
    elapsed = time.perf_counter() - started
    llm.close()
    return got / elapsed
