"""A GGUF file's key-value header, read in one pass over the mapped file.

``gguf.GGUFReader`` builds a numpy view for every part of every field: 3.9 s for the
embedded model's header (49,152 token strings and their merges) on two cores. This reads
the same header in tens of milliseconds, decoding only the keys asked for.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ARRAY", "STRING", "HeaderError", "TensorInfo", "read_header", "read_tensors"]

STRING = 8
ARRAY = 9
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
"""GGUF's value types (``gguf.GGUFValueType``) of a fixed size, as struct formats."""

Field = tuple[Any, int, int | None]
"""A field's value, its value type and, for an array, its items' type."""


class HeaderError(ValueError):
    """The file is not a GGUF file, or its header is cut short or damaged."""


class TensorInfo(NamedTuple):
    """Where one tensor's data lies in the file."""

    name: str
    ggml_type: int
    """``gguf.GGMLQuantizationType``'s value."""
    dims: tuple[int, ...]
    """GGUF's order: the innermost (contiguous) dimension first."""
    offset: int
    """From the start of the file."""


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise HeaderError(f"the header ends early (at byte {self.at})")
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def raw(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.buf):
            raise HeaderError(f"a value runs past the end of the file (at byte {self.at})")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def string(self) -> str:
        data = self.raw(self.take("<Q"))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HeaderError(f"a string is not UTF-8 (at byte {self.at})") from exc

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == STRING:
            if keep:
                return self.string()
            self.raw(self.take("<Q"))
            return None
        raise HeaderError(f"unknown value type {vtype} (at byte {self.at})")

    def array(self, keep: bool) -> tuple[Any, int]:
        sub, n = self.take("<I"), self.take("<Q")
        if sub in _SCALARS:
            width = struct.calcsize(_SCALARS[sub])
            data = self.raw(n * width)
            return (np.frombuffer(data, _SCALARS[sub]).tolist() if keep else None), sub
        if sub == STRING:
            if keep:
                return [self.string() for _ in range(n)], sub
            for _ in range(n):
                self.raw(self.take("<Q"))
            return None, sub
        raise HeaderError(f"unsupported array of type {sub} (at byte {self.at})")


def read_header(path: str | Path, wanted: Callable[[str], bool]) -> dict[str, Field]:
    """The header fields of the GGUF file at ``path`` whose key ``wanted`` accepts:
    ``{key: (value, type, item type)}``, arrays as lists. Raises :class:`HeaderError`
    for a file that is not GGUF or whose header is damaged, ``OSError`` if unreadable."""
    return read_tensors(path, wanted, tensors=False)[0]


def read_tensors(
    path: str | Path, wanted: Callable[[str], bool], *, tensors: bool = True
) -> tuple[dict[str, Field], list[TensorInfo]]:
    """:func:`read_header`'s fields, and where each tensor's data lies (as
    ``gguf.GGUFReader`` places them: after the descriptions, at the file's alignment)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if not size:
            raise HeaderError("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cursor = _Cursor(buf)
            count, fields = _fields(cursor, lambda key: key == "general.alignment" or wanted(key))
            alignment = fields.get("general.alignment", (32, 4, None))[0]
            if not wanted("general.alignment"):
                fields.pop("general.alignment", None)
            if not tensors:
                return fields, []
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                raise HeaderError(f"general.alignment {alignment!r} is not a power of two")
            described = [_tensor(cursor) for _ in range(count)]
            start = -(-cursor.at // alignment) * alignment
            out = [t._replace(offset=start + t.offset) for t in described]
            if len({t.name for t in out}) != len(out):
                raise HeaderError("two tensors have one name")
            return fields, out


def _tensor(cursor: _Cursor) -> TensorInfo:
    name = cursor.string()
    n_dims = cursor.take("<I")
    if n_dims > 8:
        raise HeaderError(f"tensor {name!r} has {n_dims} dimensions")
    dims = tuple(cursor.take("<Q") for _ in range(n_dims))
    return TensorInfo(name, cursor.take("<I"), dims, cursor.take("<Q"))


def _fields(cursor: _Cursor, wanted: Callable[[str], bool]) -> tuple[int, dict[str, Field]]:
    if cursor.raw(4) != b"GGUF":
        raise HeaderError("not a GGUF file (no GGUF magic)")
    version = cursor.take("<I")
    if version not in (2, 3):
        raise HeaderError(f"GGUF version {version} is not one this reads (2 or 3)")
    count = cursor.take("<Q")  # the tensors' descriptions follow the fields
    fields: dict[str, Field] = {}
    for _ in range(cursor.take("<Q")):
        key = cursor.string()
        keep = wanted(key)
        vtype = cursor.take("<I")
        if vtype == ARRAY:
            value, sub = cursor.array(keep)
            if keep:
                fields[key] = (value, vtype, sub)
        else:
            value = cursor.value(vtype, keep)
            if keep:
                fields[key] = (value, vtype, None)
    return count, fields
