"""Small helpers shared by the core."""

from __future__ import annotations

import os
from typing import Any, TypeVar

__all__ = ["NoPublicConstructor", "physical_cores"]

T = TypeVar("T")


class NoPublicConstructor(type):
    """Metaclass for objects that only make sense inside a scope (as trio does it).

    ``Cls(...)`` raises ``TypeError``; kvrt itself builds them with ``Cls._create(...)``.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} has no public constructor")

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc,no-any-return]


def physical_cores() -> int:
    """Physical CPU cores (logical ones where that cannot be told)."""
    try:
        import psutil

        return int(psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except Exception:
        return os.cpu_count() or 1
