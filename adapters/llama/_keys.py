"""Un-rotated keys of llama.cpp KV bytes, for relevance scoring: read out of a window's
bytes (:class:`KeyReader`), and computed for a question in a small context of their own
(:class:`QueryKeys`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvrt.backend import ModelFacts
from kvrt.native_bridge import BridgeError
from kvrt.native_bridge.llama import KV_TYPES, LlamaModel
from kvrt.native_bridge.llama_context import MAIN_SEQ, LlamaContext
from kvrt.native_bridge.llama_keys import key_rotation, read_keys, unrotate
from kvrt.native_bridge.rope import Rope

from .._errors import translate_errors
from .._given import check_tokens
from .._sketch import QUERY_TOKENS, block_sketch
from ._rope import ModelRope

__all__ = ["KeyReader", "QueryKeys"]


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


class QueryKeys:
    """Keys of a question's last :data:`QUERY_TOKENS` tokens, computed alone in a small
    context of their own (made on first use), so a window and its logits stay as they
    are. A query extending the previous one (an answer fed back token by token) computes
    only its new tokens."""

    def __init__(
        self, model: LlamaModel, facts: ModelFacts, rope: ModelRope, reader: KeyReader, *,
        n_threads: int | None,
    ) -> None:  # fmt: skip
        self._model, self._facts, self._rope, self._reader = model, facts, rope, reader
        self._n_threads = n_threads
        self._ctx: LlamaContext | None = None
        self._held: list[int] = []
        """What the context holds at positions 0...."""

    def keys(self, tokens: Sequence[int]) -> npt.NDArray[np.float32] | None:
        """``float32[layer, head, token, head_dim]`` of the last tokens of ``tokens``."""
        chunk = list(tokens)[-QUERY_TOKENS:]
        check_tokens(chunk, self._facts.n_vocab)
        with translate_errors("computing the query's keys"):
            if self._ctx is None:
                self._ctx = LlamaContext(
                    self._model,
                    n_ctx=QUERY_TOKENS,
                    n_batch=QUERY_TOKENS,
                    n_threads=self._n_threads,
                    kv_type=self._facts.kv_type,
                    flash_attn=self._facts.flash_attention,
                )
            ctx, held = self._ctx, self._held
            kept = len(held) if chunk[: len(held)] == held and len(chunk) > len(held) else 0
            self._held = []
            if not kept:
                ctx.clear()
            ctx.decode(chunk[kept:], kept)
            data = ctx.state_get(MAIN_SEQ)
            self._held = chunk
        # Smaller than the window: on LongRoPE models it may use the other table.
        return self._reader.keys(data, self._rope.ropes(ctx.n_ctx_seq, windowed=False)[0])

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
