"""A context's tokens as a session places them: each segment tokenized on its own (special
tokens only where it says so, a reply placed with the tokens generated for it), a text far
too large refused after reading a little of it, and what a prefetch hands the call it
prepares."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._engine.contract import Engine
from .._errors import ContextTooLargeError
from .segments import Placed, Segment

__all__ = [
    "Prepared",
    "ReplyTokens",
    "TokenKey",
    "check_fits",
    "context_tokens",
    "segment_tokens",
]

TokenKey = tuple[str, bool, bool, tuple[tuple[int, int], ...]]
"""What a segment's tokens depend on: its text, whether it opens the context, whether it
parses special tokens, and its markup ranges."""


ReplyTokens = tuple[str, list[int], str]
"""A reply placed with its generated tokens: its text, the tokens, and the text after
them still to tokenize (a stop sequence may have cut the last token short)."""


def segment_tokens(
    engine: Engine, segment: Segment, *, first: bool, reply: ReplyTokens | None = None
) -> Placed:
    """A segment's tokens as a session places them: special tokens (BOS) only before the
    context's first segment; special-token markup read only where the segment says so;
    a plain piece holding ``reply``'s text placed with the reply's generated tokens,
    which are computed alone, as they were when generated (:attr:`Placed.lone`)."""
    out: list[int] = []
    lone: set[int] = set()
    for text, special in segment.pieces():
        if reply is not None and (out or not first) and not special and text == reply[0]:
            lone.update(range(len(out), len(out) + len(reply[1])))
            out += reply[1]
            if reply[2]:
                out += engine.tokenize(reply[2], add_special=False, parse_special=False)
            continue
        out += engine.tokenize(text, add_special=first and not out, parse_special=special)
    return Placed(segment, out, frozenset(lone))


LONG_TEXT = 1 << 16
"""Characters past which a piece of text is first counted in chunks against the planner
context, so a text far too large is refused after reading a little of it."""


def check_fits(engine: Engine, segments: Sequence[Segment], limit: int) -> None:
    """Refuse, cheaply, a context whose text holds more tokens than ``limit``: long
    pieces are tokenized a chunk at a time, stopping as soon as the count passes the
    limit (a 10 MB prompt is refused after tokenizing about the planner context's worth,
    not all of it). Short contexts cost nothing here: placing them counts exactly."""
    if sum(len(seg.text) for seg in segments) <= LONG_TEXT:
        return
    count = 0
    for seg in segments:
        for text, special in seg.pieces():
            for at in range(0, len(text), LONG_TEXT):
                piece = text[at : at + LONG_TEXT]
                # A cut may split a token in two: one extra per chunk at most.
                count += len(engine.tokenize(piece, add_special=False, parse_special=special)) - 1
                if count > limit:
                    raise ContextTooLargeError(
                        f"the context needs more than {limit} tokens (the session's planner "
                        f"context): segment {seg.name!r} alone holds {len(seg.text)} characters"
                    )


def context_tokens(engine: Engine, segments: Sequence[Segment]) -> list[int]:
    """The tokens of a whole context, as a session lays them out."""
    return [
        t
        for i, seg in enumerate(segments)
        for t in segment_tokens(engine, seg, first=i == 0).tokens
    ]


class Prepared:
    """A prefetch's hand-over to the ``ensure_context`` it prepares, carried by that call's
    command through the mailbox: its tokenizations once they are done, and ``cancel`` to
    stop it when the call begins before they are (it is of no more use then)."""

    __slots__ = ("cancel", "tokens")

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.tokens: dict[TokenKey, Placed] | None = None
        """Set by the prefetch when its tokenizations are done; ``None`` until then."""
        self.cancel = cancel
