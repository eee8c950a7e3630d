"""One OpenVINO infer request as a hot window.

The request's state is a plain sequence of cache entries in position order, so record
entry ``i`` is state entry ``i``. Gap eviction removes entries (every other token keeps its
position, and the attention mask covers exactly the entries left); in-place admission
splices them back (bit-exact); slide eviction and tail admission re-rotate keys in numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrt import ColdBlockMismatchError, EngineError
from kvrt.backend import Capabilities, ColdBlock, Logits, ModelFacts
from kvrt.native_bridge.openvino import OvModel, OvRequest, rotate_keys, unpack, unrotate_keys

from .._errors import translate_errors
from .._given import check_tokens
from .._sketch import QUERY_TOKENS, block_sketch
from .._window import KvWindow
from ._probe import stepping
from ._rows import Rows

__all__ = ["EXACT_KV", "OpenVinoEngineContext"]

EXACT_KV = ("f32", "f16", "bf16")
"""KV precisions whose values survive export and re-import unchanged."""


class OpenVinoEngineContext(KvWindow):
    def __init__(
        self,
        model: OvModel,
        facts: ModelFacts,
        budget: int,
        chunk: int,
        is_end: Callable[[int], bool],
        *,
        rows: Rows | None = None,
    ) -> None:
        super().__init__(facts, budget)
        self._model = model
        self._own: OvRequest = model.request()
        self._rows = rows
        self._chunk = chunk
        self._is_end_token = is_end
        self._last_logits: Logits | None = None
        self._probe: OvRequest | None = None
        self._probe_tokens: list[int] = []

    # -- stepping beside other windows (see :mod:`._rows`) --

    @property
    def _req(self) -> OvRequest:
        """The window's own request, with the window brought home first if it is away."""
        if self.away:
            self._come_home()
        return self._own

    @property
    def joins(self) -> bool:
        """The engine offers this window steps beside others' (see :mod:`._rows`)."""
        return self._rows is not None

    @property
    def away(self) -> bool:
        """The window is in the engine's rows, stepping beside other windows."""
        return self._rows is not None and self._rows.holds(self)

    def check_step(self, token: int) -> None:
        """Refuse a step of ``token`` as :meth:`step` would, before it joins others'."""
        check_tokens([token], self._facts.n_vocab)
        self._check_room(1, "decoding a token")
        if not self._tokens:
            raise EngineError("no logits: decode something first")

    def home_entries(self) -> npt.NDArray[Any]:
        """Every entry of the window's own request (what its row starts from)."""
        with translate_errors("reading the window"):
            return self._own.take(0, self._own.length)

    def _keep_logits(self, logits: Logits) -> None:
        self._last_logits = logits

    def settle(self) -> None:
        """Bring the window home from its row, if it is in one."""
        if self.away:
            self._come_home()

    def _come_home(self) -> None:
        """Append the entries the window gained in its row to its own request; if that
        fails, the window is left empty."""
        assert self._rows is not None
        try:
            gained = self._rows.leave(self)
        except BaseException:
            self.clear()
            raise
        self.took_home(gained)

    def took_home(self, gained: npt.NDArray[np.float32] | None) -> None:
        """Append ``gained``, the entries the window gained in its row, to its own
        request (None: they could not be read); where that fails, the window is left
        empty."""
        try:
            with translate_errors("bringing a window back from its row"):
                if gained is None:
                    raise EngineError("the window's row could not be read")
                if gained.shape[3]:
                    self._own.insert(self._own.length, [gained])
        except BaseException:
            self.clear()
            raise

    @property
    def can_shift(self) -> bool:
        return True

    @property
    def chunk_tokens(self) -> int:
        return self._chunk

    @property
    def exact(self) -> bool:
        return self._facts.kv_type in EXACT_KV

    @property
    def capabilities(self) -> Capabilities:
        notes = ["tail admission re-rotates keys in numpy: argmax-equal, not bit-exact"]
        kernels = self._facts.kernels
        if kernels is not None:
            notes += [f"kernels: {kernels.reason}", stepping(kernels, joins=self.joins)]
        if not self.exact:
            notes.append(
                f"{self._facts.kv_type} KV cache re-quantizes on import: cold restores are approximate"
            )
            notes.append("cold blocks of a quantized cache are kept as f32 (4 bytes per value)")
        elif self._facts.kv_type == "bf16":
            notes.append("cold blocks of a bf16 cache are kept as f32 (4 bytes per value)")
        return Capabilities(
            remove_middle=True,
            position_shift=True,
            exact_in_place=self.exact,
            exact_tail=False,
            sliding_window=None,
            kv_type=self._facts.kv_type,
            notes=tuple(notes),
        )

    def _is_end(self, token: int) -> bool:
        return self._is_end_token(token)

    def _compute(self, chunk: list[int], start: int) -> None:
        with translate_errors("inference"):
            self._last_logits = self._req.infer(chunk, range(start, start + len(chunk)))

    def _after_failure(self) -> None:
        pass  # a failed infer appends nothing to the state

    def _read_logits(self) -> Logits:
        if self._last_logits is None:
            raise EngineError("no logits: decode something first")
        return self._last_logits.copy()

    def _remove(self, i: int, j: int, start: int, end: int, shift_tail: bool) -> int:
        with translate_errors(f"evicting [{start}, {end})"):
            self._req.remove(i, j)
            if shift_tail and i < self._req.length:
                self._req.rotate(i, self._req.length, start - end)
        return i

    def _take(self, i: int, j: int, start: int, end: int) -> npt.NDArray[np.uint8]:
        with translate_errors(f"exporting [{start}, {end})"):
            return self._req.take(i, j).reshape(-1).view(np.uint8)

    def _take_run(
        self, i: int, pieces: Sequence[tuple[int, int]], start: int, end: int
    ) -> list[npt.NDArray[np.uint8]] | None:
        # Reading the state costs the same for one entry or many: read the run once.
        with translate_errors(f"exporting [{start}, {end})"):
            whole = self._req.take(i, i + pieces[-1][1])
        return [
            np.ascontiguousarray(whole[:, :, :, a:b]).reshape(-1).view(np.uint8) for a, b in pieces
        ]

    def _stored(self, block: ColdBlock) -> npt.NDArray[Any]:
        """The block's values as stored (f16 where that was lossless, else f32), shaped
        like the state: a view of the read-only cold bytes."""
        m = self._model
        n = block.meta.n_tokens
        values = m.n_layers * 2 * m.n_kv_heads * n * m.head_dim
        sizes: dict[int, np.dtype[Any]] = {
            values * 2: np.dtype(np.float16),
            values * 4: np.dtype(np.float32),
        }
        stored = sizes.get(block.data.size)
        if stored is None:
            raise ColdBlockMismatchError(
                f"cold block holds {block.data.size} bytes; {n} tokens of this model take "
                f"{values * 2} (f16) or {values * 4} (f32)"
            )
        return block.data.view(stored).reshape(m.n_layers, 2, m.n_kv_heads, n, m.head_dim)

    def _put_run(self, blocks: Sequence[ColdBlock], i: int) -> bool:
        # The state is rewritten whole on every splice: splice a run once, not per block,
        # widening each block straight into the merged state.
        stored = [self._stored(block) for block in blocks]
        with translate_errors(f"admitting [{blocks[0].meta.start}, {blocks[-1].meta.end})"):
            self._req.insert(i, stored)
        return True

    def _put(self, block: ColdBlock, i: int, target: int, skip: int = 0) -> None:
        m = self._model
        kv = self._stored(block)[:, :, :, skip:]
        if target != block.meta.start:
            kv = unpack(kv).copy()  # unpacking f32 blocks is a view of the read-only bytes
            kv[:, 0] = rotate_keys(kv[:, 0], target - block.meta.start, m.inv_freq, m.rotary_layout)
        with translate_errors(f"admitting [{block.meta.start}, {block.meta.end})"):
            self._req.insert(i, [kv])

    def _reset(self) -> None:
        if self._rows is not None:
            self._rows.abandon(self)  # emptied: what its row held goes too
        with translate_errors("clearing the request"):
            self._own.reset()
        self._last_logits = None

    @property
    def closed(self) -> bool:
        return self._own.closed

    # -- key sketches (kvrt.backend.KeySketching) --

    def _keys(self, kv: npt.NDArray[Any], positions: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        """``[layer, head, token, dim]`` keys of a state slice, RoPE undone."""
        m = self._model
        return unrotate_keys(unpack(kv)[:, 0], positions, m.inv_freq, m.rotary_layout)

    def key_sketches(self, ranges: Sequence[tuple[int, int]]) -> list[object | None]:
        out: list[object | None] = []
        for start, end in ranges:
            s, e, i, j = self._resident_slice(start, end)
            if j - i != e - s:
                out.append(None)
                continue
            with translate_errors(f"reading the keys of [{s}, {e})"):
                kv = self._req.take(i, j)
            out.append(block_sketch(self._keys(kv, np.arange(s, e, dtype=np.int64))))
        return out

    def cold_key_sketch(self, block: ColdBlock) -> object | None:
        if block.meta.fingerprint != self._facts.fingerprint:
            return None
        try:
            kv = self._stored(block)
        except ColdBlockMismatchError:
            return None
        meta = block.meta
        return block_sketch(self._keys(kv, np.arange(meta.start, meta.end, dtype=np.int64)))

    def query_sketch(self, tokens: Sequence[int]) -> object | None:
        """Keys of the last :data:`QUERY_TOKENS` of ``tokens``, computed alone in an infer
        request of their own (opened on first use); a query extending the previous one
        computes only its new tokens."""
        if not tokens:
            return None
        chunk = list(tokens)[-QUERY_TOKENS:]
        check_tokens(chunk, self._facts.n_vocab)
        with translate_errors("computing the query's keys"):
            if self._probe is None:
                self._probe = self._model.request()
            probe, held = self._probe, self._probe_tokens
            kept = len(held) if chunk[: len(held)] == held and len(chunk) > len(held) else 0
            self._probe_tokens = []
            if not kept or probe.length != kept:
                probe.reset()
                kept = 0
            probe.infer(chunk[kept:], range(kept, len(chunk)))
            kv = probe.take(0, len(chunk))
            self._probe_tokens = chunk
        return self._keys(kv, np.arange(len(chunk), dtype=np.int64))

    def close(self) -> None:
        if self._rows is not None:
            self._rows.abandon(self)  # nothing will read its row again
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if not self.closed:
            self._own.close()
