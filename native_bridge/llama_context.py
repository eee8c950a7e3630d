"""One llama.cpp context over a loaded model (:class:`LlamaContext`): its KV cache, decoding,
sequences, logits and state bytes.

Each context holds sequence 0 (the hot window) and a scratch sequence used to move token
ranges in and out as KV bytes; it is built with ``n_seq_max=2`` and ``kv_unified=True``,
without which a partial copy between sequences aborts the process. Nothing here decides
anything: it checks arguments, calls C, checks results.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import llama_cpp
import numpy as np
import numpy.typing as npt

from ._errors import BridgeArgumentError
from .llama import _LOG, FLOAT_KV_TYPES, KV_TYPES, LlamaModel, TokenIds, _failure

__all__ = [
    "MAIN_SEQ",
    "SCRATCH_SEQ",
    "STATE_HEAD",
    "LlamaContext",
    "context_params",
    "new_context",
    "read_state",
    "write_state",
]

MAIN_SEQ: Final = 0
SCRATCH_SEQ: Final = 1
FLUSH_SEQ: Final = 2
"""Where one throwaway token is computed to apply pending position shifts: llama.cpp
re-rotates shifted keys only when it next computes, and writes state bytes as they are,
so bytes read right after a shift would pair new positions with keys rotated for the old
ones. Callers never name it."""
KEEP_SEQ: Final = 3
"""On models with sliding-window layers, a second owner of every cell of ``MAIN_SEQ``.

llama.cpp takes a cell that slid out of its sequence's window for new tokens when only
one sequence owns it, and then drops every older cell of that sequence from the windowed
layers (measured: after evictions and restores at 4k tokens, the windowed layers kept only
positions 2048 and up). Those keys are what a range taken back at the tail, or exported
for another context, needs. A cell owned twice is never taken, so the windowed layers keep
every position, as the global ones do. The bridge mirrors ``MAIN_SEQ`` into it: callers
never name it."""


_DECODE_ERRORS: Final = {
    1: "no free KV slot for the batch",
    2: "the computation was aborted",
    -1: "the engine rejected the batch",
}

STATE_HEAD = 8
"""Bytes before the first section of a sequence's state (measured: a checkpoint's bytes
after them are the last bytes of the whole state)."""


def context_params(
    *,
    n_ctx: int,
    n_batch: int,
    n_seq: int,
    unified: bool,
    swa_full: bool,
    n_threads: int,
    kv_type: str,
    flash_attn: bool,
) -> Any:
    """llama.cpp's context parameters for a context of ``n_seq`` sequences (a batch holds
    at least one token per sequence: llama.cpp reserves an output for each)."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = params.n_ubatch = max(n_batch, n_seq)
    params.n_seq_max = n_seq
    params.kv_unified = unified
    params.swa_full = swa_full
    params.n_threads = params.n_threads_batch = n_threads
    params.type_k = params.type_v = KV_TYPES[kv_type][0]
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if flash_attn
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    params.no_perf = True
    return params


def new_context(model_ptr: Any, params: Any, what: str) -> Any:
    """A llama.cpp context built with ``params``, or a :class:`BridgeCallError` naming
    ``what`` with llama.cpp's own last words."""
    _LOG.clear()
    ptr = llama_cpp.llama_init_from_model(model_ptr, params)
    if not ptr:
        raise _failure(f"llama.cpp could not create {what}")
    return ptr


def read_state(ctx: Any, seq: int) -> npt.NDArray[np.uint8]:
    """The state bytes of ``seq``, written by llama.cpp straight into a fresh buffer."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq))
    buf = np.empty(size, dtype=np.uint8)
    written = llama_cpp.llama_state_seq_get_data(
        ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq
    )
    if written != size:
        raise _failure(f"llama.cpp wrote {written} of {size} state bytes")
    return buf


def write_state(ctx: Any, mem: Any, seq: int, data: npt.NDArray[np.uint8]) -> None:
    """Load state bytes into ``seq`` (emptied first), or refuse them whole."""
    _LOG.clear()
    read = llama_cpp.llama_state_seq_set_data(
        ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.size, seq
    )
    if read != data.size:
        llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
        raise _failure(f"llama.cpp rejected the state bytes (read {read} of {data.size})")


class LlamaContext:
    """One KV cache on a shared model: sequence 0 plus a scratch sequence."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_ctx: int,
        n_batch: int = 512,
        n_threads: int | None = None,
        kv_type: str = "f16",
        flash_attn: bool | None = None,
        swa_full: bool = True,
    ) -> None:
        model_ptr = model._live()
        if kv_type not in KV_TYPES:
            raise BridgeArgumentError(f"unknown KV type {kv_type!r}; known: {', '.join(KV_TYPES)}")
        if not 1 <= n_ctx <= 1 << 24:
            raise BridgeArgumentError(f"n_ctx must be in [1, {1 << 24}], got {n_ctx}")
        if not 1 <= n_batch <= 8192:
            raise BridgeArgumentError(f"n_batch must be in [1, 8192], got {n_batch}")
        if n_threads is not None and not 1 <= n_threads <= 1024:
            raise BridgeArgumentError(f"n_threads must be in [1, 1024], got {n_threads}")
        threads = n_threads or max(1, os.cpu_count() or 1)
        # A quantized V cache needs flash attention; otherwise off, so logits do not depend
        # on how a prompt is cut into batches.
        if flash_attn is None:
            flash_attn = kv_type not in FLOAT_KV_TYPES
        # llama.cpp reserves one output per sequence when it builds the context, and asserts
        # (aborting the process) if a batch cannot hold them: with two sequences a batch of
        # one token kills it (measured). The context's batch is at least one per sequence;
        # kvrt still hands it at most ``n_batch`` tokens per call.
        self._keep = model.n_swa > 0
        # Windowed layers at full size (``swa_full``): a window-sized cache drops the cells
        # that slid out of the window, so a range removed at the tail and computed again
        # (or restored inside the window) would attend to missing keys; llama.cpp's server
        # re-processes the whole prompt there.
        params = context_params(
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_seq=4 if self._keep else 3,
            unified=True,
            swa_full=swa_full,
            n_threads=threads,
            kv_type=kv_type,
            flash_attn=flash_attn,
        )
        ptr = new_context(model_ptr, params, f"a context of {n_ctx} tokens")
        self._ptr: Any = ptr
        self._mem: Any = llama_cpp.llama_get_memory(ptr)
        self._model = model
        self._busy = threading.Lock()
        self.kv_type = kv_type
        self.flash_attn = flash_attn
        self.n_ctx: int = llama_cpp.llama_n_ctx(ptr)
        self.n_ctx_seq: int = llama_cpp.llama_n_ctx_seq(ptr)
        """Cells per sequence as llama.cpp sized them (``n_ctx`` rounded up to 256 here):
        what it compares with a model's original context to pick LongRoPE factors."""
        self.n_batch: int = min(n_batch, llama_cpp.llama_n_batch(ptr))
        self.n_threads = threads
        self.can_shift: bool = bool(llama_cpp.llama_memory_can_shift(self._mem))
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 2)
        b = self._batch
        self._b_token = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._b_nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        self._b_seq = -1
        self._shifted = False
        self._decoded = False
        self._held_logits: npt.NDArray[np.float32] | None = None
        model._contexts.add(self)

    @property
    def model(self) -> LlamaModel:
        return self._model

    @property
    def closed(self) -> bool:
        return self._ptr is None

    @contextmanager
    def _use(self) -> Iterator[Any]:
        if self._ptr is None:
            raise BridgeArgumentError("the context is closed")
        if not self._busy.acquire(blocking=False):
            raise BridgeArgumentError("the context is in use by another thread")
        try:
            yield self._ptr
        finally:
            self._busy.release()

    def close(self) -> None:
        with self._use():
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ptr)
            self._ptr = None
            self._model._contexts.discard(self)

    # -- checks --

    @staticmethod
    def _check_seq(seq: int) -> None:
        if seq not in (MAIN_SEQ, SCRATCH_SEQ):
            raise BridgeArgumentError(f"sequence id must be {MAIN_SEQ} or {SCRATCH_SEQ}, got {seq}")

    @staticmethod
    def _check_range(p0: int, p1: int) -> None:
        if not 0 <= p0 <= p1 < 1 << 31:
            raise BridgeArgumentError(f"position range [{p0}, {p1}) is not a valid range")

    # -- compute --

    def decode(self, tokens: TokenIds, start: int, *, seq: int = MAIN_SEQ) -> None:
        """Run the model over ``tokens`` at positions ``start, start+1, ...`` in ``seq``.

        At most ``n_batch`` tokens per call; logits are kept for the last token only.
        The batch must continue the sequence: ``start`` is one past its last position.
        """
        arr = self._model.token_array(tokens)
        n = arr.size
        if not 1 <= n <= self.n_batch:
            raise BridgeArgumentError(f"a batch holds 1 to {self.n_batch} tokens, got {n}")
        self._check_seq(seq)
        if start < 0 or start + n >= 1 << 31:
            raise BridgeArgumentError(f"start position {start} is out of range")
        with self._use() as ctx:
            last = llama_cpp.llama_memory_seq_pos_max(self._mem, seq)
            if last >= 0 and start != last + 1:
                raise BridgeArgumentError(
                    f"positions must continue the sequence: it ends at {last}, batch starts at {start}"
                )
            self._held_logits = None
            self._run(ctx, arr, start, seq)
            self._decoded = True

    def _run(self, ctx: Any, arr: npt.NDArray[np.int32], start: int, seq: int) -> None:
        n = arr.size
        if self._b_seq != seq:
            for i in range(self.n_batch):
                self._batch.seq_id[i][0] = seq
                self._batch.seq_id[i][1] = KEEP_SEQ
            self._b_seq = seq
        self._b_token[:n] = arr
        self._b_pos[:n] = np.arange(start, start + n, dtype=np.int32)
        self._b_nseq[:n] = 2 if self._keep and seq == MAIN_SEQ else 1
        self._b_logits[:n] = 0
        self._b_logits[n - 1] = 1
        self._batch.n_tokens = n
        _LOG.clear()
        rc = llama_cpp.llama_decode(ctx, self._batch)
        if rc != 0:
            raise _failure(f"llama_decode failed ({rc}: {_DECODE_ERRORS.get(rc, 'error')})")
        self._shifted = False  # a decode applies pending shifts first

    def _apply_shifts(self, ctx: Any) -> None:
        """Re-rotate shifted keys now (see FLUSH_SEQ), keeping the last logits readable."""
        if not self._shifted:
            return
        if self._decoded and self._held_logits is None:
            self._held_logits = self._read_logits(ctx)
        try:
            self._run(ctx, np.zeros(1, dtype=np.int32), 0, FLUSH_SEQ)
        finally:
            llama_cpp.llama_memory_seq_rm(self._mem, FLUSH_SEQ, -1, -1)

    def logits(self) -> npt.NDArray[np.float32]:
        """A copy of the logits of the last decoded token."""
        with self._use() as ctx:
            if self._held_logits is not None:
                return self._held_logits.copy()
            return self._read_logits(ctx)

    def _read_logits(self, ctx: Any) -> npt.NDArray[np.float32]:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        if not ptr:
            raise _failure("no logits: nothing has been decoded yet")
        return np.ctypeslib.as_array(ptr, shape=(self._model.n_vocab,)).copy()

    # -- memory --

    def pos_min(self, seq: int = MAIN_SEQ) -> int:
        self._check_seq(seq)
        with self._use():
            return int(llama_cpp.llama_memory_seq_pos_min(self._mem, seq))

    def pos_max(self, seq: int = MAIN_SEQ) -> int:
        self._check_seq(seq)
        with self._use():
            return int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq))

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self._check_seq(seq)
        self._check_range(p0, p1)
        with self._use():
            if not llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, p1):
                raise _failure(f"llama.cpp could not remove [{p0}, {p1}) from sequence {seq}")
            if self._keep and seq == MAIN_SEQ:
                llama_cpp.llama_memory_seq_rm(self._mem, KEEP_SEQ, p0, p1)

    def seq_clear(self, seq: int) -> None:
        """Remove every token of ``seq`` (never fails)."""
        self._check_seq(seq)
        with self._use():
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
            if self._keep and seq == MAIN_SEQ:
                llama_cpp.llama_memory_seq_rm(self._mem, KEEP_SEQ, -1, -1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._check_seq(src)
        self._check_seq(dst)
        self._check_range(p0, p1)
        if src == dst:
            raise BridgeArgumentError("source and destination sequences must differ")
        with self._use():
            llama_cpp.llama_memory_seq_cp(self._mem, src, dst, p0, p1)
            if self._keep and dst == MAIN_SEQ:
                llama_cpp.llama_memory_seq_cp(self._mem, src, KEEP_SEQ, p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions in [p0, p1) by ``delta`` (keys are re-rotated by llama.cpp)."""
        self._check_seq(seq)
        self._check_range(p0, p1)
        if not self.can_shift:
            raise BridgeArgumentError("this model's KV cache cannot shift positions")
        if p0 + delta < 0:
            raise BridgeArgumentError(f"shifting [{p0}, {p1}) by {delta} gives negative positions")
        with self._use():
            llama_cpp.llama_memory_seq_add(self._mem, seq, p0, p1, delta)
            self._shifted = True

    def clear(self, *, wipe: bool = False) -> None:
        """Empty every sequence; with ``wipe``, zero the KV bytes as well (as a new
        context holds them), so nothing computed before stays in the buffer."""
        with self._use():
            llama_cpp.llama_memory_clear(self._mem, wipe)
            self._shifted = self._decoded = False
            self._held_logits = None

    def handover(self) -> LlamaContext:
        """The same native context under a new owner, as it is: this object is closed
        from now on (its calls refuse), so whoever held it can no longer reach it."""
        with self._use():
            new = object.__new__(LlamaContext)
            new.__dict__.update(self.__dict__)
            new._busy = threading.Lock()
            self._ptr = None
            self._model._contexts.discard(self)
            self._model._contexts.add(new)
        return new

    # -- state bytes --

    def state_get(self, seq: int) -> npt.NDArray[np.uint8]:
        """The KV bytes of ``seq``, written by llama.cpp straight into a fresh buffer."""
        self._check_seq(seq)
        with self._use() as ctx:
            self._apply_shifts(ctx)
            return read_state(ctx, seq)

    def checkpoint_get(self, seq: int) -> npt.NDArray[np.uint8]:
        """The recurrent state of ``seq`` alone (a hybrid's or a recurrent model's: what its
        recurrent layers have integrated of every token so far), as llama.cpp writes it
        with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``; attention KV is not in it."""
        self._check_seq(seq)
        self._check_recurrent()
        flag = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        with self._use() as ctx:
            size = int(llama_cpp.llama_state_seq_get_size_ext(ctx, seq, flag))
            buf = np.empty(size, dtype=np.uint8)
            written = llama_cpp.llama_state_seq_get_data_ext(
                ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq, flag
            )
            if written != size:
                raise _failure(f"llama.cpp wrote {written} of {size} checkpoint bytes")
            return buf

    def checkpoint_set(self, seq: int, data: npt.NDArray[np.uint8]) -> None:
        """Put ``seq``'s recurrent state back to a checkpoint (:meth:`checkpoint_get`); its
        attention KV stays as it is. Then the tokens after the checkpoint can be removed
        (:meth:`seq_rm` of the tail, which a recurrent state refuses otherwise) and
        computed again."""
        self._check_seq(seq)
        self._check_recurrent()
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise BridgeArgumentError("checkpoint bytes must be a contiguous 1-D uint8 array")
        if data.size == 0:
            raise BridgeArgumentError("checkpoint bytes are empty")
        flag = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        with self._use() as ctx:
            _LOG.clear()
            read = llama_cpp.llama_state_seq_set_data_ext(
                ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.size, seq, flag
            )
            if read != data.size:
                raise _failure(
                    f"llama.cpp rejected the checkpoint bytes (read {read} of {data.size})"
                )

    def range_with_checkpoint(
        self, start: int, end: int, checkpoint: npt.NDArray[np.uint8]
    ) -> npt.NDArray[np.uint8]:
        """The state bytes of [start, end) of the main sequence with ``checkpoint`` as
        their recurrent state instead of the current one: a block of a hybrid model as it
        was when computed (its checkpoint taken after its last token), which another
        context loads (:meth:`state_set` into the scratch sequence, then :meth:`seq_cp`)
        and continues bit for bit.

        State bytes are a head, the attention section, then the recurrent section; a
        checkpoint is the head and the recurrent section. Checked: the range's bytes must
        end with the current checkpoint's section, else the layout is not what kvrt
        knows and nothing is returned."""
        self._check_recurrent()
        self._check_range(start, end)
        current = self.checkpoint_get(MAIN_SEQ)
        if checkpoint.dtype != np.uint8 or checkpoint.size != current.size:
            raise BridgeArgumentError(
                f"a checkpoint of this context is {current.size} bytes, got {checkpoint.size}"
            )
        recurrent = current.size - STATE_HEAD
        self.seq_clear(SCRATCH_SEQ)
        self.seq_cp(MAIN_SEQ, SCRATCH_SEQ, start, end)
        try:
            data = self.state_get(SCRATCH_SEQ)
        finally:
            self.seq_clear(SCRATCH_SEQ)
        if data.size < current.size or not np.array_equal(
            data[data.size - recurrent :], current[STATE_HEAD:]
        ):
            raise _failure("llama.cpp's state bytes are not laid out as kvrt reads them")
        return np.concatenate([data[: data.size - recurrent], checkpoint[STATE_HEAD:]])

    def _check_recurrent(self) -> None:
        # On a model without recurrent layers the same flag means "windowed layers only".
        if not (self._model.is_recurrent or self._model.is_hybrid):
            raise BridgeArgumentError(
                "this model has no recurrent layers: it keeps no recurrent state to checkpoint"
            )

    def state_set(self, seq: int, data: npt.NDArray[np.uint8]) -> None:
        """Load KV bytes into ``seq``, which must be empty."""
        self._check_seq(seq)
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise BridgeArgumentError("state bytes must be a contiguous 1-D uint8 array")
        if data.size == 0:
            raise BridgeArgumentError("state bytes are empty")
        with self._use() as ctx:
            if llama_cpp.llama_memory_seq_pos_max(self._mem, seq) >= 0:
                raise BridgeArgumentError(f"sequence {seq} must be empty before loading state")
            write_state(ctx, self._mem, seq, data)
            if self._keep and seq == MAIN_SEQ:
                llama_cpp.llama_memory_seq_cp(self._mem, MAIN_SEQ, KEEP_SEQ, -1, -1)
