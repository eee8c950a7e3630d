"""A llama.cpp window on a model with recurrent layers: a hybrid (attention and recurrent
layers, as Granite 4, LFM2, Falcon-H1, Nemotron-H) or a pure recurrent model (Mamba-2).

The recurrent state is one per sequence: it has integrated every token computed, in order,
and is never evicted. The window checkpoints it (:mod:`._checkpoints`) after the positions
the session names (block ends) and after each prefill; a block exported where its
checkpoint is held carries it in place of the current state, so it can end a restored
context in any session. Removing the window's tail puts the state back to the nearest
checkpoint before it and computes the resident tokens from there again; a block admitted
before resident tokens leaves the state as it was. A pure recurrent model keeps no
attention KV at all: only the window's tail can leave it, and a block comes back only as
its end. Everything else is the attention window's (:mod:`._context`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvrt import ColdBlockMismatchError, InvalidRangeError
from kvrt.backend import ColdBlock, Recompute
from kvrt.native_bridge.llama_context import MAIN_SEQ

from .._errors import translate_errors
from .._window import chunk_bounds
from ._checkpoints import RecurrentStates
from ._context import LlamaEngineContext

__all__ = ["HybridWindow"]


class HybridWindow(LlamaEngineContext):
    """A window whose model keeps a recurrent state beside (or instead of) its KV."""

    _run_end: int | None = None
    """The end of the run of blocks being admitted, while one is."""

    @functools.cached_property
    def _states(self) -> RecurrentStates:
        """The recurrent state after the positions that may end a context."""
        return RecurrentStates()

    @property
    def _state_only(self) -> bool:
        """A recurrent model (Mamba-2): no attention KV at all, its state is the whole
        window, so only the window's tail can leave it."""
        return self._facts.recurrent == "recurrent"

    @property
    def _keeps_states(self) -> bool:
        return True

    def _keep_state(self, position: int, asked: bool) -> None:
        with translate_errors("checkpointing the recurrent state"):
            self._states.keep(position, self._ctx.checkpoint_get(MAIN_SEQ), asked=asked)

    def _resumable(self, end: int) -> bool:
        return end in self._states or end == self.next_position

    def recomputed_by_evict(self, start: int, end: int) -> Recompute | None:
        _, _, i, j = self._resident_slice(start, end)
        if j != len(self._positions):
            return None  # a middle range: its attention cells go, nothing is computed
        _, k, cut = self._states.rewind_span(self._positions, i)
        if k == cut == i:
            return None  # a checkpoint right before the range: nothing to compute
        p = self._positions
        first = p[k] if k < cut else p[cut]
        return Recompute(first, p[cut - 1] + 1 if k < cut else first, p[cut])

    def relayout(self) -> None:
        if self._state_only:
            self._in_order = True  # a recurrent model's state has no cells to order
            return
        super().relayout()

    def _remove(self, i: int, j: int, start: int, end: int, shift_tail: bool) -> int:
        if j == len(self._positions):
            with translate_errors(f"evicting [{start}, {end})"):
                return self._rewind(i)
        if self._state_only:
            raise InvalidRangeError(
                f"[{start}, {end}) is not the end of the window: a recurrent model "
                f"({self._facts.architecture}) keeps no KV, only a state that has "
                "integrated every token, so only the window's tail can leave it"
            )
        self._states.forget(start, end)  # a rewind into a gap has nothing to compute from
        return super()._remove(i, j, start, end, shift_tail)

    def _rewind(self, i: int) -> int:
        """Remove the window's tail, record entries ``i:`` on (see
        :meth:`RecurrentStates.rewind_span` for where they start); the first entry
        removed. The recurrent state goes back to the nearest checkpoint at or before the
        last token kept (or to the start), the cells from there go, and the resident
        tokens between are computed again. If computing fails, the window is left empty
        (the record too) and the error raised.

        Tokens computed again attend over the cells before them in cache order, so those
        are laid out in position order first where they may not be (as before any
        computation on a whole context): what is computed again then equals what was, as
        long as no token before them left the window (the session labels it otherwise)."""
        at, k, i = self._states.rewind_span(self._positions, i)
        last = self._positions[i - 1] + 1 if i else 0
        redo = self._tokens[k:i]
        if redo and k:
            self.relayout()  # the record still matches the engine here
        if at is None:
            self._ctx.clear()
        else:
            state = self._states.get(at)
            assert state is not None
            self._ctx.checkpoint_set(MAIN_SEQ, state)
            self._ctx.seq_rm(MAIN_SEQ, at, 1 << 30)  # the tail: the cells left keep their order
        if not k:
            self._in_order = True  # no cell is left
        self._states.forget(last)
        if not redo:
            return i
        first = self._positions[k]
        try:
            for a, b in itertools.pairwise(chunk_bounds(len(redo), self.chunk_tokens)):
                self._ctx.decode(redo[a:b], first + a)
        except BaseException:
            self._drop_all()
            raise
        self._in_order = self._in_order and first == k
        self._counters.prefill_tokens += len(redo)
        self._states.put(last, self._ctx.checkpoint_get(MAIN_SEQ))
        self._logits_pos = last - 1
        return i

    def _drop_all(self) -> None:
        self._states.clear()
        super()._drop_all()

    def _read_range(self, start: int, end: int) -> npt.NDArray[np.uint8]:
        state = self._states.get(end)
        if state is not None and end != self.next_position:
            return self._ctx.range_with_checkpoint(start, end, state)
        return super()._read_range(start, end)

    def admit_run(self, blocks: Sequence[ColdBlock]) -> None:
        """As :meth:`KvWindow.admit_run`; a run ending the window must end with a
        resumable block (its recurrent state comes in with it)."""
        if not blocks:
            return
        last = blocks[-1].meta
        if bisect.bisect_left(self._positions, last.end) == len(self._positions):
            self._check_resumable(blocks[-1])
        self._run_end = last.end
        try:
            super().admit_run(blocks)
        except BaseException:
            # a block of the run may end the window without its recurrent state
            if self._positions and not self._resumable(self.next_position):
                self.evict(blocks[0].meta.start, self.next_position)
            raise
        finally:
            self._run_end = None

    def _check_resumable(self, block: ColdBlock) -> None:
        if not block.meta.resumable:
            raise ColdBlockMismatchError(
                f"the cold block [{block.meta.start}, {block.meta.end}) carries no "
                "checkpoint of the recurrent state after it: it can come back only before "
                "resident tokens, not as the end of the window"
            )

    def _put(self, block: ColdBlock, i: int, target: int, skip: int = 0) -> None:
        meta = block.meta
        tail = i == len(self._positions)
        if self._state_only and not tail:
            raise InvalidRangeError(
                f"a recurrent model ({self._facts.architecture}) keeps no KV: a block comes "
                f"back only at the end of the window, not before position {self._positions[i]}"
            )
        self._room(meta.n_tokens)
        if tail and (self._run_end is None or meta.end >= self._run_end):
            self._check_resumable(block)
        if self._state_only and not meta.resumable:
            # Within a run: its bytes are the state at some later point, not after it,
            # and the run's last block's state replaces whatever it holds.
            return
        with translate_errors("checkpointing the recurrent state"):
            before = self._ctx.checkpoint_get(MAIN_SEQ) if not tail and self._positions else None
        super()._put(block, i, target, skip)
        # Copying a range in brings its recurrent state along: the block's own after it
        # at the tail, the window's own back before resident tokens.
        with translate_errors(f"admitting [{meta.start}, {meta.end})"):
            if before is not None:
                self._ctx.checkpoint_set(MAIN_SEQ, before)
            elif tail and meta.resumable:
                self._states.keep(meta.end, self._ctx.checkpoint_get(MAIN_SEQ), asked=True)

    def _reset(self) -> None:
        super()._reset()
        self._states.clear()
