"""The engine without kvrt, for benchmarks that measure kvrt beside it."""

from __future__ import annotations

import time
from typing import Any

from kvrt.backend import EngineConfig

__all__ = ["REFERENCE_NAME", "reference_greedy_tps", "reference_trace", "same_settings"]

REFERENCE_NAME = "llama_cpp.Llama"


def same_settings(config: EngineConfig | None) -> dict[str, Any]:
    """``llama_cpp.Llama`` arguments for the KV type and flash attention kvrt uses."""
    from kvrt.native_bridge.llama import KV_TYPES

    from ._engine import LlamaEngine

    config = config or EngineConfig()
    ggml_type = KV_TYPES[config.kv_type][0]
    return {
        "flash_attn": LlamaEngine.flash_attention(config),
        "type_k": ggml_type,
        "type_v": ggml_type,
    }


def reference_greedy_tps(
    path: str, prompt: list[int], n: int, config: EngineConfig | None = None
) -> float:
    """Greedy decode tokens/s of ``llama_cpp.Llama`` itself after ``prompt``."""
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=len(prompt) + n + 8, verbose=False, **same_settings(config))
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


TRACE_NAMES = ("llama_cpp.Llama", "llama_cpp.Llama + LlamaRAMCache")


def reference_trace(
    path: str, prompts: list[list[int]], n_ctx: int, config: EngineConfig | None = None
) -> dict[str, list[tuple[float, float]]]:
    """Each prompt sent in turn to ``llama_cpp.Llama`` as users run it, without and with its
    ``LlamaRAMCache``; per system, per turn: seconds to the first token and for the call.

    Without the cache, Llama reuses only the prefix its previous prompt shares; with it, the
    saved state of the longest matching earlier prompt is loaded first (and a state saved
    after every call).
    """
    import llama_cpp

    from kvrt.backend import physical_cores

    config = config or EngineConfig()
    threads = config.threads or physical_cores()
    out: dict[str, list[tuple[float, float]]] = {}
    for name in TRACE_NAMES:
        llm = llama_cpp.Llama(
            path,
            n_ctx=n_ctx,
            n_batch=config.batch,
            n_threads=threads,
            verbose=False,
            **same_settings(config),
        )
        if name.endswith("LlamaRAMCache"):
            llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=2 << 30))  # type: ignore[attr-defined]
        turns = []
        for prompt in prompts:
            started = time.perf_counter()
            first = None
            for _chunk in llm.create_completion(
                prompt, max_tokens=1, temperature=0.0, top_k=1, repeat_penalty=1.0, stream=True
            ):
                if first is None:
                    first = time.perf_counter() - started
            total = time.perf_counter() - started
            turns.append((first if first is not None else total, total))
        llm.close()
        out[name] = turns
    return out
