"""Policies registered by name, so configuration can pick them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["get", "names", "register"]

T = TypeVar("T")

_REGISTRY: dict[str, dict[str, Callable[[], Any]]] = {}


def register(kind: str, name: str) -> Callable[[T], T]:
    """Class decorator: make a policy available as ``get(kind, name)``."""

    def add(cls: T) -> T:
        table = _REGISTRY.setdefault(kind, {})
        if name in table:
            raise ValueError(f"a {kind} policy named {name!r} is already registered")
        table[name] = cls  # type: ignore[assignment]
        return cls

    return add


def get(kind: str, name: str) -> Any:
    """A new instance of the ``kind`` policy registered as ``name``."""
    table = _REGISTRY.get(kind, {})
    factory = table.get(name)
    if factory is None:
        known = ", ".join(sorted(table)) or "none"
        raise KeyError(f"no {kind} policy named {name!r} (known: {known})")
    return factory()


def names(kind: str) -> list[str]:
    return sorted(_REGISTRY.get(kind, {}))
