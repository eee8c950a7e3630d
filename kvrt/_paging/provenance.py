"""What each resident token's KV attended to, where that is not what computing the whole
context from its first token gives.

A token's KV depends on everything it attended to. It is *exact* when every earlier token
of the context was hot, with exact KV, when it was computed (or it is a restore of such a
token's bytes). Otherwise it is one of:

- *approximate* (:data:`APPROXIMATE`): restored from a copy computed after another prefix,
  or computed while such a token was hot before it. Never stored, but in a long context
  (:mod:`.long`), where the session stores it under a key of its own (its prefix, which
  begins with ``LONG_PREFIX``, is then the mark of a copy restored in place).
- *partial-window*: computed while some earlier token of the context was out of the hot
  window (or itself partial-window). It is what that window gives, not what the key of an
  exact block promises, so it is stored only under a key of its own that no other session
  asks for (:func:`partial_key`), in RAM, and recomputed by policy once its whole prefix
  fits hot again.

Whatever its mark, a position's KV is also tied to *where in which context* it was
computed: the start and prefix digest of the block that held it then (``attend``). A
block of a later layout reuses resident KV only where that record is its own start and
prefix, and its tokens match: the same tokens after other tokens — an earlier segment
replaced by one of the same length, restored in place — attended to something else, and
:meth:`Provenance.screen` hides them from the bookkeeping (:data:`FOREIGN`), so they are
computed again. The same goes for *how* a position was computed (``lineage``): alone, as
a generated token is, or in a batch. A block that expects a generated reply's tokens
computed alone does not reuse the same tokens prefilled, nor the reverse: their bits
differ, and so would everything computed after them.

Positions with exact KV carry no mark. A mark is set *before* the engine call that makes
its position resident (compute or restore), never after, so a call cancelled once the
engine had finished can only leave a mark that under-promises. Marks of positions no
longer resident are stale and never read: every query looks at resident positions only,
and every way back into the window sets the mark again.

Everything here is synchronous and free of ``await``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Container, Iterable, Mapping

from .._cold import LONG_PREFIX, PARTIAL_PREFIX, ColdKey

__all__ = ["APPROXIMATE", "FOREIGN", "Provenance", "is_approximate", "partial_key"]

APPROXIMATE = "~"
"""The mark of approximate KV."""


def is_approximate(label: str) -> bool:
    """Whether a mark is approximate KV: :data:`APPROXIMATE`, or a long-context copy's."""
    return label == APPROXIMATE or label.startswith(LONG_PREFIX)


FOREIGN = -1
"""What a resident position shows in place of its token when its KV was computed in
another place of the context than the block now there (never equal to a token)."""

Place = tuple[int, str]
"""Where KV was computed: its block's start and prefix digest."""


def partial_key(exact: ColdKey, labels: frozenset[str]) -> ColdKey:
    """The key a block with partial-window KV is stored under: its exact key with the
    prefix replaced by a digest of the computations its tokens came from (``labels``).

    A block restored from such a copy carries that copy's prefix as its one label, so
    storing it again finds the same key instead of a second copy.
    """
    if len(labels) == 1:
        (only,) = labels
        if only.startswith((PARTIAL_PREFIX, LONG_PREFIX)):
            return ColdKey(exact.fingerprint, only, exact.tokens, exact.start)
    h = hashlib.blake2b(exact.prefix.encode(), digest_size=16)
    for label in sorted(labels):
        h.update(b"\0" + label.encode())
    return ColdKey(exact.fingerprint, PARTIAL_PREFIX + h.hexdigest(), exact.tokens, exact.start)


class Provenance:
    """One session's marks: resident position -> how its KV is not exact."""

    def __init__(self) -> None:
        self._marks: dict[int, str] = {}
        self._places: dict[int, Place] = {}
        self._lone: set[int] = set()
        """Resident positions whose KV was computed alone (the rest: in a batch)."""
        self._salt = os.urandom(8).hex()
        self._serial = 0

    def new_label(self) -> str:
        """A label for one partial-window computation, unique to it."""
        self._serial += 1
        return f"c{self._salt}.{self._serial}"

    def set(self, start: int, end: int, label: str | None) -> None:
        """Positions ``[start, end)`` are about to hold KV of ``label`` (None: exact)."""
        if label is None:
            for p in range(start, end):
                self._marks.pop(p, None)
        else:
            self._marks.update(dict.fromkeys(range(start, end), label))

    def attend(self, start: int, end: int, places: Iterable[tuple[int, int, Place]]) -> None:
        """Positions ``[start, end)`` are about to hold KV computed as part of the blocks
        ``places`` gives (``(block start, block end, (start, prefix))``); positions no
        block covers get no place (their KV is reused by no block)."""
        for p in range(start, end):
            self._places.pop(p, None)
        for b_start, b_end, place in places:
            lo, hi = max(start, b_start), min(end, b_end)
            if lo < hi:
                self._places.update(dict.fromkeys(range(lo, hi), place))

    def lineage(self, start: int, end: int, lone: Iterable[int]) -> None:
        """Positions ``[start, end)`` are about to hold KV computed alone at ``lone``, in a
        batch elsewhere."""
        self._lone.difference_update(range(start, end))
        self._lone.update(p for p in lone if start <= p < end)

    def screen(
        self, resident: dict[int, int], blocks: Iterable[tuple[int, int, Place, Container[int]]]
    ) -> dict[int, int]:
        """``resident`` (position -> token) with :data:`FOREIGN` in place of the token of
        every position in ``blocks`` whose KV was computed in another place, or computed
        alone where the block expects a batch or the reverse (``blocks``: start, end, place
        and the positions the block expects computed alone), in place."""
        places, computed_alone = self._places, self._lone
        for b_start, b_end, place, lone in blocks:
            for p in range(b_start, b_end):
                if p in resident and (
                    places.get(p) != place or (p in computed_alone) != (p in lone)
                ):
                    resident[p] = FOREIGN
        return resident

    def labels(self, start: int, end: int, resident: Mapping[int, int]) -> frozenset[str]:
        """The marks of the resident positions in ``[start, end)``."""
        marks = self._marks
        if not marks:
            return frozenset()
        return frozenset(marks[p] for p in range(start, end) if p in marks and p in resident)

    def approximate(self, start: int, end: int, resident: Mapping[int, int]) -> bool:
        """Whether any resident position in ``[start, end)`` holds approximate KV."""
        return any(is_approximate(label) for label in self.labels(start, end, resident))

    def partial(self, start: int, end: int, resident: Mapping[int, int]) -> bool:
        """Whether any resident position in ``[start, end)`` holds partial-window KV."""
        return not all(is_approximate(label) for label in self.labels(start, end, resident))

    def inexact(self, start: int, end: int, resident: Mapping[int, int]) -> bool:
        """Whether any resident position in ``[start, end)`` holds KV that is not exact."""
        return bool(self.labels(start, end, resident))
