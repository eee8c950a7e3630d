"""Errors raised by the native bridge; adapters translate them into kvrt errors."""

from __future__ import annotations

__all__ = ["BridgeArgumentError", "BridgeCallError", "BridgeError", "BridgeLoadError"]


class BridgeError(Exception):
    """Base class of the bridge's errors."""


class BridgeArgumentError(BridgeError, ValueError):
    """An argument was refused before it reached native code."""


class BridgeCallError(BridgeError, RuntimeError):
    """A native call reported failure (its last log lines are in the message)."""


class BridgeLoadError(BridgeError):
    """A model could not be loaded."""
