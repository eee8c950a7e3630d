"""One llama.cpp KV window: the shared record rules on llama.cpp's sequence API.

Sequence 0 is the hot window; sequence 1 is scratch for moving ranges in and out as
bytes (``llama_state_seq_get/set_data``), joined to sequence 0 with ``seq_cp`` in a
unified cache.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvrt import ColdBlockMismatchError, InvalidRangeError
from kvrt.backend import Capabilities, ColdBlock, Logits, ModelFacts
from kvrt.native_bridge.llama import MAIN_SEQ, SCRATCH_SEQ, LlamaContext, LlamaModel

from .._errors import translate_errors
from .._window import KvWindow

__all__ = ["LlamaEngineContext"]


class LlamaEngineContext(KvWindow):
    """A hot window on a shared :class:`~native_bridge.llama.LlamaModel`."""

    def __init__(self, ctx: LlamaContext, facts: ModelFacts, budget: int) -> None:
        super().__init__(facts, budget)
        self._ctx = ctx
        self._model: LlamaModel = ctx.model

    @classmethod
    def create(
        cls, model: LlamaModel, facts: ModelFacts, *, n_ctx: int, n_batch: int, n_threads: int
    ) -> LlamaEngineContext:
        if not isinstance(n_ctx, int) or n_ctx < 1:
            raise InvalidRangeError(f"a hot window needs at least 1 token of room, got {n_ctx!r}")
        if n_ctx > facts.trained_context:
            raise InvalidRangeError(
                f"a hot window of {n_ctx} tokens exceeds the model's trained context "
                f"of {facts.trained_context}"
            )
        with translate_errors(f"creating a {n_ctx}-token context"):
            ctx = LlamaContext(
                model,
                n_ctx=n_ctx,
                n_batch=min(n_batch, n_ctx),
                n_threads=n_threads,
                kv_type=facts.kv_type,
            )
        return cls(ctx, facts, n_ctx)

    @property
    def can_shift(self) -> bool:
        return self._ctx.can_shift

    @property
    def chunk_tokens(self) -> int:
        return self._ctx.n_batch

    @property
    def capabilities(self) -> Capabilities:
        notes = ["tail admission re-rotates keys: argmax-equal, not bit-exact"]
        if self._facts.sliding_window_live:
            notes.append(
                "in-place restore of ranges outside the sliding window is not yet verified"
            )
        return Capabilities(
            remove_middle=True,
            position_shift=self._ctx.can_shift,
            exact_in_place=True,
            exact_tail=False,
            sliding_window=self._facts.sliding_window_live,
            kv_type=self._facts.kv_type,
            notes=tuple(notes),
        )

    def _is_end(self, token: int) -> bool:
        with translate_errors("reading the vocabulary"):
            return self._model.is_end_of_generation(token)

    def _compute(self, chunk: list[int], start: int) -> None:
        with translate_errors("decoding"):
            self._ctx.decode(chunk, start)

    def _after_failure(self) -> None:
        # A failed decode leaves none of its batch behind; keep the record matching.
        if self._ctx.closed:
            return
        last = self._ctx.pos_max(MAIN_SEQ)
        while self._positions and self._positions[-1] > last:
            self._positions.pop()
            self._tokens.pop()

    def _read_logits(self) -> Logits:
        with translate_errors("reading logits"):
            return self._ctx.logits()

    def _remove(self, i: int, j: int, start: int, end: int, shift_tail: bool) -> None:
        with translate_errors(f"evicting [{start}, {end})"):
            last = self._positions[-1]
            self._ctx.seq_rm(MAIN_SEQ, start, end)
            if shift_tail:
                self._ctx.seq_add(MAIN_SEQ, end, last + 1, start - end)

    def _take(self, i: int, j: int, start: int, end: int) -> npt.NDArray[np.uint8]:
        # llama.cpp writes straight into the returned buffer: one copy, no more.
        with translate_errors(f"exporting [{start}, {end})"):
            self._ctx.seq_clear(SCRATCH_SEQ)
            self._ctx.seq_cp(MAIN_SEQ, SCRATCH_SEQ, start, end)
            try:
                return self._ctx.state_get(SCRATCH_SEQ)
            finally:
                self._ctx.seq_clear(SCRATCH_SEQ)

    def _put(self, block: ColdBlock, i: int, target: int) -> None:
        meta = block.meta
        with translate_errors(f"admitting [{meta.start}, {meta.end})"):
            self._ctx.state_set(SCRATCH_SEQ, np.ascontiguousarray(block.data))
            try:
                got = (self._ctx.pos_min(SCRATCH_SEQ), self._ctx.pos_max(SCRATCH_SEQ) + 1)
                if got != (meta.start, meta.end):
                    raise ColdBlockMismatchError(
                        f"cold block bytes hold positions [{got[0]}, {got[1]}), "
                        f"its metadata says [{meta.start}, {meta.end})"
                    )
                if target != meta.start:
                    self._ctx.seq_add(SCRATCH_SEQ, meta.start, meta.end, target - meta.start)
                self._ctx.seq_cp(SCRATCH_SEQ, MAIN_SEQ, target, target + meta.n_tokens)
            finally:
                self._ctx.seq_clear(SCRATCH_SEQ)

    def _reset(self) -> None:
        with translate_errors("clearing the context"):
            self._ctx.clear()

    @property
    def closed(self) -> bool:
        return self._ctx.closed

    def close(self) -> None:
        if not self._ctx.closed:
            with translate_errors("closing the context"):
                self._ctx.close()
