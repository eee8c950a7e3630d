"""kvrt's one exception hierarchy.

Every failure a user can cause or meet surfaces as a :class:`KvrtError` subclass with a
message that names what was wrong. Engine errors are translated at the adapter boundary
with ``raise ... from exc``; native code is never allowed to see an argument that could
abort the process.
"""

from __future__ import annotations

import copy

__all__ = [
    "ArgumentTypeError",
    "ColdBlockMismatchError",
    "ColdStoreFullError",
    "ConfigError",
    "ContextTooLargeError",
    "ContextTypeError",
    "EngineError",
    "HotWindowFullError",
    "InvalidArgumentError",
    "InvalidContextError",
    "InvalidRangeError",
    "InvalidTokenError",
    "KvrtError",
    "ModelLoadError",
    "NotVisibleError",
    "OperationCancelledError",
    "SessionClosedError",
    "UnknownPolicyError",
    "UnknownSegmentError",
]


class KvrtError(Exception):
    """Base class of every error kvrt raises on purpose."""


class ConfigError(KvrtError, ValueError):
    """A configuration value is invalid; the message names the field and its source."""


class InvalidArgumentError(KvrtError, ValueError):
    """An argument to a public call is out of range or malformed; the message names the
    argument and what was expected. Nothing was sent to the session or the engine.

    ``param`` is the argument it is about, as a path into what was given
    (``messages[2].content``, ``tools[0].function.parameters``), where kvrt knows it: a
    server answering for kvrt names the parameter from it, never from the message."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument to a public call has the wrong type (also a ``TypeError``)."""


class InvalidContextError(InvalidArgumentError):
    """The segments given do not make a context: none at all, nothing but empty text, or
    two segments with one name (names must be unique in a context)."""


class ContextTypeError(InvalidContextError, ArgumentTypeError):
    """Something other than a :class:`kvrt.Segment` where a segment is expected (also a
    ``TypeError``)."""


class ModelLoadError(KvrtError):
    """A model file is missing, unreadable or not a model the engine can load."""


class EngineError(KvrtError):
    """The engine refused or failed an operation that passed kvrt's own checks."""


class InvalidRangeError(KvrtError, ValueError):
    """A token or position range lies outside what the hot window holds."""


class InvalidTokenError(KvrtError, ValueError):
    """A token id lies outside the model's vocabulary."""


class HotWindowFullError(KvrtError):
    """The hot window has no room for the tokens asked for; evict first."""


class ColdBlockMismatchError(KvrtError, ValueError):
    """Cold KV bytes do not belong to this model, KV layout or position."""


class ColdStoreFullError(KvrtError):
    """The cold store stayed full for the whole bounded wait: nothing in it could be dropped."""


class NotVisibleError(KvrtError):
    """Segments the caller requires visible (``require_visible``) cannot all be hot at once:
    the model would not attend to them. Raised before anything is placed."""


class ContextTooLargeError(KvrtError, ValueError):
    """The context asked for does not fit the session's planner context (and nothing
    else: a malformed context is an :class:`InvalidContextError`)."""


class UnknownPolicyError(ConfigError, KeyError):
    """No policy of that kind is registered under that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownSegmentError(KvrtError, KeyError):
    """No segment of that name is in the session's context."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NotInColdStoreError(KvrtError, LookupError):
    """A block asked back has no KV bytes left in any cold tier: send it again with
    ``ensure_context`` to compute it."""


class SharedValueError(KvrtError):
    """A value on the replicas' shared server failed its check (its tag: written without
    the secret, altered or moved; or its size): never used, deleted from the server."""


class ContextNotPlacedError(KvrtError):
    """The last ``ensure_context`` was cancelled or failed before its context was in
    place: send the context again before generating."""


class SessionClosedError(KvrtError):
    """The session (or its runtime) is closed."""


class OperationCancelledError(KvrtError):
    """A session call was cancelled; whatever it had done is kept consistent."""


def detached(exc: KvrtError) -> KvrtError:
    """A copy of ``exc`` with no traceback, to keep or to raise in another task: a
    traceback holds the frames it passed, and worker threads' futures and outcomes hold
    the error that holds it (cycles that would keep what those frames held, a refused
    request's megabytes, until the garbage collector next looks)."""
    try:
        copied = copy.copy(exc)
    except Exception:  # an error whose arguments cannot build it again
        copied = KvrtError(str(exc))
    copied.__traceback__ = None
    return copied
