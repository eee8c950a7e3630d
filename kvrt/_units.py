"""Byte sizes as people write them: ``512MiB``, ``8GiB``, ``1.5GB`` or plain bytes."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Return a byte count from an int or a string such as ``"8GiB"``.

    >>> parse_size("512MiB")
    536870912
    >>> parse_size(1024)
    1024

    Raises ``ValueError`` with a message meant for people.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '512MiB' or a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(f"expected a size such as '512MiB', '8GiB' or a byte count, got {value!r}")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        known = ", ".join(u for u in ("B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"))
        raise ValueError(f"unknown size unit {unit!r} in {value!r} (known: {known})")
    return int(float(number) * factor)


def format_size(n: int | None) -> str:
    """Render a byte count with a binary unit, ``"?"`` when unknown."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
