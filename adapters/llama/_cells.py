"""A llama.cpp window's cells as bytes: read out and loaded back through the scratch
sequence, put in position order, cut in block-long pieces, their keys turned.

A window moves its cells this way to lay them out again as a fresh context's, to grow into
a larger context, to slide its tail with keys turned in kvrt's code and to come home from
the engine's streams, and to splice a cold block in; what each of those does with them is
the window's (:mod:`._context`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvrt import ColdBlockMismatchError
from kvrt.backend import ModelFacts
from kvrt.native_bridge.llama import KV_TYPES
from kvrt.native_bridge.llama_context import MAIN_SEQ, SCRATCH_SEQ, STATE_HEAD, LlamaContext
from kvrt.native_bridge.llama_keys import key_rotation, order_cells, shift_cells
from kvrt.native_bridge.rope import Rope

__all__ = ["Cells"]


class Cells:
    """One window's cell bytes, on whichever context holds it (each call names it)."""

    def __init__(self, facts: ModelFacts, ropes: Sequence[Rope]) -> None:
        self._facts = facts
        self.ropes = tuple(ropes)
        """How the window's context rotates keys: one per KV cache (global, then windowed)."""
        k_type = KV_TYPES[facts.kv_type][0]
        self._k_rotations = tuple(key_rotation(k_type, {facts.head_dim}) for _ in self.ropes)
        self._recurrent = bool(facts.checkpoint_bytes)

    def read(self, ctx: LlamaContext, start: int, end: int) -> npt.NDArray[np.uint8]:
        """The state bytes of positions [start, end) of the window in ``ctx``, through the
        scratch sequence; llama.cpp writes them straight into the returned buffer."""
        ctx.seq_clear(SCRATCH_SEQ)
        ctx.seq_cp(MAIN_SEQ, SCRATCH_SEQ, start, end)
        try:
            return ctx.state_get(SCRATCH_SEQ)
        finally:
            ctx.seq_clear(SCRATCH_SEQ)

    def load(self, ctx: LlamaContext, data: npt.NDArray[np.uint8], first: int, stop: int) -> None:
        """Load state bytes into the window in ``ctx`` through the scratch sequence."""
        ctx.state_set(SCRATCH_SEQ, np.ascontiguousarray(data))
        try:
            ctx.seq_cp(SCRATCH_SEQ, MAIN_SEQ, first, stop)
        finally:
            ctx.seq_clear(SCRATCH_SEQ)

    def ordered(self, data: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
        """State bytes with their cells in position order; a hybrid's recurrent section,
        which ends them, kept as it is."""
        if not self._recurrent:
            return order_cells(data)
        cut = data.size - (self._facts.checkpoint_bytes - STATE_HEAD)
        return np.concatenate([order_cells(data[:cut]), data[cut:]])

    def turned(self, data: npt.NDArray[np.uint8], delta: int) -> npt.NDArray[np.uint8]:
        """State bytes with their keys turned ``delta`` positions."""
        return shift_cells(
            data, delta, self.ropes, head_dim=self._facts.head_dim, k_rotations=self._k_rotations
        )

    def spans(self, positions: Sequence[int], first: int, stop: int) -> list[tuple[int, int]]:
        """[first, stop) in pieces of at most a block on a windowed model, each holding
        some of the resident ``positions`` (sorted)."""
        step = self._facts.max_block_tokens or stop - first
        spans = [(s, min(s + step, stop)) for s in range(first, stop, step)]
        return [
            (s, e)
            for s, e in spans
            if bisect.bisect_left(positions, s) < bisect.bisect_left(positions, e)
        ]

    def in_order(self, ctx: LlamaContext, positions: Sequence[int]) -> list[npt.NDArray[np.uint8]]:
        """The whole window in ``ctx`` read out in block-long pieces, each in position
        order (so a windowed layer's KV is kept for every position, as in a block)."""
        if not positions:
            return []
        first, last = positions[0], positions[-1] + 1
        return [self.ordered(self.read(ctx, s, e)) for s, e in self.spans(positions, first, last)]

    def slide(
        self, ctx: LlamaContext, positions: Sequence[int], start: int, end: int, stop: int
    ) -> None:
        """Remove [start, end) of the window in ``ctx`` and move [end, stop) down to
        ``start``, the keys turned here: the tail goes out in block-long pieces (windowed
        layers keep every position) and comes back turned. If loading it back fails, the
        window's cells are partly gone: the caller empties it."""
        delta = start - end
        pieces = [
            self.turned(self.read(ctx, s, e), delta) for s, e in self.spans(positions, end, stop)
        ]
        ctx.seq_rm(MAIN_SEQ, start, stop)
        for piece in pieces:
            self.load(ctx, piece, start, stop + delta)

    def splice(
        self,
        ctx: LlamaContext,
        data: npt.NDArray[np.uint8],
        start: int,
        n: int,
        target: int,
        skip: int = 0,
        *,
        turn: bool,
    ) -> None:
        """A block's bytes (positions [start, start + n)) into the window in ``ctx`` at
        ``target`` on, but its first ``skip``: through the scratch sequence, the keys of a
        moved block turned here (``turn``) or by llama.cpp's shift. A
        :class:`ColdBlockMismatchError` where the bytes hold other positions than their
        metadata says (nothing of them is then in the window)."""
        moved = target != start
        if moved and turn:
            data = self.turned(data, target - start)
        first = target if moved and turn else start
        ctx.state_set(SCRATCH_SEQ, np.ascontiguousarray(data))
        try:
            got = (ctx.pos_min(SCRATCH_SEQ), ctx.pos_max(SCRATCH_SEQ) + 1)
            if self._recurrent:  # the recurrent part's single cell sits at the end
                got = (first, got[1]) if got[0] >= first else got
            if got != (first, first + n):
                raise ColdBlockMismatchError(
                    f"cold block bytes hold positions [{got[0]}, {got[1]}), "
                    f"its metadata says [{start}, {start + n})"
                )
            if moved and not turn:
                ctx.seq_add(SCRATCH_SEQ, start, start + n, target - start)
            ctx.seq_cp(SCRATCH_SEQ, MAIN_SEQ, target + skip, target + n)
        finally:
            ctx.seq_clear(SCRATCH_SEQ)
