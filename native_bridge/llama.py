"""Thin synchronous wrappers over llama.cpp's C API (through llama_cpp's ctypes bindings):
a loaded model, its vocabulary and chat template, the build and the CPU it runs on, and
llama.cpp's log kept for error messages.

One :class:`LlamaModel` (weights) is shared by many contexts (KV caches,
:mod:`.llama_context`). Nothing here decides anything: it checks arguments, calls C,
checks results.
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
    "LlamaModel",
    "build_info",
    "cpu_features",
    "extra_buffers_safe",
    "kv_type_row_bytes",
    "model_params_for_llama_cpp",
    "recent_log",
]

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
