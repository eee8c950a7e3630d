"""The engine without kvrt, for benchmarks that measure kvrt beside it."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import msgspec

from kvrt.backend import EngineConfig

if TYPE_CHECKING:
    import llama_cpp

__all__ = [
    "REFERENCE_NAME",
    "reference_greedy_tps",
    "reference_llama",
    "reference_trace",
    "same_settings",
    "same_weights",
]

REFERENCE_NAME = "llama_cpp.Llama"


def same_settings(config: EngineConfig | None, path: str | None = None) -> dict[str, Any]:
    """``llama_cpp.Llama`` arguments for the KV type and flash attention kvrt uses under
    ``config`` on the model at ``path`` (default: the one ``config`` names)."""
    from kvrt.native_bridge.llama import KV_TYPES

    from ._engine import LlamaEngine

    config = config or EngineConfig()
    if path is not None:
        config = msgspec.structs.replace(config, model=path)
    ggml_type = KV_TYPES[config.kv_type][0]
    return {
        "flash_attn": LlamaEngine.flash_attention(config),
        "type_k": ggml_type,
        "type_v": ggml_type,
    }


def same_weights() -> AbstractContextManager[None]:
    """While open, ``llama_cpp.Llama`` (and ``llama_cpp.server``) load weights into the
    buffers kvrt loads them into (see :func:`kvrt.native_bridge.llama.extra_buffers_safe`)."""
    from kvrt.native_bridge.llama import model_params_for_llama_cpp

    return model_params_for_llama_cpp()


def reference_llama(
    path: str, config: EngineConfig | None = None, **kwargs: Any
) -> llama_cpp.Llama:
    """``llama_cpp.Llama(path, **kwargs)`` running the kernels kvrt runs under ``config``:
    its KV type and flash attention (:func:`same_settings`) and its weights' buffers
    (:func:`same_weights`)."""
    import llama_cpp

    with same_weights():
        return llama_cpp.Llama(path, **{**same_settings(config, path), **kwargs})


def reference_greedy_tps(
    path: str, prompt: list[int], n: int, config: EngineConfig | None = None
) -> float:
    """Greedy decode tokens/s of ``llama_cpp.Llama`` itself after ``prompt``."""
    llm = reference_llama(path, config, n_ctx=len(prompt) + n + 8, verbose=False)
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

    from ._engine import BATCH

    config = config or EngineConfig()
    threads = config.threads or physical_cores()
    out: dict[str, list[tuple[float, float]]] = {}
    for name in TRACE_NAMES:
        llm = reference_llama(
            path,
            config,
            n_ctx=n_ctx,
            n_batch=config.batch or BATCH,
            n_threads=threads,
            verbose=False,
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
