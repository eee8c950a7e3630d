"""Un-rotated keys of llama.cpp KV bytes, for relevance scoring."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvrt.backend import ModelFacts
from kvrt.native_bridge import BridgeError
from kvrt.native_bridge.llama import LlamaModel
from kvrt.native_bridge.llama_keys import ROPE_NEOX, ROPE_NORM, read_keys, unrotate

from .._sketch import block_sketch

__all__ = ["KeyReader"]


@dataclass(frozen=True, slots=True)
class KeyReader:
    """Reads keys out of one model's sequence state bytes and undoes their RoPE."""

    n_layer: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    base: float
    rope_type: int

    @classmethod
    def for_model(cls, model: LlamaModel, facts: ModelFacts) -> KeyReader | None:
        """A reader, or None where keys cannot be compared across positions: a sliding
        window (two caches in the bytes, two RoPE bases), RoPE scaling, another rope type."""
        arch = facts.architecture
        scaling = model.meta(f"{arch}.rope.scaling.type")
        if facts.sliding_window_live or scaling not in (None, "", "none"):
            return None
        if model.rope_type not in (ROPE_NORM, ROPE_NEOX):
            return None
        try:
            n_rot = int(model.meta(f"{arch}.rope.dimension_count") or facts.head_dim)
        except ValueError:
            return None
        return cls(
            n_layer=facts.n_layers,
            n_head_kv=facts.n_head_kv,
            head_dim=facts.head_dim,
            n_rot=n_rot,
            base=facts.rope_freq_base or 10000.0,
            rope_type=model.rope_type,
        )

    def keys(self, data: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32] | None:
        """``float32[layer, head, token, head_dim]`` at position 0, or None when the bytes
        cannot be read."""
        try:
            rows = read_keys(data, n_layer=self.n_layer, n_embd_k=self.n_head_kv * self.head_dim)
            return unrotate(
                rows.keys,
                rows.positions,
                head_dim=self.head_dim,
                n_rot=self.n_rot,
                base=self.base,
                rope_type=self.rope_type,
            )
        except BridgeError:
            return None

    def sketch(self, data: npt.NDArray[np.uint8]) -> object | None:
        """The block sketch of sequence state bytes, or None when they cannot be read."""
        keys = self.keys(data)
        return None if keys is None else block_sketch(keys)
