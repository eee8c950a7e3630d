"""Thin synchronous wrappers over llama.cpp's C API (through llama_cpp's ctypes bindings).

One :class:`LlamaModel` (weights) is shared by many :class:`LlamaContext` objects (KV
caches). Each context holds sequence 0 (the hot window) and a scratch sequence used to
move token ranges in and out as KV bytes; it is built with ``n_seq_max=2`` and
``kv_unified=True``, without which a partial copy between sequences aborts the process.

Nothing here decides anything: it checks arguments, calls C, checks results.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

import llama_cpp
import numpy as np
import numpy.typing as npt

from ._errors import BridgeArgumentError, BridgeCallError, BridgeLoadError

__all__ = [
    "FLOAT_KV_TYPES",
    "KV_TYPES",
    "MAIN_SEQ",
    "SCRATCH_SEQ",
    "LlamaContext",
    "LlamaModel",
    "build_info",
    "cpu_features",
    "extra_buffers_safe",
    "kv_type_row_bytes",
    "model_params_for_llama_cpp",
    "recent_log",
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

# ggml type ids and (elements per block, bytes per block) of the KV cache types kvrt offers.
KV_TYPES: Final[dict[str, tuple[int, int, int]]] = {
    "f32": (llama_cpp.GGML_TYPE_F32, 1, 4),
    "f16": (llama_cpp.GGML_TYPE_F16, 1, 2),
    "bf16": (30, 1, 2),  # GGML_TYPE_BF16 (not exported by llama_cpp),
    "q8_0": (llama_cpp.GGML_TYPE_Q8_0, 32, 34),
    "q5_1": (llama_cpp.GGML_TYPE_Q5_1, 32, 24),
    "q5_0": (llama_cpp.GGML_TYPE_Q5_0, 32, 22),
    "q4_1": (llama_cpp.GGML_TYPE_Q4_1, 32, 20),
    "q4_0": (llama_cpp.GGML_TYPE_Q4_0, 32, 18),
}

FLOAT_KV_TYPES: Final = ("f32", "f16", "bf16")
"""KV types llama.cpp computes with or without flash attention; the quantized ones need it."""

_DECODE_ERRORS: Final = {
    1: "no free KV slot for the batch",
    2: "the computation was aborted",
    -1: "the engine rejected the batch",
}


def kv_type_row_bytes(kv_type: str, n_elements: int) -> int:
    """Bytes one row of ``n_elements`` takes in a KV cache of ``kv_type``."""
    _, block, size = KV_TYPES[kv_type]
    if n_elements % block:
        raise BridgeArgumentError(f"KV type {kv_type} needs rows that are a multiple of {block}")
    return n_elements // block * size


# --- logging: keep llama.cpp's recent lines for error messages instead of printing them ---

_LOG: collections.deque[str] = collections.deque(maxlen=40)
_LOG_ECHO = os.environ.get("KVRT_NATIVE_LOG", "") not in ("", "0")
_CAPTURE: list[str] | None = None
"""Every line llama.cpp logs while a model loads (its ``print_info`` facts)."""


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", "replace")
    if _CAPTURE is not None:
        _CAPTURE.append(line)
    if level >= 3:  # warnings and errors; continuation lines (5) follow their head
        _LOG.append(line.rstrip("\n"))
    if _LOG_ECHO:
        print(line, end="", file=sys.stderr, flush=True)


llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()


def recent_log(n: int = 5) -> str:
    """The last ``n`` warning or error lines llama.cpp logged."""
    lines = [line for line in list(_LOG)[-n:] if line.strip()]
    return " | ".join(lines)


def _failure(what: str) -> BridgeCallError:
    tail = recent_log()
    return BridgeCallError(f"{what}" + (f" (llama.cpp: {tail})" if tail else ""))


_LOAD_LOCK = threading.Lock()


def cpu_features() -> frozenset[str]:
    """The CPU features this llama.cpp build uses here (``AVX512``, ``AMX_INT8``, ...), as
    its system info lists them."""
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    return frozenset(
        name.strip()
        for part in info.split("|")
        if "=" in part
        for name, value in [part.rsplit("=", 1)]
        if value.strip() == "1"
    )


def build_info() -> str:
    """The llama.cpp build: llama-cpp-python's version, the build's system info, and the
    size and time of each of its libraries (a rebuild is another build)."""
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    libs = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    try:
        files = sorted(os.scandir(libs), key=lambda e: e.name)
        stamp = ",".join(f"{e.name}:{e.stat().st_size}:{e.stat().st_mtime_ns}" for e in files)
    except OSError:
        stamp = "?"
    return f"llama-cpp-python {llama_cpp.__version__} | {info} | {stamp}"


def extra_buffers_safe() -> bool:
    """Whether llama.cpp may repack weights into the CPU's extra buffer types without
    risking the process. Not where its build uses AMX: on a Xeon with ``AMX_INT8`` this
    llama.cpp dies with a segmentation fault in ``ggml_backend_amx_mul_mat`` on the first
    batch of more than one token (``llama_cpp.Llama`` as well; llama.cpp issue 20824).
    There weights stay in llama.cpp's plain CPU buffers (measured on that machine: SmolLM2
    prefill 296 tokens/s on two threads, no crash)."""
    return "AMX_INT8" not in cpu_features()


@contextmanager
def model_params_for_llama_cpp(*, extra_buffers: bool | None = None) -> Iterator[None]:
    """While open, ``llama_cpp.Llama`` loads weights as :class:`LlamaModel` does
    (``extra_buffers``; its constructor has no argument for it): a reference that runs the
    same kernels, and does not crash where those buffers would."""
    from llama_cpp import llama_cpp as bindings

    default = bindings.llama_model_default_params
    use = extra_buffers_safe() if extra_buffers is None else extra_buffers

    def params() -> Any:
        found = default()
        found.use_extra_bufts = use
        return found

    with _LOAD_LOCK:
        bindings.llama_model_default_params = params
        try:
            yield
        finally:
            bindings.llama_model_default_params = default


def _print_info(lines: list[str]) -> dict[str, str]:
    info: dict[str, str] = {}
    for line in lines:
        if line.startswith("print_info: ") and "=" in line:
            key, _, value = line[len("print_info: ") :].partition("=")
            info.setdefault(key.strip(), value.strip())
    return info


TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]


class LlamaModel:
    """Loaded weights and vocabulary, shared by every context opened on them."""

    def __init__(
        self,
        path: str,
        *,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        extra_buffers: bool | None = None,
    ) -> None:
        """``extra_buffers``: let llama.cpp repack weights into the CPU's extra buffer
        types (its AMX and repacked-quantization kernels); by default where that is safe
        (:func:`extra_buffers_safe`)."""
        if not os.path.isfile(path):
            raise BridgeLoadError(f"model file not found: {path}")
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_mmap = use_mmap
        params.use_extra_bufts = extra_buffers_safe() if extra_buffers is None else extra_buffers
        global _CAPTURE
        _LOG.clear()
        with _LOAD_LOCK:
            _CAPTURE = []
            try:
                ptr = llama_cpp.llama_model_load_from_file(path.encode(), params)
            finally:
                lines, _CAPTURE = _CAPTURE, None
        if not ptr:
            tail = recent_log()
            raise BridgeLoadError(
                f"llama.cpp could not load {path}" + (f": {tail}" if tail else "")
            )
        self._ptr: Any = ptr
        self._vocab: Any = llama_cpp.llama_model_get_vocab(ptr)
        self._contexts: set[Any] = set()
        """Contexts open on the model (LlamaContext, LlamaSequences): closed before it."""
        self.path = path
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_layer: int = llama_cpp.llama_model_n_layer(ptr)
        self.n_head: int = llama_cpp.llama_model_n_head(ptr)
        self.n_head_kv: int = llama_cpp.llama_model_n_head_kv(ptr)
        self.n_embd: int = llama_cpp.llama_model_n_embd(ptr)
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(ptr)
        self.n_swa: int = llama_cpp.llama_model_n_swa(ptr)
        self.size_bytes: int = llama_cpp.llama_model_size(ptr)
        self.rope_type: int = llama_cpp.llama_model_rope_type(ptr)
        self.is_recurrent = bool(llama_cpp.llama_model_is_recurrent(ptr))
        """Every layer keeps a recurrent state (Mamba, RWKV): no attention KV at all."""
        self.is_hybrid = bool(llama_cpp.llama_model_is_hybrid(ptr))
        """Attention layers and recurrent ones (Granite 4, LFM2, Jamba ...)."""
        self.has_chat_template = bool(llama_cpp.llama_model_chat_template(ptr, None))
        self.info: dict[str, str] = _print_info(lines)
        """What llama.cpp printed about the model while loading it (``print_info: key =
        value``), e.g. ``freq_base_swa``, the RoPE base of windowed layers."""

    # -- lifetime --

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def _live(self) -> Any:
        if self._ptr is None:
            raise BridgeArgumentError("the model is closed")
        return self._ptr

    def close(self, *, close_contexts: bool = False) -> None:
        """Free the weights; contexts must be closed first, or with ``close_contexts``."""
        if self._ptr is None:
            return
        if close_contexts:
            for ctx in list(self._contexts):
                ctx.close()
        if self._contexts:
            raise BridgeArgumentError(
                f"close the model's {len(self._contexts)} open contexts first"
            )
        llama_cpp.llama_model_free(self._ptr)
        self._ptr = None

    # -- metadata --

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp read it, or ``None``."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._live(), key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._live(), key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    # -- vocabulary --

    def token_array(self, tokens: TokenIds) -> npt.NDArray[np.int32]:
        """Token ids as a contiguous int32 array, refusing any outside the vocabulary.

        Checked before narrowing to int32, so no id can wrap into the vocabulary.
        """
        try:
            arr = np.asarray(tokens)
        except (OverflowError, ValueError) as exc:
            raise BridgeArgumentError(f"token ids must be integers: {exc}") from None
        if arr.ndim != 1:
            raise BridgeArgumentError(f"token ids must be a flat sequence, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise BridgeArgumentError(f"token ids must be integers, got {arr.dtype}")
        if arr.size:
            self._check_bounds(int(arr.min()), int(arr.max()))
        return np.ascontiguousarray(arr, dtype=np.int32)

    def _check_bounds(self, low: int, high: int) -> None:
        if low < 0 or high >= self.n_vocab:
            bad = low if low < 0 else high
            raise BridgeArgumentError(
                f"token id {bad} is outside the vocabulary [0, {self.n_vocab})"
            )

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self._vocab if self._live() else None,
                data,
                len(data),
                buf,
                capacity,
                add_special,
                parse_special,
            )
            if n >= 0:
                return list(buf[:n])
            if -n <= capacity:
                raise _failure("tokenization failed")
            capacity = -n

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character)."""
        self._live()
        self._check_bounds(token, token)
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)]

    def detokenize(self, tokens: TokenIds, *, special: bool = False) -> str:
        self._live()
        arr = self.token_array(tokens)
        c_tokens = arr.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        capacity = max(64, arr.size * 8)
        while True:
            buf = ctypes.create_string_buffer(capacity)
            n = llama_cpp.llama_detokenize(
                self._vocab, c_tokens, arr.size, buf, capacity, not special, special
            )
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            capacity = -n

    def is_end_of_generation(self, token: int) -> bool:
        self._live()
        self._check_bounds(token, token)
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def chat_template_source(self) -> tuple[str, str, str] | None:
        """The GGUF's chat template (Jinja source) and the texts of its BOS and EOS tokens;
        None when the model has none."""
        template = llama_cpp.llama_model_chat_template(self._live(), None)
        if not template:
            return None
        marks = []
        for token in (
            llama_cpp.llama_vocab_bos(self._vocab),
            llama_cpp.llama_vocab_eos(self._vocab),
        ):
            ok = 0 <= token < self.n_vocab
            marks.append(
                self.token_piece(token, special=True).decode("utf-8", "replace") if ok else ""
            )
        return template.decode("utf-8", "replace"), marks[0], marks[1]

    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool
    ) -> str:
        template = llama_cpp.llama_model_chat_template(self._live(), None)
        if not template:
            raise BridgeArgumentError(
                "the model has no chat template (a base model): give it text segments "
                "(ensure_context, generate), not chat messages"
            )
        # Keep the encoded strings alive for the duration of the call.
        encoded = [(role.encode(), content.encode()) for role, content in messages]
        chat = (llama_cpp.llama_chat_message * len(encoded))()
        for slot, (role, content) in zip(chat, encoded, strict=True):
            slot.role, slot.content = role, content
        capacity = sum(len(r) + len(c) for r, c in encoded) * 2 + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(capacity)
            n = llama_cpp.llama_chat_apply_template(
                template, chat, len(encoded), add_generation_prompt, buf, capacity
            )
            if n < 0:
                raise BridgeArgumentError("llama.cpp does not support this model's chat template")
            if n <= capacity:
                return buf.raw[:n].decode("utf-8", "replace")
            capacity = n
        raise _failure("applying the chat template failed")


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
