"""RoPE as llama.cpp's ggml applies it, in numpy: the angle each pair of a key head turns
per position, and keys turned by a number of positions.

ggml's rope (``rope_yarn`` in ggml-cpu) turns pair ``i`` of a head at position ``p`` by
``p * w[i]`` with::

    w[i] = base ** (-2i / n_rot) / ff[i] * (freq_scale * (1 - r[i]) + r[i])

where ``ff`` are the model's frequency factors (Llama 3's ``rope_freqs``, Phi-3's LongRoPE
short or long table; 1 without) and ``r`` YaRN's ramp between interpolated and extrapolated
frequencies (``ext_factor`` times a ramp over the correction dimensions; 0 without YaRN).
It also multiplies cos and sin by a magnitude (YaRN's ``mscale``, LongRoPE's attention
factor). The angle is linear in ``p``, so turning a key computed at ``p`` by ``d * w``
gives the key computed at ``p + d``; the turns here apply no magnitude, so a key keeps the
scale it was computed with. (llama.cpp's own key shift applies the magnitude again at
every shift.)

A pair is ``(x[2i], x[2i+1])`` for ``ROPE_NORM`` models and ``(x[i], x[i + n_rot/2])``
for ``ROPE_NEOX`` ones; dimensions past ``n_rot`` are not turned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._errors import BridgeArgumentError

__all__ = ["ROPE_NEOX", "ROPE_NONE", "ROPE_NORM", "Rope", "hadamard", "turn"]

ROPE_NONE = -1
"""llama.cpp's rope type for attention without positions (Nemotron-H) or no attention."""
ROPE_NORM = 0
"""llama.cpp's rope type for adjacent pairs (LLaMA-style GGUFs)."""
ROPE_NEOX = 2
"""llama.cpp's rope type for split halves (Qwen, Phi-3, Gemma ...)."""


@dataclass(frozen=True, slots=True)
class Rope:
    """How one kind of layer rotates its keys (llama.cpp's ``ggml_rope_ext`` arguments)."""

    n_rot: int
    """Dimensions of a head that are rotated (even)."""
    rope_type: int
    """:data:`ROPE_NORM` or :data:`ROPE_NEOX`."""
    base: float
    """The base frequency."""
    freq_scale: float = 1.0
    """Linear or YaRN scaling: 1 / factor."""
    ext_factor: float = 0.0
    """YaRN's extrapolation mix (1 with YaRN, 0 without)."""
    n_ctx_orig: int = 0
    """YaRN's original context, for its correction dimensions."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    factors: tuple[float, ...] | None = None
    """Per-pair frequency divisors (``n_rot / 2`` of them), or None."""

    def __post_init__(self) -> None:
        if self.rope_type not in (ROPE_NORM, ROPE_NEOX):
            raise BridgeArgumentError(f"rope type {self.rope_type} is not turned here")
        if self.n_rot <= 0 or self.n_rot % 2:
            raise BridgeArgumentError(f"rope over {self.n_rot} dimensions is not a pair count")
        if not self.base > 0 or not self.freq_scale > 0:
            raise BridgeArgumentError("rope base and scale must be positive")
        if self.factors is not None and len(self.factors) != self.n_rot // 2:
            raise BridgeArgumentError(
                f"{len(self.factors)} frequency factors for {self.n_rot // 2} pairs"
            )
        if self.ext_factor and self.n_ctx_orig <= 0:
            raise BridgeArgumentError("YaRN needs its original context length")

    def frequencies(self) -> npt.NDArray[np.float64]:
        """``w``: the angle each pair turns per position."""
        half = self.n_rot // 2
        i = np.arange(half, dtype=np.float64)
        w = self.base ** (-2.0 * i / self.n_rot)
        if self.factors is not None:
            w = w / np.asarray(self.factors, dtype=np.float64)
        if not self.ext_factor:
            return w * self.freq_scale
        low, high = self._correction_dims()
        y = (i - low) / max(0.001, high - low)
        ramp = (1.0 - np.clip(y, 0.0, 1.0)) * self.ext_factor
        return w * (self.freq_scale * (1.0 - ramp) + ramp)

    def _correction_dims(self) -> tuple[float, float]:
        # ggml_rope_yarn_corr_dims, in float64
        def dim(rotations: float) -> float:
            return (
                self.n_rot
                * math.log(self.n_ctx_orig / (rotations * 2 * math.pi))
                / (2 * math.log(self.base))
            )

        start = math.floor(dim(self.beta_fast))
        end = math.ceil(dim(self.beta_slow))
        return max(0.0, start), min(self.n_rot - 1.0, end)


def turn(
    keys: npt.NDArray[np.float32], positions: npt.NDArray[np.integer], rope: Rope
) -> npt.NDArray[np.float32]:
    """Keys ``[token, head, head_dim]`` each turned by its entry of ``positions`` (a count
    of positions, negative to turn back), as a new float32 array."""
    if keys.ndim != 3 or positions.shape != (keys.shape[0],):
        raise BridgeArgumentError("keys must be [token, head, head_dim] with one position each")
    if rope.n_rot > keys.shape[2]:
        raise BridgeArgumentError(f"rope over {rope.n_rot} of {keys.shape[2]} dimensions")
    angle = positions.astype(np.float64)[:, None] * rope.frequencies()[None, :]
    cos = np.cos(angle)[:, None, :]
    sin = np.sin(angle)[:, None, :]
    out = keys.astype(np.float64)
    half = rope.n_rot // 2
    if rope.rope_type == ROPE_NEOX:
        x0, x1 = out[..., :half].copy(), out[..., half : rope.n_rot].copy()
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half : rope.n_rot] = x0 * sin + x1 * cos
    else:
        x0, x1 = out[..., 0 : rope.n_rot : 2].copy(), out[..., 1 : rope.n_rot : 2].copy()
        out[..., 0 : rope.n_rot : 2] = x0 * cos - x1 * sin
        out[..., 1 : rope.n_rot : 2] = x0 * sin + x1 * cos
    return out.astype(np.float32)


def hadamard(n: int) -> npt.NDArray[np.float32]:
    """The normalized Sylvester-Hadamard matrix of size ``n`` (a power of two), as
    llama.cpp builds it to rotate quantized keys (``ggml_gen_hadamard``): its own inverse."""
    if n < 1 or n & (n - 1):
        raise BridgeArgumentError(f"a Hadamard matrix needs a power-of-two size, got {n}")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)
