"""Small helpers shared by the core."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["NoPublicConstructor", "cache_home", "physical_cores"]

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
    """Physical CPU cores (logical ones where that cannot be told), at most the CPUs this
    process may run on: pinned to one core (``taskset -c 0``), an engine runs one thread,
    not two spinning on one core."""
    try:
        import psutil

        cores = int(psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except Exception:
        cores = os.cpu_count() or 1
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return cores
    return max(1, min(cores, allowed))


def cache_home(env: Mapping[str, str] | None = None) -> Path:
    """kvrt's cache folder: ``$KVRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrt``, else
    ``~/.cache/kvrt`` (the disk tier's ``blocks/`` and the models' ``models/`` are in it)."""
    env = os.environ if env is None else env
    if env.get("KVRT_CACHE_DIR"):
        return Path(env["KVRT_CACHE_DIR"]).expanduser()
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base.expanduser() / "kvrt"
