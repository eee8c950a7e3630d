"""What a context is made of: the segments an agent sends (:class:`Segment`), each
one's tokens as a session places them (:class:`Placed`), and a long context's blocks at
their logical positions (:class:`LongBlock`). Checked when built; no ``await``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from .._checks import check_bool, check_choice, check_int, check_number, check_text
from .._cold import ColdKey
from .._errors import ArgumentTypeError
from .._types import CacheClass

__all__ = ["LongBlock", "Placed", "Segment"]


class Segment(msgspec.Struct, frozen=True):
    """A named piece of context the agent sends.

    >>> Segment("system", "You are a careful reviewer.", cache_class=CacheClass.TASK_PINNED)
    Segment(name='system', text='You are a careful reviewer.', cache_class=...)

    Text is read as plain text: markup such as ``<|im_start|>`` in it stays characters and
    never becomes a control token, so content from users, tools and files cannot forge
    chat structure. :meth:`kvrt.Runtime.chat_segment` marks the chat template's own markup
    in ``markup``; ``parse_special=True`` reads the whole text as markup (only for text you
    wrote yourself). Fields are checked when the segment is built.
    """

    name: str
    """Unique within a context: how the session matches this segment across calls."""
    text: str
    """The segment's text, read as plain text unless ``markup``/``parse_special`` say otherwise."""
    cache_class: CacheClass = CacheClass.VOLATILE
    """How readily its blocks leave the hot window (``volatile`` first)."""
    parse_special: bool = False
    """Read every special-token string in ``text`` (such as ``<|im_start|>``) as the
    special token. Never set it for text that comes from users, tools or files."""
    score: float | None = None
    """Importance for the ``score_lru`` hot-eviction policy (higher stays longer), e.g. the
    attention mass the caller measured on it; ``None`` ranks lowest within its class."""
    markup: tuple[tuple[int, int], ...] = ()
    """Character ranges ``[start, end)`` of ``text`` that are chat-template markup, read
    with special tokens; everything else is plain text. Sorted, not overlapping."""

    def __post_init__(self) -> None:
        check_text("Segment.name", self.name, empty=False)
        check_text(f"the text of segment {self.name!r}", self.text)
        if not isinstance(self.cache_class, CacheClass):
            chosen = check_choice("Segment.cache_class", self.cache_class, CacheClass)
            msgspec.structs.force_setattr(self, "cache_class", chosen)
        check_bool("Segment.parse_special", self.parse_special)
        if self.score is not None:
            check_number("Segment.score", self.score)
        if self.markup or not isinstance(self.markup, tuple):
            msgspec.structs.force_setattr(self, "markup", _markup(self.markup, len(self.text)))

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """The text in order, each piece with whether it is read with special tokens."""
        if not self.markup or self.parse_special:
            yield self.text, self.parse_special
            return
        at = 0
        for start, end in self.markup:
            if start > at:
                yield self.text[at:start], False
            yield self.text[start:end], True
            at = end
        if at < len(self.text):
            yield self.text[at:], False


def _markup(spans: object, length: int) -> tuple[tuple[int, int], ...]:
    expected = "a sequence of (start, end) character ranges"
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise ArgumentTypeError(f"Segment.markup must be {expected}, got {type(spans).__name__}")
    out: list[tuple[int, int]] = []
    at = 0
    for span in spans:
        if isinstance(span, (str, bytes)) or not isinstance(span, Sequence) or len(span) != 2:
            raise ArgumentTypeError(f"Segment.markup must be {expected}, got item {span!r}")
        start = check_int("a Segment.markup start", span[0], low=at)
        end = check_int("a Segment.markup end", span[1], low=start + 1, high=length)
        out.append((start, end))
        at = end
    return tuple(out)


class Placed(NamedTuple):
    """A segment as a session places it: its tokens, and which of them are computed alone
    (the tokens of a reply the runtime generated, placed as they were generated)."""

    segment: Segment
    tokens: list[int]
    lone: frozenset[int] = frozenset()
    """Offsets into ``tokens``."""


@dataclass(slots=True, eq=False)
class LongBlock:
    """One block of a long context, at its logical position."""

    segment: Segment
    name: str
    """Its name in the windows shown to the engine: the segment's, with ``#k`` added for
    its k-th block where the segment spans several."""
    start: int
    tokens: list[int]
    lone: frozenset[int]
    """Offsets of the tokens computed alone (a generated reply's)."""
    key: ColdKey
    """Its identity at its logical position (as an exact block's key)."""

    def placed(self) -> Placed:
        seg = Segment(self.name, "", cache_class=self.segment.cache_class, score=self.segment.score)
        return Placed(seg, self.tokens, self.lone)
