"""The engine's own way of doing the work without kvrt, found through the adapter package
(``REFERENCE_NAME``, ``reference_greedy_tps``, ``reference_trace``; see :mod:`kvrt.backend`)."""

from __future__ import annotations

from kvrt import EngineConfig
from kvrt.backend import adapter_package

__all__ = ["reference_greedy_tps", "reference_trace"]


def reference_greedy_tps(
    config: EngineConfig, path: str, prompt: list[int], n: int
) -> tuple[str, float]:
    """The backend's own greedy decode loop without kvrt, for benchmarks: name and tokens/s."""
    adapter = adapter_package(config.backend)
    return str(adapter.REFERENCE_NAME), float(adapter.reference_greedy_tps(path, prompt, n, config))


def reference_trace(
    config: EngineConfig, path: str, prompts: list[list[int]], n_ctx: int
) -> dict[str, list[tuple[float, float]]]:
    """The backend's own way of serving a sequence of prompts without kvrt, for benchmarks:
    per system, per prompt, seconds to the first token and for the whole call."""
    result: dict[str, list[tuple[float, float]]] = adapter_package(config.backend).reference_trace(
        path, prompts, n_ctx, config
    )
    return result
