"""Un-rotated keys of llama.cpp KV bytes, for relevance scoring."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvrt.backend import ModelFacts
from kvrt.native_bridge import BridgeError
from kvrt.native_bridge.llama import KV_TYPES
from kvrt.native_bridge.llama_keys import key_rotation, read_keys, unrotate
from kvrt.native_bridge.rope import Rope

from .._sketch import block_sketch
from ._rope import ModelRope

__all__ = ["KeyReader"]


@dataclass(frozen=True, slots=True)
class KeyReader:
    """Reads keys out of one model's sequence state bytes and undoes the rotations the
    model applied to them: its RoPE as the context that wrote them computed it (Llama 3's
    frequency factors, LongRoPE's table for that context's size, YaRN's ramp) and, for
    quantized keys, llama.cpp's Hadamard rotation."""

    n_layer: int
    n_head_kv: int
    head_dim: int
    k_rotation: int | None

    @classmethod
    def for_model(cls, facts: ModelFacts, rope: ModelRope) -> KeyReader | None:
        """A reader, or None where keys cannot be compared across positions here: a
        sliding window (two caches in the bytes), recurrent layers (their state in the
        bytes; layers without keys), or a multi-axis RoPE."""
        if facts.sliding_window_live or facts.recurrent or not rope.turnable:
            return None
        return cls(
            n_layer=facts.n_layers,
            n_head_kv=facts.n_head_kv,
            head_dim=facts.head_dim,
            k_rotation=key_rotation(KV_TYPES[facts.kv_type][0], {facts.head_dim}),
        )

    def keys(self, data: npt.NDArray[np.uint8], rope: Rope) -> npt.NDArray[np.float32] | None:
        """``float32[layer, head, token, head_dim]`` at position 0, or None when the bytes
        cannot be read. ``rope``: how the context that wrote them rotated keys."""
        try:
            rows = read_keys(
                data,
                n_layer=self.n_layer,
                n_embd_k=self.n_head_kv * self.head_dim,
                k_rotation=self.k_rotation,
            )
            return unrotate(rows.keys, rows.positions, rope, head_dim=self.head_dim)
        except BridgeError:
            return None

    def sketch(self, data: npt.NDArray[np.uint8], rope: Rope) -> object | None:
        """The block sketch of sequence state bytes, or None when they cannot be read."""
        keys = self.keys(data, rope)
        return None if keys is None else block_sketch(keys)
