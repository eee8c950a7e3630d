"""A hybrid window's recurrent state, kept after the positions that may end a context.

On a model with recurrent layers the recurrent state is one per sequence: it has
integrated every token computed, in order, and is never evicted. The window keeps it
(``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) after the positions a prefill is asked to keep
(block ends) and after each prefill, which only the latest keeps. Removing the window's tail
goes back to the nearest of them before it (:meth:`RecurrentStates.rewind_span` says where);
what the window then computes again is its own (:mod:`._context`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["RecurrentStates"]

State = npt.NDArray[np.uint8]


class RecurrentStates:
    """Position -> the recurrent state after every token before it."""

    def __init__(self) -> None:
        self._states: dict[int, State] = {}
        self._asked: set[int] = set()
        """Of the states, the positions a prefill was asked to keep (block ends); the
        others (ends of prefills) are kept only while the latest."""

    def __contains__(self, position: int) -> bool:
        return position in self._states

    def get(self, position: int) -> State | None:
        return self._states.get(position)

    def keep(self, position: int, state: State, *, asked: bool) -> None:
        """``state`` after ``position``; where not ``asked``, the end of a prefill, which
        replaces the previous prefill's end unless a block ends there."""
        if not asked:
            for p in [p for p in self._states if p not in self._asked and p != position]:
                del self._states[p]
        self._states[position] = state
        if asked:
            self._asked.add(position)

    def put(self, position: int, state: State) -> None:
        """``state`` after ``position``, kept as a prefill's end is (not asked for)."""
        self._states[position] = state

    def forget(self, after: int, before: int | None = None) -> None:
        """Drop the states after ``after`` (and before ``before``, where given)."""
        for p in [p for p in self._states if p > after and (before is None or p < before)]:
            del self._states[p]
            self._asked.discard(p)

    def clear(self) -> None:
        self._states.clear()
        self._asked.clear()

    def rewind_span(self, positions: Sequence[int], i: int) -> tuple[int | None, int, int]:
        """Removing record entries ``i:`` (the window's tail) of a window holding
        ``positions``: the checkpoint the state goes back to (None: none, the start), the
        first entry ``k`` computed again from it, and the first entry removed: ``i``, or an
        earlier one where entries ``k:i`` do not follow the checkpoint without a gap.
        Tokens after a gap cannot be computed again (the recurrent state would skip the
        gap's tokens), so they go too, and the checkpoint is chosen again for what is
        left."""
        p = positions
        while True:
            last = p[i - 1] + 1 if i else 0
            at = max((q for q in self._states if q <= last), default=None)
            k = 0 if at is None else bisect.bisect_left(p, at)
            first = 0 if at is None else at
            cut = next((n for n in range(k, i) if p[n] != first + n - k), i)
            if cut == i:
                return at, k, i
            i = cut
