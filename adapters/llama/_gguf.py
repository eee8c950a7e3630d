"""A GGUF file's metadata and small tensors, read without the rest.

llama.cpp's C API answers scalar metadata but not arrays (a per-layer window pattern) or
tensor data (RoPE factor tables). The ``gguf`` package reads those, but decodes every
string of the vocabulary on the way (about 2 s for a 49k-token vocabulary); this reader
walks past what it is not asked for, so a model opens in milliseconds more, not seconds.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO, Final

import numpy as np

from kvrt import ModelLoadError

__all__ = ["GgufFile"]

_SCALARS: Final = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_MAX_ITEMS: Final = 4096
"""Arrays longer than this (vocabularies, merges) are skipped, not kept."""
_F32: Final = 0


class GgufFile:
    """The metadata of a GGUF file (arrays up to a few thousand items) and where its
    tensors lie."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fields: dict[str, Any] = {}
        self._tensors: dict[str, tuple[tuple[int, ...], int, int]] = {}
        try:
            with self.path.open("rb") as f:
                self._read(f)
        except (OSError, struct.error, UnicodeDecodeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read the GGUF header of {self.path}: {exc}") from exc

    def _read(self, f: BinaryIO) -> None:
        def take(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError("the file ends inside its header")
            return struct.unpack(fmt, data)[0]

        def string() -> str:
            return f.read(take("<Q")).decode("utf-8")

        def value(kind: int) -> Any:
            if kind in _SCALARS:
                return take(_SCALARS[kind])
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, count = take("<I"), take("<Q")
                if count > _MAX_ITEMS:
                    if item == _STRING:
                        for _ in range(count):
                            f.seek(take("<Q"), 1)
                    elif item in _SCALARS:
                        f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
                    else:
                        raise ValueError(f"an array of type {item}")
                    return None
                return [value(item) for _ in range(count)]
            raise ValueError(f"a value of type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        take("<I")  # version
        n_tensors, n_kv = take("<Q"), take("<Q")
        for _ in range(n_kv):
            key = string()
            self.fields[key] = value(take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(take("<Q") for _ in range(take("<I")))
            infos.append((name, dims, take("<I"), take("<Q")))
        align = int(self.fields.get("general.alignment") or 32)
        start = -(-f.tell() // align) * align
        for name, dims, kind, offset in infos:
            self._tensors[name] = (dims, kind, start + offset)

    def tensor_f32(self, name: str) -> tuple[float, ...] | None:
        """The values of a float32 tensor, or None where the file has no such tensor."""
        found = self._tensors.get(name)
        if found is None:
            return None
        dims, kind, offset = found
        if kind != _F32:
            raise ModelLoadError(f"{self.path}: tensor {name} is not float32")
        n = int(np.prod(dims))
        data = np.fromfile(self.path, dtype="<f4", count=n, offset=offset)
        if data.size != n:
            raise ModelLoadError(f"{self.path}: tensor {name} ends past the file")
        return tuple(float(x) for x in data)
