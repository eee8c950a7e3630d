"""llama.cpp's sequence state bytes read and rewritten: their keys with RoPE undone, their
cells put in position order, and their cells moved to other positions with the keys turned.

``llama_state_seq_get_data`` writes, for one sequence of a unified (single-stream) KV
cache: an 8-byte header, the stream count (``u32``, 1 here), the cell count, one record
per cell (position ``i32``, sequence count ``u32``, that many sequence ids ``i32``), then
the data: ``v_trans`` and the layer count (``u32`` each) and, per layer, the key type
(``i32``), the key row size (``u64``) and one key row per cell; the values follow. A model
with sliding-window layers writes two such parts after the header, one per KV cache (the
global layers', then the windowed layers'). Every length is checked before a byte is
interpreted, and the lengths must add up to the whole buffer, so foreign or truncated
bytes raise :class:`BridgeArgumentError` instead of yielding garbage.

Keys sit in the cache after RoPE (see :mod:`.rope`), and quantized keys after a Hadamard
rotation llama.cpp applies to spread their outliers (:func:`key_rotation`).
:func:`unrotate` turns keys back to position 0, so keys computed at different positions
can be compared; :func:`shift_cells` moves cells to other positions as a key shift does.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from ._errors import BridgeArgumentError
from .rope import ROPE_NEOX, ROPE_NORM, Rope, hadamard, turn

__all__ = [
    "ROPE_NEOX",
    "ROPE_NORM",
    "TURNABLE_KEY_TYPES",
    "KeyRows",
    "LayerRows",
    "StatePart",
    "key_rotation",
    "key_rotation_disabled",
    "order_cells",
    "read_keys",
    "shift_cells",
    "state_parts",
    "state_streams",
    "unrotate",
]

_HEADER: Final = 8
_GGML_F32: Final = 0
_GGML_F16: Final = 1
_GGML_Q8_0: Final = 8
_GGML_BF16: Final = 30


class KeyRows:
    """The keys of one exported sequence: ``keys[layer, cell, n_embd_k]`` and each cell's
    position."""

    __slots__ = ("keys", "positions")

    def __init__(self, keys: npt.NDArray[np.float32], positions: npt.NDArray[np.int64]) -> None:
        self.keys = keys
        self.positions = positions


def _dequantize(
    raw: npt.NDArray[np.uint8], k_type: int, n_cells: int, width: int
) -> npt.NDArray[np.float32]:
    if k_type == _GGML_F32:
        return raw.view(np.float32).reshape(n_cells, width)
    if k_type == _GGML_F16:
        return raw.view(np.float16).reshape(n_cells, width).astype(np.float32)
    if k_type == _GGML_BF16:
        wide = raw.view(np.uint16).astype(np.uint32) << 16
        return wide.view(np.float32).reshape(n_cells, width)
    if k_type == _GGML_Q8_0:  # blocks of 32: an f16 scale, then 32 int8
        blocks = raw.reshape(n_cells * width // 32, 34)
        scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        values = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (values * scale).reshape(n_cells, width)
    raise BridgeArgumentError(f"keys of ggml type {k_type} are not readable here")


def _row_bytes(k_type: int, width: int) -> int:
    if k_type == _GGML_F32:
        return 4 * width
    if k_type in (_GGML_F16, _GGML_BF16):
        return 2 * width
    if k_type == _GGML_Q8_0 and width % 32 == 0:
        return width // 32 * 34
    raise BridgeArgumentError(f"keys of ggml type {k_type} are not readable here")


class LayerRows(NamedTuple):
    """One layer of a state part: key and value types and bytes per cell, and where the
    layer's key rows start in the buffer."""

    k_type: int
    k_row: int
    v_type: int
    v_row: int
    k_offset: int


class StatePart(NamedTuple):
    """One KV cache's share of a sequence's state bytes: a model with sliding-window layers
    has two (the global layers' cache, then the windowed layers')."""

    positions: npt.NDArray[np.int64]
    v_trans: bool
    layers: tuple[LayerRows, ...]

    @property
    def bytes_per_token(self) -> int:
        """K plus V bytes one cell takes over this part's layers."""
        return sum(layer.k_row + layer.v_row for layer in self.layers)


def state_parts(data: npt.NDArray[np.uint8]) -> tuple[StatePart, ...]:
    """Parse the layout of sequence state bytes of a single-stream cache: one part per KV
    cache, each with its cells' positions and its layers' row sizes.

    Raises :class:`BridgeArgumentError` unless the lengths account for every byte.
    """
    parts = []
    for streams in state_streams(data):
        if len(streams) != 1:
            raise BridgeArgumentError(f"state bytes hold {len(streams)} streams, expected 1")
        parts.append(streams[0][0])
    return tuple(parts)


def state_streams(
    data: npt.NDArray[np.uint8],
) -> tuple[tuple[tuple[StatePart, int, int], ...], ...]:
    """Parse the layout of sequence state bytes of a cache of any number of streams (a
    context with ``kv_unified`` off has one a sequence): per KV cache, per stream, its
    layout and the span ``[begin, end)`` of its bytes (from its cell count on).

    Raises :class:`BridgeArgumentError` unless the lengths account for every byte.
    """
    if data.dtype != np.uint8 or data.ndim != 1:
        raise BridgeArgumentError("state bytes must be a 1-D uint8 array")
    raw = np.ascontiguousarray(data).data
    size = data.size
    off = _HEADER

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal off
        n = struct.calcsize(fmt)
        if off + n > size:
            raise BridgeArgumentError("state bytes end early")
        values = struct.unpack_from(fmt, raw, off)
        off += n
        return values

    def stream() -> StatePart:
        nonlocal off
        (n_cells,) = take("<I")
        if n_cells > size:
            raise BridgeArgumentError(f"state bytes claim {n_cells} cells")
        positions = np.empty(n_cells, dtype=np.int64)
        for i in range(n_cells):
            pos, n_seq = take("<iI")
            if n_seq > 64:
                raise BridgeArgumentError(f"a cell claims {n_seq} sequences")
            off += 4 * n_seq
            positions[i] = pos
        if n_cells == 0:  # an empty stream writes no data section
            return StatePart(positions, False, ())
        v_trans, n_layer = take("<II")
        # 0 layers: a cache with no layers of its kind (every layer of the model windowed
        # leaves the global cache empty of layers; its cells are still listed).
        if not 0 <= n_layer <= 4096:
            raise BridgeArgumentError(f"state bytes claim {n_layer} layers")
        keys: list[tuple[int, int, int]] = []
        for _ in range(n_layer):
            k_type, k_row = take("<iQ")
            keys.append((k_type, k_row, off))
            off += k_row * n_cells
        layers: list[LayerRows] = []
        for k_type, k_row, k_offset in keys:
            if v_trans:
                v_type, element, width = take("<iII")
                v_row = element * width
            else:
                v_type, v_row = take("<iQ")
            off += v_row * n_cells
            layers.append(LayerRows(k_type, k_row, v_type, v_row, k_offset))
        if off > size:
            raise BridgeArgumentError("state bytes end early")
        return StatePart(positions, bool(v_trans), tuple(layers))

    parts: list[tuple[tuple[StatePart, int, int], ...]] = []
    while off < size:
        if len(parts) >= 8:
            raise BridgeArgumentError("state bytes claim more than 8 caches")
        (n_stream,) = take("<I")
        if not 1 <= n_stream <= 256:
            raise BridgeArgumentError(f"state bytes claim {n_stream} streams")
        streams = []
        for _ in range(n_stream):
            begin = off
            part = stream()
            streams.append((part, begin, off))
        parts.append(tuple(streams))
    if off != size or not parts:
        raise BridgeArgumentError(f"state bytes hold {size} bytes, their layout says {off}")
    return tuple(parts)


def order_cells(data: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """The same sequence state bytes with each KV cache's cells in position order.

    llama.cpp writes a sequence's cells in the order they sit in its cache and reads them
    back into consecutive cells in that order; after evictions and restores into other
    holes that order is not the positions' order, and attention sums the cells in it. Bytes
    rewritten here load as a fresh context holds them: cell ``k`` of a context holding
    positions ``0...n-1`` holds position ``k``. Bytes already in order come back as they are.

    Raises :class:`BridgeArgumentError` for bytes :func:`state_parts` refuses, or whose
    cells belong to more than their own sequence.
    """
    parts = state_parts(data)
    if all(bool(np.all(np.diff(part.positions) > 0)) for part in parts):
        return data
    out = np.array(data, dtype=np.uint8, copy=True)
    off = _HEADER
    for part in parts:
        n = part.positions.size
        off += 8  # stream count, cell count
        if n == 0:
            continue
        order = np.argsort(part.positions, kind="stable")
        (n_seq,) = struct.unpack_from("<I", out.data, off + 4)
        size = 8 + 4 * n_seq
        records = out[off : off + size * n].reshape(n, size)
        if np.any(records[:, 4:8].view("<u4") != n_seq):
            raise BridgeArgumentError("state cells name different numbers of sequences")
        records[:] = records[order]
        off += size * n
        off += 8  # v_trans, layer count
        for layer in part.layers:
            off = layer.k_offset + layer.k_row * n
            rows = out[layer.k_offset : off].reshape(n, layer.k_row)
            rows[:] = rows[order]
        for layer in part.layers:
            if part.v_trans:
                off += 12  # value type, element size, width
                element = layer.v_row // _v_width(out, off - 4)
                cols = out[off : off + layer.v_row * n].reshape(-1, n, element)
                cols[:] = cols[:, order]
            else:
                off += 12  # value type, row size
                rows = out[off : off + layer.v_row * n].reshape(n, layer.v_row)
                rows[:] = rows[order]
            off += layer.v_row * n
    if off != data.size:
        raise BridgeArgumentError(f"state bytes hold {data.size} bytes, their layout says {off}")
    out.flags.writeable = False
    return out


def _v_width(buf: npt.NDArray[np.uint8], at: int) -> int:
    (width,) = struct.unpack_from("<I", buf.data, at)
    if width == 0:
        raise BridgeArgumentError("state bytes claim values of width 0")
    return int(width)


def read_keys(
    data: npt.NDArray[np.uint8], *, n_layer: int, n_embd_k: int, k_rotation: int | None = None
) -> KeyRows:
    """The keys in sequence state bytes of a single-stream cache of ``n_layer`` layers.

    ``k_rotation``: the Hadamard block llama.cpp rotated quantized keys by before storing
    them (see :func:`key_rotation`), undone here; None where keys are stored as computed.

    Raises :class:`BridgeArgumentError` when the bytes do not have that layout (another
    model, a multi-stream or sliding-window cache, an unreadable key type).
    """
    parts = state_parts(data)
    if len(parts) != 1:
        raise BridgeArgumentError(f"state bytes hold {len(parts)} caches, expected 1")
    part = parts[0]
    n_cells = part.positions.size
    if n_cells == 0:
        raise BridgeArgumentError("state bytes hold no cells")
    if len(part.layers) != n_layer:
        raise BridgeArgumentError(
            f"state bytes hold {len(part.layers)} layers, the model has {n_layer}"
        )
    buf = np.ascontiguousarray(data)
    keys = np.empty((n_layer, n_cells, n_embd_k), dtype=np.float32)
    for i, layer in enumerate(part.layers):
        if layer.k_row != _row_bytes(layer.k_type, n_embd_k):
            raise BridgeArgumentError(f"layer {i}: key rows of {layer.k_row} bytes do not fit")
        start = layer.k_offset
        raw = buf[start : start + layer.k_row * n_cells]
        keys[i] = _rotated(_dequantize(raw, layer.k_type, n_cells, n_embd_k), k_rotation)
    return KeyRows(keys, part.positions)


def key_rotation_disabled() -> bool:
    """Whether llama.cpp was told to store quantized keys unrotated (its
    ``LLAMA_ATTN_ROT_DISABLE`` variable, read as it reads it: an integer, non-zero)."""
    raw = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "")
    digits = raw.strip()
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    n = 0
    for ch in digits:  # atoi: leading digits only
        if not ch.isdigit():
            break
        n = n * 10 + int(ch)
    return sign * n != 0


def key_rotation(k_type: int, head_dims: set[int]) -> int | None:
    """The Hadamard block llama.cpp rotates keys of ``k_type`` by in a cache whose layers
    have heads of ``head_dims`` (``attn_rot_k`` in its KV cache): quantized keys with one
    head size, a multiple of 64, are rotated in blocks of that size's largest power-of-two
    factor, unless :func:`key_rotation_disabled`; other keys are stored as computed."""
    if k_type in (_GGML_F32, _GGML_F16, _GGML_BF16) or len(head_dims) != 1:
        return None
    if key_rotation_disabled():
        return None
    (size,) = head_dims
    if size % 64:
        return None
    block = 64
    while size % (block * 2) == 0:
        block *= 2
    return block


def _rotated(rows: npt.NDArray[np.float32], block: int | None) -> npt.NDArray[np.float32]:
    """Rows with each run of ``block`` values multiplied by the Hadamard matrix (its own
    inverse: the same call stores and restores)."""
    if block is None:
        return rows
    shape = rows.shape
    if shape[-1] % block:
        raise BridgeArgumentError(f"key rows of {shape[-1]} values do not split into {block}")
    return (rows.reshape(-1, block) @ hadamard(block)).reshape(shape).astype(np.float32)


def _encode(values: npt.NDArray[np.float32], k_type: int) -> npt.NDArray[np.uint8]:
    """Key rows as llama.cpp stores ``k_type`` (rounding as ggml does)."""
    if k_type == _GGML_F32:
        return (
            np.ascontiguousarray(values, dtype=np.float32)
            .view(np.uint8)
            .reshape(values.shape[0], -1)
        )
    if k_type == _GGML_F16:
        return values.astype(np.float16).view(np.uint8).reshape(values.shape[0], -1)
    if k_type == _GGML_BF16:  # round to nearest even, as ggml_compute_fp32_to_bf16
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> 16
        return rounded.astype(np.uint16).view(np.uint8).reshape(values.shape[0], -1)
    if k_type == _GGML_Q8_0:  # quantize_row_q8_0_ref: d = amax / 127, q = round(x / d)
        n_cells, width = values.shape
        blocks = values.reshape(-1, 32).astype(np.float32)
        d = np.abs(blocks).max(axis=1) / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        x = blocks * inv[:, None]
        q = (np.sign(x) * np.floor(np.abs(x) + 0.5)).astype(np.int8)
        out = np.empty((blocks.shape[0], 34), dtype=np.uint8)
        out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        out[:, 2:] = q.view(np.uint8)
        return out.reshape(n_cells, width // 32 * 34)
    raise BridgeArgumentError(f"keys of ggml type {k_type} are not written here")


TURNABLE_KEY_TYPES: Final = frozenset({_GGML_F32, _GGML_F16, _GGML_BF16, _GGML_Q8_0})
"""ggml types of keys :func:`shift_cells` can turn (read, rotate, write back)."""


def shift_cells(
    data: npt.NDArray[np.uint8],
    delta: int,
    ropes: Sequence[Rope],
    *,
    head_dim: int,
    k_rotations: Sequence[int | None],
) -> npt.NDArray[np.uint8]:
    """The same sequence state bytes with every cell ``delta`` positions later and its keys
    turned to match: one :class:`Rope` and one key rotation (:func:`key_rotation`) per
    KV cache in the bytes. Values are unchanged.

    This is llama.cpp's key shift done outside it: the keys turn by ``delta`` and keep
    their magnitude (its own shift multiplies YaRN and LongRoPE keys by the attention
    factor once more each time), and quantized keys of any head size work (its shift of
    those dereferences a missing rotation matrix unless heads are a multiple of 64).

    Raises :class:`BridgeArgumentError` for bytes :func:`state_parts` refuses, key types
    outside :data:`TURNABLE_KEY_TYPES`, or positions that would leave ``[0, 2**31)``.
    """
    parts = state_parts(data)
    if len(ropes) != len(parts) or len(k_rotations) != len(parts):
        raise BridgeArgumentError(f"{len(ropes)} ropes for {len(parts)} caches in the bytes")
    out = np.array(data, dtype=np.uint8, copy=True)
    off = _HEADER
    for part, rope, rotation in zip(parts, ropes, k_rotations, strict=True):
        n = part.positions.size
        off += 8  # stream count, cell count
        moved = part.positions + delta
        if n and (moved.min() < 0 or moved.max() >= 1 << 31):
            raise BridgeArgumentError(f"shifting by {delta} moves cells out of [0, 2**31)")
        for k in range(n):
            struct.pack_into("<i", out.data, off, int(moved[k]))
            (n_seq,) = struct.unpack_from("<I", out.data, off + 4)
            off += 8 + 4 * n_seq
        if n == 0:
            continue
        steps = np.full(n, delta, dtype=np.int64)
        for i, layer in enumerate(part.layers):
            if layer.k_type not in TURNABLE_KEY_TYPES:
                raise BridgeArgumentError(f"keys of ggml type {layer.k_type} are not turned here")
            width = _row_width(layer.k_type, layer.k_row)
            if width % head_dim:
                raise BridgeArgumentError(f"layer {i}: {width} key values are not whole heads")
            raw = out[layer.k_offset : layer.k_offset + layer.k_row * n]
            keys = _rotated(_dequantize(raw, layer.k_type, n, width), rotation)
            turned = turn(keys.reshape(n, width // head_dim, head_dim), steps, rope)
            raw[:] = _encode(_rotated(turned.reshape(n, width), rotation), layer.k_type).reshape(-1)
        off = _part_end(part, off)
    if off != data.size:
        raise BridgeArgumentError(f"state bytes hold {data.size} bytes, their layout says {off}")
    out.flags.writeable = False
    return out


def _part_end(part: StatePart, records_end: int) -> int:
    """Where a part's data ends, from the offset just past its cell records."""
    off = records_end + 8  # v_trans, layer count
    n = part.positions.size
    for layer in part.layers:
        off = layer.k_offset + layer.k_row * n
    for layer in part.layers:
        off += 12 + layer.v_row * n  # value type and row size (or element size, width)
    return off


def _row_width(k_type: int, k_row: int) -> int:
    """Values in a key row of ``k_row`` bytes of ``k_type``."""
    if k_type == _GGML_Q8_0:
        return k_row // 34 * 32
    return k_row // (4 if k_type == _GGML_F32 else 2)


def unrotate(
    keys: npt.NDArray[np.float32],
    positions: npt.NDArray[np.int64],
    rope: Rope,
    *,
    head_dim: int,
) -> npt.NDArray[np.float32]:
    """Keys ``[layer, token, heads * head_dim]`` turned back to position 0 by ``rope``, as
    ``[layer, head, token, head_dim]``."""
    if keys.shape[-1] % head_dim:
        raise BridgeArgumentError(
            f"keys of {keys.shape[-1]} values are not whole heads of {head_dim}"
        )
    n_layer, n_tok, width = keys.shape
    back = -positions.astype(np.int64)
    out = np.stack(
        [
            turn(keys[i].reshape(n_tok, width // head_dim, head_dim), back, rope)
            for i in range(n_layer)
        ]
    )
    return out.transpose(0, 2, 1, 3).copy()
