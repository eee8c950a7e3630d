"""The engine without kvrt, for benchmarks that measure kvrt beside it."""

from __future__ import annotations

import time

import numpy as np

from kvrt._config import EngineConfig
from native_bridge.openvino import OvModel

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
