"""Engines by name: kvrt imports an adapter only when it is asked for."""

from __future__ import annotations

import importlib
from typing import cast

from ._backend import Engine
from ._config import EngineConfig
from ._errors import ConfigError

__all__ = ["BACKENDS", "open_engine", "reference_greedy_tps", "reference_trace"]

BACKENDS: dict[str, str] = {
    "llama": "kvrt.adapters.llama:LlamaEngine",
    "openvino": "kvrt.adapters.openvino:OpenVinoEngine",
}


def open_engine(config: EngineConfig) -> Engine:
    """Load the model named by ``config`` on the backend it names."""
    target = BACKENDS.get(config.backend)
    if target is None:
        raise ConfigError(f"unknown backend {config.backend!r}; known: {', '.join(BACKENDS)}")
    module_name, _, class_name = target.partition(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return cast(Engine, engine_class.open(config))


def reference_greedy_tps(
    config: EngineConfig, path: str, prompt: list[int], n: int
) -> tuple[str, float]:
    """The backend's own greedy decode loop without kvrt, for benchmarks: name and tokens/s."""
    if config.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {config.backend!r}; known: {', '.join(BACKENDS)}")
    module = importlib.import_module(f"kvrt.adapters.{config.backend}._reference")
    return str(module.REFERENCE_NAME), float(module.reference_greedy_tps(path, prompt, n, config))


def reference_trace(
    config: EngineConfig, path: str, prompts: list[list[int]], n_ctx: int
) -> dict[str, list[tuple[float, float]]]:
    """The backend's own way of serving a sequence of prompts without kvrt, for benchmarks:
    per system, per prompt, seconds to the first token and for the whole call."""
    if config.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {config.backend!r}; known: {', '.join(BACKENDS)}")
    module = importlib.import_module(f"kvrt.adapters.{config.backend}._reference")
    result: dict[str, list[tuple[float, float]]] = module.reference_trace(
        path, prompts, n_ctx, config
    )
    return result
