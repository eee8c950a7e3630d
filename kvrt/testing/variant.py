"""What a zoo model is: one architecture as llama.cpp loads it, at a toy size (every
variant is :data:`WIDTH` wide, with grouped-query attention)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["FFN", "HEADS", "KV_HEADS", "WIDTH", "Array", "Tensors", "Variant"]

Array = npt.NDArray[Any]
Tensors = dict[str, Array]

WIDTH = 128
"""Hidden size of every variant."""
FFN = 256
HEADS = 2
KV_HEADS = 1
"""Two query heads share one key/value head (grouped-query attention); head size 64,
which llama.cpp's quantized KV caches accept (a multiple of 32; its Hadamard rotation of
quantized keys needs 64)."""


@dataclass(frozen=True)
class Variant:
    """One architecture at a toy size: how llama.cpp knows it, and what it is."""

    name: str
    """The zoo's name (``qwen2-yarn``)."""
    architecture: str
    """``general.architecture`` as llama.cpp reads it."""
    about: str
    """What it stands for, in words."""
    layers: int = 2
    context: int = 4096
    """The trained context (``context_length``)."""
    heads: int = HEADS
    kv_heads: int | tuple[int, ...] = KV_HEADS
    """Key/value heads, or one count per layer (0: a recurrent layer)."""
    rope_base: float = 10000.0
    metadata: dict[str, Any] = field(default_factory=dict)
    """Architecture keys beyond the common ones, without the ``<arch>.`` prefix."""
    extra: Callable[[Variant, np.random.Generator], Tensors] | None = None
    """Tensors beyond the layers' (RoPE factor tables)."""
    layer: str = "attention"
    """How the layers are built: ``attention``, or a hybrid's builder."""
    recurrent: bool = False
    """Whether llama.cpp runs it with recurrent state (pure or hybrid)."""
    ffn: int | tuple[int, ...] = FFN
    """Feed-forward size, or one a layer (Nemotron-H: 0 in mixer layers)."""

    @property
    def head_dim(self) -> int:
        return WIDTH // self.heads

    def kv_heads_of(self, layer: int) -> int:
        return self.kv_heads[layer] if isinstance(self.kv_heads, tuple) else self.kv_heads

    def ffn_of(self, layer: int) -> int:
        return self.ffn[layer] if isinstance(self.ffn, tuple) else self.ffn
