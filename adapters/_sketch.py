"""Key sketches: a few representative key vectors per block, for relevance scoring.

A block's sketch is, per layer and KV head, the mean of its (un-rotated) keys followed by
the keys that stand furthest from that mean: the tokens that make the block what it is
(a name, a number, a term) rather than what it shares with its neighbours, kept as int8
with a scale per vector (:class:`kvrt.backend.KeySketch`; SmolLM2: 30 layers x 3 heads x 9
vectors x 64 = 52 KB a block, held while the block is in a session's context). A query's
sketch is all its keys, ``float32``. Both are shaped ``[layer, head, vector, head_dim]``;
the ``relevance`` policy compares them.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from kvrt.backend import KeySketch

__all__ = ["QUERY_TOKENS", "REPRESENTATIVES", "block_sketch"]

REPRESENTATIVES: Final = 8
"""Distinctive keys kept per layer and head, besides the mean."""
QUERY_TOKENS: Final = 64
"""A query's keys come from its last this many tokens."""


def block_sketch(
    keys: npt.NDArray[np.float32], representatives: int = REPRESENTATIVES
) -> KeySketch:
    """``keys[layer, head, token, head_dim]`` -> ``[layer, head, 1 + r, head_dim]``: the
    mean key, then the ``r`` keys furthest from it (repeated when the block is shorter)."""
    mean = keys.mean(axis=2, keepdims=True)
    r = min(representatives, keys.shape[2])
    distance = np.square(keys - mean).sum(axis=-1)  # [layer, head, token]
    far = np.argsort(-distance, axis=-1, kind="stable")[..., :r]  # furthest first
    picked = np.take_along_axis(keys, far[..., None], axis=2)
    if r < representatives:  # a short block repeats its keys: every sketch has one shape
        picked = picked[:, :, np.arange(representatives) % r]
    return KeySketch.quantize(np.concatenate([mean, picked], axis=2))
