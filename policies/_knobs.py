"""Reading a policy's knob: the text after the colon in ``"name:argument"``."""

from __future__ import annotations

__all__ = ["share"]


def share(value: str | float, what: str) -> float:
    """``value`` as a number in [0, 1]; a ``ValueError`` naming ``what`` otherwise (the
    registry makes it a :class:`kvrt.ConfigError`)."""
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"the {what} must be a number in [0, 1], got {value!r}")
    return number
