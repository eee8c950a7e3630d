"""Thin synchronous wrappers over OpenVINO's public API for stateful LLM IRs.

A stateful IR (as ``openvino_genai.LLMPipeline(..., enable_save_ov_model=True)`` writes
it) keeps each layer's keys and values in state variables shaped
``[batch, kv_heads, seq, head_dim]``. The state is a plain sequence of cache entries:
removing entries and splicing them back is exact; moving them to other positions means
re-rotating keys (RoPE), done here in numpy with the frequencies read from the IR itself.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import openvino as ov

from ._errors import BridgeArgumentError, BridgeCallError, BridgeLoadError

__all__ = [
    "COLD_BYTES",
    "DETERMINISTIC",
    "KV_PRECISIONS",
    "OvModel",
    "OvRequest",
    "OvRows",
    "pack",
    "rotate_keys",
    "unpack",
    "unrotate_keys",
]

DETERMINISTIC: Final[dict[str, str]] = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
}
"""Compile settings under which trimming and re-importing KV state is bit-exact."""

KV_PRECISIONS: Final[dict[str, int]] = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1}
"""KV cache precisions kvrt compiles for, with the bytes each value takes in the cache."""
COLD_BYTES: Final[dict[str, int]] = {"f32": 4, "f16": 2, "bf16": 4, "u8": 4}
"""Bytes each value takes once read out (:meth:`OvRequest.take`): the state reads back as
f32; an f16 cache's values are kept as f16 (lossless), a bf16 cache reads back with full
f32 mantissas on this plugin, and a u8 cache's dequantized values are not u8 codes."""
_STATE = re.compile(r"^past_key_values\.(\d+)\.(key|value)")


def _find_rope(model: ov.Model) -> tuple[npt.NDArray[np.float32], str]:
    """The inverse frequencies feeding the model's Sin/Cos, and how rotary halves are laid out."""
    sin = [op for op in model.get_ops() if op.get_type_name() == "Sin"]
    if not sin:
        raise BridgeLoadError(
            "the IR has no rotary embedding (no Sin op): kvrt cannot re-rotate its keys"
        )
    inv_freq: npt.NDArray[np.float32] | None = None
    stack = [sin[0]]
    seen: set[str] = set()
    while stack and inv_freq is None:
        node = stack.pop()
        if node.get_friendly_name() in seen:
            continue
        seen.add(node.get_friendly_name())
        if node.get_type_name() == "Constant":
            data = np.asarray(node.get_data())
            if data.ndim == 3 and data.shape[0] == 1 and data.shape[2] == 1 and data.shape[1] > 1:
                inv_freq = data.reshape(-1).astype(np.float32)
            continue
        stack.extend(i.get_source_output().get_node() for i in node.inputs())
    if inv_freq is None:
        raise BridgeLoadError("could not find the rotary frequencies in the IR")
    half = inv_freq.size
    layout = "half"
    for op in model.get_ops():
        if op.get_type_name() == "Slice":
            ins = [i.get_source_output().get_node() for i in op.inputs()]
            if len(ins) >= 4 and all(n.get_type_name() == "Constant" for n in ins[1:4]):
                start, _stop, step = (
                    int(np.asarray(n.get_data()).reshape(-1)[0]) for n in ins[1:4]
                )
                if step == 2 and start in (0, 1):
                    layout = "interleaved"
                    break
                if start == half and step == 1:
                    layout = "half"
    return inv_freq, layout


def pack(kv: npt.NDArray[np.float32], kv_precision: str) -> npt.NDArray[Any]:
    """State values at the cache's precision when that loses nothing, else as f32.

    An f16 cache reads back as f32 values that f16 represents exactly; other caches (a
    bf16 cache reads back with full f32 mantissas on this plugin) stay f32.
    """
    if kv_precision == "f16":
        half = kv.astype(np.float16)
        if np.array_equal(half.astype(np.float32), kv):
            return half
    return kv


def unpack(kv: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Back to f32 state values."""
    return np.asarray(kv, dtype=np.float32)


def _rotate(
    keys: npt.NDArray[np.float32], angles: npt.NDArray[np.float64], layout: str
) -> npt.NDArray[np.float32]:
    """A copy of ``keys [..., head_dim]`` with its rotary dims turned by ``angles``
    (broadcast against ``[..., head_dim / 2]``)."""
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    rot = angles.shape[-1] * 2
    out = np.array(keys, dtype=np.float32, copy=True)
    k = out[..., :rot].copy()
    if layout == "half":
        k1, k2 = k[..., : rot // 2], k[..., rot // 2 :]
        out[..., : rot // 2] = k1 * cos - k2 * sin
        out[..., rot // 2 : rot] = k2 * cos + k1 * sin
    else:
        k1, k2 = k[..., 0::2], k[..., 1::2]
        out[..., 0:rot:2] = k1 * cos - k2 * sin
        out[..., 1:rot:2] = k2 * cos + k1 * sin
    return out


def rotate_keys(
    keys: npt.NDArray[np.float32], delta: int, inv_freq: npt.NDArray[np.float32], layout: str
) -> npt.NDArray[np.float32]:
    """Keys rotated by ``delta`` positions (RoPE composes: R(p + d) = R(d) R(p))."""
    if delta == 0:
        return keys
    return _rotate(keys, np.float64(delta) * inv_freq.astype(np.float64), layout)


def unrotate_keys(
    keys: npt.NDArray[np.float32],
    positions: npt.NDArray[np.int64],
    inv_freq: npt.NDArray[np.float32],
    layout: str,
) -> npt.NDArray[np.float32]:
    """Keys ``[..., token, head_dim]`` at ``positions`` rotated back to position 0."""
    if keys.shape[-2] != positions.size:
        raise BridgeArgumentError(f"{positions.size} positions for {keys.shape[-2]} keys")
    angles = -positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    return _rotate(keys, angles, layout)


class OvModel:
    """A stateful LLM IR compiled once, shared by every request made from it."""

    def __init__(self, xml_path: str, *, config: dict[str, str], device: str = "CPU") -> None:
        if not os.path.isfile(xml_path):
            raise BridgeLoadError(f"no OpenVINO IR at {xml_path}")
        try:
            core = ov.Core()
            model = core.read_model(xml_path)
        except Exception as exc:  # OpenVINO raises RuntimeError subclasses with long texts
            raise BridgeLoadError(
                f"OpenVINO could not read {xml_path}: {str(exc).splitlines()[0]}"
            ) from exc
        names = {i.get_any_name() for i in model.inputs}
        missing = {"input_ids", "attention_mask", "position_ids", "beam_idx"} - names
        if missing:
            raise BridgeLoadError(
                f"{xml_path} is not a stateful LLM IR (missing inputs: {', '.join(sorted(missing))})"
            )
        layers: dict[int, dict[str, str]] = {}
        shape: Any = None
        for op in model.get_ops():
            if op.get_type_name() == "ReadValue":
                var = op.get_variable_id()
                match = _STATE.match(var)
                if match is None:
                    raise BridgeLoadError(f"unexpected state variable {var!r} in {xml_path}")
                layers.setdefault(int(match[1]), {})[match[2]] = var
                shape = op.get_output_partial_shape(0)
        if not layers or any(len(kv) != 2 for kv in layers.values()):
            raise BridgeLoadError(f"{xml_path} has no per-layer key and value state")
        self.n_layers = len(layers)
        self.state_names: list[tuple[str, str]] = [
            (layers[i]["key"], layers[i]["value"]) for i in sorted(layers)
        ]
        self.n_kv_heads = int(shape[1].get_length())
        self.head_dim = int(shape[3].get_length())
        self.n_vocab = int(model.output("logits").get_partial_shape()[2].get_length())
        self.inv_freq, self.rotary_layout = _find_rope(model)
        # The CPU plugin's runtime cache outlives the compiled model: with it, every model
        # compiled and released kept ~16 MB (measured over runtime open/close cycles);
        # without it, RSS stays flat and decode speed is unchanged (measured).
        config = {"CPU_RUNTIME_CACHE_CAPACITY": "0", **config}
        try:
            self._compiled = core.compile_model(model, device, config)
        except Exception as exc:
            raise BridgeLoadError(
                f"OpenVINO could not compile {xml_path}: {str(exc).splitlines()[0]}"
            ) from exc
        self.kv_precision = self._compiled.get_property("KV_CACHE_PRECISION").get_type_name()
        self.inference_precision = self._compiled.get_property(
            "INFERENCE_PRECISION_HINT"
        ).get_type_name()
        self.path = xml_path

    def request(self) -> OvRequest:
        if self._compiled is None:
            raise BridgeArgumentError("the model is closed")
        return OvRequest(self)

    def close(self) -> None:
        """Release the compiled model (its weights and kernels); requests must be closed."""
        self._compiled = None


class OvRequest:
    """One infer request: one KV state, driven by one owner at a time."""

    def __init__(self, model: OvModel) -> None:
        self._model = model
        self._req: Any = model._compiled.create_infer_request()
        self._busy = threading.Lock()
        self._closed = False
        self._length = 0
        self._beam = ov.Tensor(np.zeros(1, dtype=np.int32))

    @contextmanager
    def _use(self) -> Iterator[Any]:
        if self._closed:
            raise BridgeArgumentError("the request is closed")
        if not self._busy.acquire(blocking=False):
            raise BridgeArgumentError("the request is in use by another thread")
        try:
            yield self._req
        finally:
            self._busy.release()

    @property
    def length(self) -> int:
        """Cache entries in the state."""
        return self._length

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._use():
            self._req = None
            self._closed = True

    def infer(self, tokens: Sequence[int], positions: Sequence[int]) -> npt.NDArray[np.float32]:
        """Append ``tokens`` at ``positions``; the logits after the last one."""
        ids = np.asarray(tokens, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or pos.shape != ids.shape:
            raise BridgeArgumentError("tokens and positions must be equal, non-empty 1-D sequences")
        if ids.min() < 0 or ids.max() >= self._model.n_vocab:
            raise BridgeArgumentError(f"token ids must be in [0, {self._model.n_vocab})")
        with self._use() as req:
            try:
                req.set_tensor("input_ids", ov.Tensor(ids[None]))
                req.set_tensor("position_ids", ov.Tensor(pos[None]))
                req.set_tensor(
                    "attention_mask",
                    ov.Tensor(np.ones((1, self._length + ids.size), dtype=np.int64)),
                )
                req.set_tensor("beam_idx", self._beam)
                req.infer()
                logits = np.array(req.get_tensor("logits").data[0, -1], dtype=np.float32)
            except Exception as exc:
                raise BridgeCallError(
                    f"OpenVINO inference failed: {str(exc).splitlines()[0]}"
                ) from exc
            self._length += ids.size
            return logits

    def _states(self, req: Any) -> dict[str, Any]:
        return {s.name: s for s in req.query_state()}

    def take(self, start: int, end: int) -> npt.NDArray[Any]:
        """Entries [start, end) of every layer's keys and values, in one contiguous buffer.

        Layout: ``[layer, key|value, kv_heads, end - start, head_dim]``, stored at the
        cache's own precision (see :func:`pack`): the state reads back as f32, but an f16
        or bf16 cache only holds values those types represent, so nothing is lost.
        """
        self._check(start, end)
        m = self._model
        out = np.empty((m.n_layers, 2, m.n_kv_heads, end - start, m.head_dim), dtype=np.float32)
        with self._use() as req:
            states = self._states(req)
            for layer, names in enumerate(m.state_names):
                for j, name in enumerate(names):
                    out[layer, j] = states[name].state.data[0, :, start:end]
        return pack(out, m.kv_precision)

    def remove(self, start: int, end: int) -> None:
        """Drop entries [start, end) from every layer; later entries move down."""
        self._check(start, end)
        with self._use() as req:
            for state in req.query_state():
                data = state.state.data
                state.state = ov.Tensor(
                    np.ascontiguousarray(
                        np.concatenate([data[:, :, :start], data[:, :, end:]], axis=2)
                    )
                )
            self._length -= end - start

    def insert(self, index: int, blocks: Sequence[npt.NDArray[Any]]) -> None:
        """Splice buffers shaped like :meth:`take`'s (adjacent, in order) in before entry
        ``index``; f16 buffers are widened layer by layer as they are merged."""
        m = self._model
        for block in blocks:
            if (
                block.ndim != 5
                or block.shape[:3] != (m.n_layers, 2, m.n_kv_heads)
                or block.shape[4] != m.head_dim
                or block.dtype not in (np.float16, np.float32)
            ):
                raise BridgeArgumentError(
                    f"KV block shape {block.shape} ({block.dtype}) does not fit this model "
                    f"({m.n_layers} layers, {m.n_kv_heads} KV heads, head dim {m.head_dim})"
                )
        if not 0 <= index <= self._length:
            raise BridgeArgumentError(f"insert index {index} is outside [0, {self._length}]")
        with self._use() as req:
            states = self._states(req)
            for layer, names in enumerate(m.state_names):
                for j, name in enumerate(names):
                    state = states[name]
                    data = (
                        state.state.data
                        if self._length
                        else np.empty((1, m.n_kv_heads, 0, m.head_dim), np.float32)
                    )
                    parts = [data[:, :, :index], *(b[layer, j][None] for b in blocks)]
                    merged = np.concatenate([*parts, data[:, :, index:]], axis=2, dtype=np.float32)
                    state.state = ov.Tensor(merged)
            self._length += sum(b.shape[3] for b in blocks)

    def rotate(self, start: int, end: int, delta: int) -> None:
        """Re-rotate the keys of entries [start, end) by ``delta`` positions."""
        self._check(start, end)
        m = self._model
        with self._use() as req:
            states = self._states(req)
            for key_name, _ in m.state_names:
                state = states[key_name]
                data = np.array(state.state.data)
                data[:, :, start:end] = rotate_keys(
                    data[:, :, start:end], delta, m.inv_freq, m.rotary_layout
                )
                state.state = ov.Tensor(data)

    def reset(self) -> None:
        with self._use() as req:
            req.reset_state()
            self._length = 0

    def _check(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self._length:
            raise BridgeArgumentError(
                f"entry range [{start}, {end}) is outside [0, {self._length})"
            )


class OvRows:
    """Sequences held as rows of one infer request and stepped together, a token a row
    in one ``infer``: what windows decoding at once run on this IR.

    Rows are loaded together (:meth:`load`), each padded on the left to the longest with
    masked entries. A step gives every row an entry: a row with no token this step gets
    a stand-in, masked from then on, so each row's attention sees exactly its own
    entries. (Whether a row's logits then equal its own request's, bit for bit, is what
    the kernel probe measures.) The plugin's state is a copy on every read and write, so
    loading and reading rows cost a pass over every row's entries."""

    def __init__(self, model: OvModel) -> None:
        if model._compiled is None:
            raise BridgeArgumentError("the model is closed")
        self._model = model
        self._req: Any = model._compiled.create_infer_request()
        self._mask = np.zeros((0, 0), dtype=bool)

    @property
    def rows(self) -> int:
        return int(self._mask.shape[0])

    @property
    def width(self) -> int:
        """Entries a row spans, its padding and stand-ins included."""
        return int(self._mask.shape[1])

    def load(self, parts: Sequence[npt.NDArray[Any]]) -> None:
        """Hold ``parts`` (entries as :meth:`OvRequest.take` gives them), a row each, in
        place of what the rows held."""
        m = self._model
        if not parts or any(
            p.ndim != 5 or p.shape[:3] != (m.n_layers, 2, m.n_kv_heads) or p.shape[4] != m.head_dim
            for p in parts
        ):
            raise BridgeArgumentError("rows are loaded from entries shaped as take() gives them")
        width = max(p.shape[3] for p in parts)
        if width == 0:
            raise BridgeArgumentError("rows start from at least one entry")
        mask = np.zeros((len(parts), width), dtype=bool)
        for row, p in enumerate(parts):
            mask[row, width - p.shape[3] :] = True
        shape = (len(parts), m.n_kv_heads, width, m.head_dim)
        try:
            for state in self._req.query_state():
                layer, part = self._where(state.name)
                data = np.zeros(shape, dtype=np.float32)
                for row, p in enumerate(parts):
                    data[row, :, width - p.shape[3] :] = p[layer, part]
                state.state = ov.Tensor(data)
        except BridgeArgumentError:
            raise
        except Exception as exc:
            raise BridgeCallError(f"OpenVINO refused the rows: {str(exc).splitlines()[0]}") from exc
        self._mask = mask

    def entries(self, row: int, start: int = 0) -> npt.NDArray[np.float32]:
        """Row ``row``'s entries from its ``start``-th on, shaped as :meth:`OvRequest.take`
        gives them (f32)."""
        m = self._model
        columns = np.flatnonzero(self._mask[row])[start:]
        out = np.empty((m.n_layers, 2, m.n_kv_heads, columns.size, m.head_dim), np.float32)
        for state in self._req.query_state():
            layer, part = self._where(state.name)
            out[layer, part] = state.state.data[row][:, columns]
        return out

    def step(
        self, tokens: Sequence[int | None], positions: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        """Row ``i`` advanced by ``tokens[i]`` at ``positions[i]`` (None: a stand-in,
        masked once computed); the logits ``[rows, vocab]``."""
        rows = self.rows
        if len(tokens) != rows or len(positions) != rows:
            raise BridgeArgumentError(f"{len(tokens)} tokens for {rows} rows")
        ids = np.array([0 if t is None else t for t in tokens], dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self._model.n_vocab:
            raise BridgeArgumentError(f"token ids must be in [0, {self._model.n_vocab})")
        mask = np.concatenate([self._mask, np.ones((rows, 1), dtype=bool)], axis=1)
        req = self._req
        try:
            req.set_tensor("input_ids", ov.Tensor(ids[:, None]))
            req.set_tensor("position_ids", ov.Tensor(np.asarray(positions, np.int64)[:, None]))
            req.set_tensor("attention_mask", ov.Tensor(mask.astype(np.int64)))
            req.set_tensor("beam_idx", ov.Tensor(np.arange(rows, dtype=np.int32)))
            req.infer()
            logits = np.array(req.get_tensor("logits").data[:, -1], dtype=np.float32)
        except Exception as exc:
            raise BridgeCallError(f"OpenVINO inference failed: {str(exc).splitlines()[0]}") from exc
        mask[:, -1] = [t is not None for t in tokens]
        self._mask = mask
        return logits

    def close(self) -> None:
        self._req = None
        self._mask = np.zeros((0, 0), dtype=bool)

    def _where(self, name: str) -> tuple[int, int]:
        for layer, names in enumerate(self._model.state_names):
            if name in names:
                return layer, names.index(name)
        raise BridgeArgumentError(f"unexpected state variable {name!r}")
