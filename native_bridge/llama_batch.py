"""Several sequences in one llama.cpp context, each in its own KV stream, decoded together.

A :class:`LlamaSequences` context is built with ``kv_unified`` off: every sequence gets a
stream of its own (its own cells, its own attention), so one ``llama_decode`` can advance
all of them by a token each. The kernel probe uses it to measure whether a sequence's
logits decoded beside others equal its logits decoded alone, and what a step costs.

A window of a context of its own (:class:`~.llama_context.LlamaContext`, one stream) moves into a
sequence here and back whole (:meth:`LlamaSequences.load_window`,
:meth:`LlamaSequences.window`): the same cells at the same positions, their bytes
rewritten for the other stream count, which llama.cpp refuses to load as they are. A
sequence shares nothing with the others, so where the kernels are batch-invariant (the
kernel probe says), decoding it beside them gives its own context's logits bit for bit.

Nothing here decides anything: it checks arguments, calls C, checks results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from ._errors import BridgeArgumentError
from .llama import _LOG, KV_TYPES, LlamaModel, _failure
from .llama_context import _DECODE_ERRORS, context_params, new_context, read_state, write_state
from .llama_keys import _HEADER, state_streams

__all__ = ["LlamaSequences", "whole_stream"]


def whole_stream(cells: int) -> int:
    """The cells llama.cpp gives a stream asked for ``cells``: a multiple of 256."""
    return -(-cells // 256) * 256


class LlamaSequences:
    """``n_seq`` independent sequences of at most ``cells`` tokens each on a shared model."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_seq: int,
        cells: int,
        n_threads: int,
        kv_type: str = "f16",
        flash_attn: bool = False,
        n_batch: int = 128,
    ) -> None:
        model_ptr = model._live()
        if kv_type not in KV_TYPES:
            raise BridgeArgumentError(f"unknown KV type {kv_type!r}; known: {', '.join(KV_TYPES)}")
        if not 1 <= n_seq <= 64:
            raise BridgeArgumentError(f"n_seq must be in [1, 64], got {n_seq}")
        if not 1 <= cells <= 1 << 20:
            raise BridgeArgumentError(f"cells must be in [1, {1 << 20}], got {cells}")
        if not 1 <= n_threads <= 1024:
            raise BridgeArgumentError(f"n_threads must be in [1, 1024], got {n_threads}")
        if not 1 <= n_batch <= 8192:
            raise BridgeArgumentError(f"n_batch must be in [1, 8192], got {n_batch}")
        per_seq = whole_stream(cells)  # llama.cpp would round it so: ask for it whole
        params = context_params(
            n_ctx=per_seq * n_seq,
            n_batch=n_batch,
            n_seq=n_seq,
            unified=False,
            swa_full=True,
            n_threads=n_threads,
            kv_type=kv_type,
            flash_attn=flash_attn,
        )
        ptr = new_context(model_ptr, params, f"a context of {n_seq} sequences")
        self._ptr: Any = ptr
        self._mem: Any = llama_cpp.llama_get_memory(ptr)
        self._model = model
        self.n_seq = n_seq
        self.cells = per_seq
        self.n_batch = params.n_batch
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        model._contexts.add(self)

    def _live(self) -> Any:
        if self._ptr is None:
            raise BridgeArgumentError("the context is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        if self._ptr is None:
            return
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ptr)
        self._ptr = None
        self._model._contexts.discard(self)

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise BridgeArgumentError(f"sequence id must be in [0, {self.n_seq}), got {seq}")

    def next_position(self, seq: int) -> int:
        """One past the last position of ``seq`` (0 when it is empty)."""
        self._check_seq(seq)
        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def clear(self, seq: int) -> None:
        """Remove every token of ``seq``."""
        self._check_seq(seq)
        self._live()
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def state_get(self, seq: int) -> npt.NDArray[np.uint8]:
        """The KV bytes of ``seq`` (they load into a sequence of a context like this one;
        a unified context writes another layout)."""
        self._check_seq(seq)
        return read_state(self._live(), seq)

    def state_set(self, seq: int, data: npt.NDArray[np.uint8]) -> None:
        """Load KV bytes :meth:`state_get` wrote into ``seq``, which must be empty."""
        self._check_seq(seq)
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous or not data.size:
            raise BridgeArgumentError("state bytes must be a non-empty contiguous 1-D uint8 array")
        ctx = self._live()
        if self.next_position(seq):
            raise BridgeArgumentError(f"sequence {seq} must be empty before loading state")
        write_state(ctx, self._mem, seq, data)

    def load_window(self, seq: int, data: npt.NDArray[np.uint8]) -> None:
        """Load a window's KV bytes as a one-stream context writes them
        (:meth:`~.llama_context.LlamaContext.state_get`) into ``seq``, which must be empty."""
        self._check_seq(seq)
        self.state_set(seq, _streams(data, self.n_seq, seq))

    def window(self, seq: int) -> npt.NDArray[np.uint8]:
        """``seq``'s KV bytes as a one-stream context writes them: they load back into
        one (:meth:`~.llama_context.LlamaContext.state_set`)."""
        return _one_stream(self.state_get(seq))

    def decode(self, tokens: Sequence[int], seqs: Sequence[int]) -> npt.NDArray[np.float32]:
        """Advance sequence ``seqs[i]`` by ``tokens[i]`` at its next position, all in one
        ``llama_decode``; the logits after each token, one row per token. A sequence may
        appear more than once (its tokens in order: a prefill)."""
        arr = self._model.token_array(tokens)
        n = arr.size
        if not 1 <= n <= self.n_batch:
            raise BridgeArgumentError(f"a batch holds 1 to {self.n_batch} tokens, got {n}")
        if len(seqs) != n:
            raise BridgeArgumentError(f"{n} tokens but {len(seqs)} sequence ids")
        ctx = self._live()
        nxt: dict[int, int] = {}
        b = self._batch
        for i, seq in enumerate(seqs):
            if seq not in nxt:
                nxt[seq] = self.next_position(seq)
            if nxt[seq] >= self.cells:
                raise BridgeArgumentError(f"sequence {seq} is full ({self.cells} cells)")
            b.token[i] = int(arr[i])
            b.pos[i] = nxt[seq]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1
            nxt[seq] += 1
        b.n_tokens = n
        _LOG.clear()
        rc = llama_cpp.llama_decode(ctx, b)
        if rc != 0:
            raise _failure(f"llama_decode failed ({rc}: {_DECODE_ERRORS.get(rc, 'error')})")
        ptr = llama_cpp.llama_get_logits(ctx)
        if not ptr:
            raise _failure("no logits after decoding")
        return np.ctypeslib.as_array(ptr, shape=(n, self._model.n_vocab)).copy()


def _streams(data: npt.NDArray[np.uint8], n_stream: int, slot: int) -> npt.NDArray[np.uint8]:
    """One-stream sequence state bytes rewritten for a cache of ``n_stream`` streams, the
    cells in stream ``slot`` and the others empty."""
    head = data[:_HEADER]
    pieces = [head]
    for streams in state_streams(data):
        if len(streams) != 1:
            raise BridgeArgumentError(f"a window's bytes hold {len(streams)} streams, not one")
        _, begin, end = streams[0]
        pieces.append(np.array([n_stream], dtype="<u4").view(np.uint8))
        for s in range(n_stream):
            pieces.append(data[begin:end] if s == slot else _EMPTY)
    return np.concatenate(pieces)


def _one_stream(data: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Sequence state bytes of a cache of several streams, the one that holds cells kept
    as a one-stream cache writes it."""
    pieces = [data[:_HEADER]]
    for streams in state_streams(data):
        held = [(b, e) for part, b, e in streams if part.positions.size]
        if len(held) > 1:
            raise BridgeArgumentError(f"the bytes hold cells in {len(held)} streams, not one")
        pieces.append(np.array([1], dtype="<u4").view(np.uint8))
        pieces.append(data[held[0][0] : held[0][1]] if held else _EMPTY)
    return np.concatenate(pieces)


_EMPTY = np.zeros(4, dtype=np.uint8)
"""An empty stream: a cell count of 0."""
