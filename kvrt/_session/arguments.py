"""A session call's arguments, checked before anything is sent to the actor: each wrong
one is an error naming it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from .._chat.grammar import Grammar
from .._checks import check_int, check_struct, check_text
from .._engine.contract import SamplingParams
from .._errors import (
    ArgumentTypeError,
    ContextTypeError,
    InvalidArgumentError,
    InvalidContextError,
)
from .._paging.segments import Segment

__all__ = ["grammar", "logprobs", "required", "sampling", "segments", "stops", "target"]


def segments(segments: Any) -> tuple[Segment, ...]:
    """``segments`` as a tuple of :class:`Segment`, or an error naming what is wrong."""
    if isinstance(segments, (str, bytes, Segment, Mapping)) or not isinstance(segments, Iterable):
        raise ContextTypeError(
            f"segments must be a sequence of kvrt.Segment, got {type(segments).__name__}"
        )
    out = tuple(segments)
    for i, seg in enumerate(out):
        if not isinstance(seg, Segment):
            raise ContextTypeError(
                f"segments[{i}] must be a kvrt.Segment, got {type(seg).__name__}"
            )
    if not out:
        raise InvalidContextError("the context is empty: give at least one segment")
    return out


def required(names: Any, segments: tuple[Segment, ...]) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ArgumentTypeError(
            f"require_visible must be a list of segment names, got {type(names).__name__}"
        )
    required = tuple(names)
    known = {s.name for s in segments}
    for name in required:
        if not isinstance(name, str):
            raise ArgumentTypeError(f"require_visible names must be str, got {name!r}")
        if name not in known:
            raise InvalidContextError(
                f"require_visible names {name!r}, which is not a segment of this context"
            )
    return required


def target(target: Any) -> str | tuple[int, int]:
    """A segment name or a ``(start, end)`` position range, checked."""
    if isinstance(target, str):
        return check_text("target segment name", target, empty=False)
    if isinstance(target, (tuple, list)) and len(target) == 2:
        start = check_int("range start", target[0], low=0)
        end = check_int("range end", target[1], low=start + 1)
        return (start, end)
    raise ArgumentTypeError(
        "target must be a segment name or a (start, end) position range, got "
        f"{type(target).__name__} {target!r}"[:200]
    )


def sampling(
    sampling: SamplingParams | Mapping[str, Any] | None, **given: float | int | None
) -> SamplingParams:
    """``sampling`` with the keyword arguments given on top (they win)."""
    params = (
        SamplingParams() if sampling is None else check_struct("sampling", sampling, SamplingParams)
    )
    changes = {k: v for k, v in given.items() if v is not None}
    if not changes:
        return params
    return check_struct("sampling", {**msgspec.structs.asdict(params), **changes}, SamplingParams)


def grammar(grammar: Any) -> Grammar | None:
    if grammar is not None and not isinstance(grammar, Grammar):
        raise ArgumentTypeError(
            f"grammar must be a kvrt.Grammar (Grammar.json_schema, .regex, .lark, .gbnf), got "
            f"{type(grammar).__name__}"
        )
    return grammar


def logprobs(logprobs: Any) -> int | None:
    """``logprobs``: how many alternatives to report per token (0 to 20), or None."""
    if logprobs is None:
        return None
    return check_int("logprobs", logprobs, low=0, high=20)


def stops(stop: Any) -> tuple[str, ...]:
    """Stop sequences: a string, a sequence of strings, or None."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (bytes, Mapping)) or not isinstance(stop, Iterable):
        raise ArgumentTypeError(
            f"stop must be a string or a list of strings, got {type(stop).__name__}",
            param="stop",
        )
    out = tuple(stop)
    if len(out) > 16:
        raise InvalidArgumentError(f"at most 16 stop sequences, got {len(out)}", param="stop")
    for i, s in enumerate(out):
        try:
            check_text("a stop sequence", s, empty=False)
        except (ArgumentTypeError, InvalidArgumentError) as exc:
            raise type(exc)(f"stop[{i}]: {exc}", param=f"stop[{i}]") from None
    return out
