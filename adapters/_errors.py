"""The one place adapters turn bridge errors into kvrt errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvrt import EngineError, KvrtError, ModelLoadError
from kvrt.native_bridge import BridgeError, BridgeLoadError

__all__ = ["translate_errors"]


@contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Re-raise bridge errors as kvrt errors that say what was being done."""
    try:
        yield
    except KvrtError:
        raise
    except BridgeLoadError as exc:
        raise ModelLoadError(str(exc)) from exc
    except BridgeError as exc:
        raise EngineError(f"{what}: {exc}") from exc
