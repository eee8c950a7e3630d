"""Argument checks for the public entry points.

Every value a caller hands kvrt is checked where it enters, before a command reaches a
session's actor or anything reaches an engine: a wrong type raises
:class:`~kvrt.ArgumentTypeError` (also a ``TypeError``), a wrong value
:class:`~kvrt.InvalidArgumentError` (also a ``ValueError``), and both messages name the
argument and what was expected.
"""

from __future__ import annotations

import enum
import math
import os
import stat
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from ._errors import ArgumentTypeError, ConfigError, InvalidArgumentError

__all__ = [
    "MAX_SALT",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_salt",
    "check_struct",
    "check_text",
    "read_small_file",
]

MAX_SALT = 256
"""The longest ``cache_salt`` kvrt takes (characters)."""

E = TypeVar("E", bound=enum.Enum)
S = TypeVar("S", bound=msgspec.Struct)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int within ``[low, high]`` (``bool`` is not an integer here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(
            f"{name} must be an integer, got {type(value).__name__} {_shown(value)}", param=name
        )
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidArgumentError(f"{name} must be {_bounds(low, high)}, got {value}", param=name)
    return int(value)


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    """``value`` as a finite float within ``[low, high]`` (``(low, high]`` if ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(
            f"{name} must be a number, got {type(value).__name__} {_shown(value)}", param=name
        )
    number = float(value)
    below = low is not None and (number <= low if low_open else number < low)
    if not math.isfinite(number) or below or (high is not None and number > high):
        bounds = _bounds(low, high, low_open=low_open)
        raise InvalidArgumentError(
            f"{name} must be a finite number {bounds}, got {value!r}", param=name
        )
    return number


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(
            f"{name} must be True or False, got {type(value).__name__} {_shown(value)}",
            param=name,
        )
    return value


def check_text(name: str, value: Any, *, empty: bool = True) -> str:
    """``value`` as a str that encodes to UTF-8 (no lone surrogates); non-empty unless
    ``empty``."""
    if not isinstance(value, str):
        raise ArgumentTypeError(
            f"{name} must be a str, got {type(value).__name__} {_shown(value)}", param=name
        )
    if not empty and not value:
        raise InvalidArgumentError(f"{name} must not be empty", param=name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{name} is not valid Unicode text: {exc.reason} at index {exc.start}", param=name
        ) from None
    return value


def check_salt(value: Any, name: str = "cache_salt") -> str:
    """A cache salt: 1 to :data:`MAX_SALT` printable characters."""
    check_text(name, value, empty=False)
    if len(value) > MAX_SALT:
        raise InvalidArgumentError(
            f"{name} holds {len(value)} characters; at most {MAX_SALT}", param=name
        )
    if not value.isprintable():
        raise InvalidArgumentError(
            f"{name} must be printable text (no control characters)", param=name
        )
    return str(value)


def check_choice(name: str, value: Any, kind: type[E]) -> E:
    """``value`` as a member of the enum ``kind`` (its member or its value)."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        choices = ", ".join(repr(m.value) for m in kind)
        raise InvalidArgumentError(
            f"{name} must be one of {choices}, got {_shown(value)}", param=name
        ) from None


def check_struct(name: str, value: Any, kind: type[S]) -> S:
    """``value`` as a ``kind`` Struct: an instance is checked against its field
    constraints, a mapping is converted (unknown keys refused)."""
    if isinstance(value, kind):
        raw: Any = msgspec.structs.asdict(value)
    elif isinstance(value, Mapping):
        raw = dict(value)
    else:
        raise ArgumentTypeError(
            f"{name} must be a {kind.__name__} or a mapping of its fields, got "
            f"{type(value).__name__} {_shown(value)}"
        )
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        where = str(exc).replace("`$.", f"`{name}.").replace("`$`", f"`{name}`")
        raise InvalidArgumentError(f"invalid {name}: {where}", param=name) from None


def _bounds(low: float | None, high: float | None, *, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"<= {high}"
    return "a number"


def read_small_file(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them: a
    :class:`~kvrt.ConfigError` naming ``what`` for anything else (missing, unreadable, a
    pipe or a device such as ``/dev/zero``, larger than ``limit``). Opened without
    blocking, so a FIFO nobody writes is refused at once, never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ConfigError(
            f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"cannot read {what} {path}: not a regular file")
        raw = b""
        while len(raw) <= limit:
            part = os.read(fd, limit + 1 - len(raw))
            if not part:
                break
            raw += part
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise ConfigError(f"cannot read {what} {path}: larger than {limit:,} bytes")
    return raw
