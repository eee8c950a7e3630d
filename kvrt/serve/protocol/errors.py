"""A refused request as the OpenAI API answers it: a status and an error body naming the
parameter, and kvrt's own errors read as one (by their ``param``, never their text)."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

import kvrt

__all__ = ["MAX_BODY", "ErrorBody", "RequestError", "error_body", "refusal"]

MAX_BODY = 64 * 1024 * 1024
"""The largest request body read (64 MiB: far more than any context fits)."""


class RequestError(Exception):
    """A request kvrt refuses: the status and OpenAI-style error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    """What was refused: the message, its type, the parameter and the code."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, frozen=True):
    """A refusal's body, as OpenAI answers one."""

    error: ErrorDetail


def error_body(exc: RequestError) -> ErrorBody:
    """``exc``'s body."""
    return ErrorBody(ErrorDetail(message=str(exc), type=exc.kind, param=exc.param, code=exc.code))


def refusal(
    exc: kvrt.KvrtError, params: Mapping[str, str] | None = None, *, default: str | None = None
) -> RequestError:
    """``exc`` as the request's error: a bad argument is a 400 naming the parameter it
    carries (``params`` maps kvrt's name of it, or of what holds it, to the API's:
    ``sampling.logit_bias[5]`` to ``logit_bias``; ``default`` names it when kvrt gives
    none), a context too large a 400 of
    its own code, a closed runtime a 503, anything else a 500."""
    if isinstance(exc, kvrt.SessionClosedError):
        return RequestError(
            f"this server's runtime is closed: {exc}",
            status=503,
            code="runtime_closed",
            kind="server_error",
        )
    if isinstance(exc, kvrt.ContextTooLargeError):
        return RequestError(str(exc), code="context_length_exceeded")
    if isinstance(exc, kvrt.InvalidArgumentError):
        param = exc.param or default
        for theirs, ours in (params or {}).items():
            if param is not None and (
                param == theirs or param.startswith((f"{theirs}[", f"{theirs}."))
            ):
                param = ours
        return RequestError(str(exc), param=param)
    return RequestError(str(exc), status=500, kind="server_error")
