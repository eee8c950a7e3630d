"""How many cells a llama.cpp window's context has: where it starts smaller than its window
and grows as the window fills, and which closed window's context (the engine's spare) a
new window may start in.

Sizes stay multiples of :data:`PAD` cells, llama.cpp's padding of the cells attention
reads: a grown context computes what a full-size one does, bit for bit. Contexts whose
keys or state depend on the size, or that keep a recurrent state or a sliding window, are
built full size.
"""

from __future__ import annotations

from kvrt.backend import ModelFacts
from kvrt.native_bridge.llama_context import LlamaContext

from ._rope import ModelRope

__all__ = ["FIRST_CELLS", "PAD", "first_size", "fits_spare", "padded"]

FIRST_CELLS = 1024
"""Cells a context starts with where its window is larger and it may grow."""

PAD = 256
"""llama.cpp pads the cells attention reads to this: sizes that are multiples of it read
the same cells at any size."""


def padded(n: int) -> int:
    return -(-n // PAD) * PAD


def first_size(facts: ModelFacts, rope: ModelRope, budget: int, n_batch: int) -> int:
    """The cells a window of ``budget`` tokens starts with: fewer where it may grow (no
    recurrent state, no sliding window, keys turned the same at every size), else all."""
    first = padded(max(FIRST_CELLS, n_batch))
    if (
        first >= budget
        or facts.checkpoint_bytes
        or facts.sliding_window_live
        or facts.recurrent
        or rope.identity(first) != rope.identity(budget)  # the LongRoPE table in use
    ):
        return budget
    return first


def fits_spare(spare: LlamaContext, first: int, budget: int, n_batch: int, n_threads: int) -> bool:
    """Whether a window of ``budget`` tokens that would start with ``first`` cells may
    start in ``spare`` instead: set up alike, and as large as that or larger, within the
    budget and on llama.cpp's padding (what a grown context holds), or exactly the budget
    where the window may not grow."""
    size = spare.n_ctx
    if spare.n_batch != n_batch or spare.n_threads != n_threads:
        return False
    if first >= budget:
        return size == first
    return first <= size <= budget and (size % PAD == 0 or size == budget)
