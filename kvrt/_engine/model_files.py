"""Model files: the embedded default model, GGUF metadata and file fingerprints."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import msgspec

from .._errors import ModelLoadError
from .gguf_header import HeaderError, read_header

__all__ = [
    "GGUF_MAGIC",
    "GgufMetadata",
    "file_digest",
    "read_gguf_metadata",
]

GGUF_MAGIC = b"GGUF"
"""What a GGUF file begins with."""


def expand_path(model: str | os.PathLike[str]) -> Path:
    """``model`` with ``~`` expanded, or a :class:`ModelLoadError` saying why it cannot be."""
    if "\0" in str(model):
        raise ModelLoadError(f"the model path {str(model)!r} holds a NUL character")
    try:
        return Path(model).expanduser()
    except RuntimeError as exc:  # ~user with no such user, or no home directory
        raise ModelLoadError(f"cannot resolve the model path {str(model)!r}: {exc}") from None


_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """SHA-256 of a file, memoized by path, size and modification time."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    digest = _DIGESTS.get(key)
    if digest is None:
        h = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(8 * 1024 * 1024):
                h.update(chunk)
        digest = _DIGESTS[key] = h.hexdigest()
    return digest


class GgufMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """What a GGUF header says about a model's shape, read without loading weights."""

    architecture: str
    name: str | None
    n_layers: int | None
    n_head: int | None
    n_head_kv: int | None
    head_dim_k: int | None
    head_dim_v: int | None
    trained_context: int | None
    sliding_window: int | None
    sliding_window_pattern: int | None
    rope_freq_base: float | None
    file_bytes: int


def _scalar(fields: dict[str, Any], key: str) -> Any:
    field = fields.get(key)
    if field is None:
        return None
    value = field[0]
    if isinstance(value, list):
        # Per-layer arrays (e.g. KV heads per layer): the widest layer bounds the cost.
        return max(value) if value else None
    return value


def read_gguf_metadata(path: Path) -> GgufMetadata:
    """Read architecture and attention shape from a GGUF file's header."""
    try:  # the tokenizer's fields are most of a header: skipped, not decoded
        fields = read_header(path, lambda key: not key.startswith("tokenizer."))
    except (OSError, HeaderError) as exc:
        raise ModelLoadError(f"cannot read GGUF metadata from {path}: {exc}") from exc
    arch = _scalar(fields, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path} has no general.architecture: not a model GGUF")

    def key(name: str) -> Any:
        return _scalar(fields, f"{arch}.{name}")

    n_head = key("attention.head_count")
    embedding = key("embedding_length")
    default_head_dim = embedding // n_head if embedding and n_head else None
    return GgufMetadata(
        architecture=arch,
        name=_scalar(fields, "general.name"),
        n_layers=key("block_count"),
        n_head=n_head,
        n_head_kv=key("attention.head_count_kv") or n_head,
        head_dim_k=key("attention.key_length") or default_head_dim,
        head_dim_v=key("attention.value_length") or default_head_dim,
        trained_context=key("context_length"),
        sliding_window=key("attention.sliding_window") or None,
        sliding_window_pattern=key("attention.sliding_window_pattern"),
        rope_freq_base=key("rope.freq_base"),
        file_bytes=path.stat().st_size,
    )
