"""Engines by name: kvrt imports an adapter only when it is asked for."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import cast

from .._config import EngineConfig
from .._errors import ConfigError
from .contract import Engine

__all__ = ["BACKENDS", "adapter_package", "open_engine"]

BACKENDS: dict[str, tuple[str, str]] = {
    "llama": ("kvrt.adapters.llama", "LlamaEngine"),
    "openvino": ("kvrt.adapters.openvino", "OpenVinoEngine"),
}
"""Backend name -> the adapter package and its Engine class (see :mod:`kvrt.backend`)."""


def adapter_package(backend: str) -> ModuleType:
    """The adapter package of ``backend`` (see :mod:`kvrt.backend`)."""
    found = BACKENDS.get(backend)
    if found is None:
        raise ConfigError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    return importlib.import_module(found[0])


def open_engine(config: EngineConfig) -> Engine:
    """Load the model named by ``config`` on the backend it names."""
    engine_class = getattr(adapter_package(config.backend), BACKENDS[config.backend][1])
    return cast(Engine, engine_class.open(config))
