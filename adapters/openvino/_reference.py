"""The engine without kvrt, for benchmarks that measure kvrt beside it."""

from __future__ import annotations

import time

import numpy as np

from kvrt.backend import EngineConfig
from kvrt.native_bridge.openvino import OvModel

from ._engine import PROFILES

__all__ = ["REFERENCE_NAME", "reference_greedy_tps"]

REFERENCE_NAME = "a raw OpenVINO infer-request loop"


def reference_greedy_tps(
    folder: str, prompt: list[int], n: int, config: EngineConfig | None = None
) -> float:
    """Greedy decode tokens/s of a bare infer-request loop on the IR in ``folder``."""
    config = config or EngineConfig(backend="openvino")
    settings = {**PROFILES[config.openvino_profile], "KV_CACHE_PRECISION": config.kv_type}
    request = OvModel(f"{folder}/openvino_model.xml", config=settings).request()
    logits = request.infer(prompt, range(len(prompt)))
    started = time.perf_counter()
    for i in range(n):
        logits = request.infer([int(np.argmax(logits))], [len(prompt) + i])
    return n / (time.perf_counter() - started)


TRACE_NAMES = ("a raw OpenVINO infer request (recomputes every prompt)",)


def reference_trace(
    folder: str, prompts: list[list[int]], n_ctx: int, config: EngineConfig | None = None
) -> dict[str, list[tuple[float, float]]]:
    """Each prompt computed whole on a fresh infer request: seconds to the first token and
    for the call, per turn."""
    config = config or EngineConfig(backend="openvino")
    settings = {**PROFILES[config.openvino_profile], "KV_CACHE_PRECISION": config.kv_type}
    model = OvModel(f"{folder}/openvino_model.xml", config=settings)
    turns = []
    for prompt in prompts:
        started = time.perf_counter()
        request = model.request()
        logits = request.infer(prompt, range(len(prompt)))
        int(np.argmax(logits))
        elapsed = time.perf_counter() - started
        request.close()
        turns.append((elapsed, elapsed))
    return {TRACE_NAMES[0]: turns}
