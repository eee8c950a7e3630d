"""Engines by name: kvrt imports an adapter only when it is asked for."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import cast

from ._backend import Engine
from ._config import EngineConfig
from ._errors import ConfigError

__all__ = ["BACKENDS", "open_engine", "reference_greedy_tps", "reference_trace"]

BACKENDS: dict[str, tuple[str, str]] = {
    "llama": ("kvrt.adapters.llama", "LlamaEngine"),
    "openvino": ("kvrt.adapters.openvino", "OpenVinoEngine"),
}
"""Backend name -> the adapter package and its Engine class (see :mod:`kvrt.backend`)."""


def _adapter(backend: str) -> ModuleType:
    found = BACKENDS.get(backend)
    if found is None:
        raise ConfigError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    return importlib.import_module(found[0])


def open_engine(config: EngineConfig) -> Engine:
    """Load the model named by ``config`` on the backend it names."""
    engine_class = getattr(_adapter(config.backend), BACKENDS[config.backend][1])
    return cast(Engine, engine_class.open(config))


def reference_greedy_tps(
    config: EngineConfig, path: str, prompt: list[int], n: int
) -> tuple[str, float]:
    """The backend's own greedy decode loop without kvrt, for benchmarks: name and tokens/s."""
    adapter = _adapter(config.backend)
    return str(adapter.REFERENCE_NAME), float(adapter.reference_greedy_tps(path, prompt, n, config))


def reference_trace(
    config: EngineConfig, path: str, prompts: list[list[int]], n_ctx: int
) -> dict[str, list[tuple[float, float]]]:
    """The backend's own way of serving a sequence of prompts without kvrt, for benchmarks:
    per system, per prompt, seconds to the first token and for the whole call."""
    result: dict[str, list[tuple[float, float]]] = _adapter(config.backend).reference_trace(
        path, prompts, n_ctx, config
    )
    return result
