"""The key sketches of a long context's blocks, packed side by side (see
:class:`kvrt.policy.KeySketches`).

Scoring a thousand blocks a turn reads every sketch: packed in one arena, a turn reads
them where they lie, instead of gathering a thousand small arrays into one (which took as
long as the scoring itself). A block's slot is written once, when its sketch is made, with
its vectors' squared lengths beside it; the slots of blocks the context no longer holds
are reused.

Every slot of the arena takes memory, written or not (a slot is a column: writing one
touches every row's page), and growing it holds the old and the new arena at once. So a
context says how many blocks it has before it is sketched (:meth:`SketchStore.reserve`),
the arena is sized once for them, and what it reports is what it holds.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

import numpy as np
import numpy.typing as npt

from .._types import KeySketch, KeySketches

__all__ = ["SketchStore"]

_FIRST_SLOTS = 64
_ROUND_SLOTS = 64  # a reservation's unit: a context grown by a few blocks fits again


class SketchStore:
    """Sketches by block key, in one packed arena."""

    def __init__(self) -> None:
        self._want = 0
        self._clear()

    def _clear(self) -> None:
        self._slot: dict[Hashable, int] = {}
        self._free: list[int] = []
        self._used = 0
        self._keys: npt.NDArray[np.int8] | None = None
        self._scale: npt.NDArray[np.float32] | None = None
        self._norms: npt.NDArray[np.float32] | None = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def nbytes(self) -> int:
        """Bytes the arena takes: every slot, holding a sketch, freed for reuse or not
        written yet (the arena never shrinks while a sketch is held)."""
        if self._keys is None or self._scale is None or self._norms is None:
            return 0
        return self._keys.nbytes + self._scale.nbytes + self._norms.nbytes

    def reserve(self, n: int) -> None:
        """Size the arena for ``n`` sketches held at once (a context's blocks), in one
        allocation when the first is put, or one growth where it holds fewer slots."""
        self._want = -(-max(n, 1) // _ROUND_SLOTS) * _ROUND_SLOTS

    def put(self, key: Hashable, sketch: object) -> None:
        """Keep ``sketch`` (a :class:`KeySketch`, or its vectors) as ``key``'s. A sketch of
        another shape than those held (another model's) empties the store first."""
        one = sketch if isinstance(sketch, KeySketch) else KeySketch.quantize(np.asarray(sketch))
        if self._keys is not None and self._keys.shape[:4] != one.keys.shape:
            self._clear()
        slot = self._slot.get(key)
        if slot is None:
            slot = self._free.pop() if self._free else self._take(one.keys.shape)
            self._slot[key] = slot
        assert self._keys is not None and self._scale is not None and self._norms is not None
        self._keys[..., slot] = one.keys
        self._scale[..., slot] = one.scale
        wide = one.keys.astype(np.float32)
        self._norms[..., slot] = np.einsum("lhvd,lhvd->lhv", wide, wide)

    def keep(self, keys: Collection[Hashable]) -> None:
        """Forget every sketch but those of ``keys``: their slots are reused, and the
        arena is given back once none is held."""
        for key in [k for k in self._slot if k not in keys]:
            self._free.append(self._slot.pop(key))
        if not self._slot:
            self._clear()

    def select(self, keys: Sequence[Hashable]) -> KeySketches:
        """The sketches of ``keys``, in order (None where one has none), packed."""
        slots = np.array([self._slot.get(k, -1) for k in keys], dtype=np.intp)
        if self._keys is None or self._scale is None or self._norms is None:
            none = np.zeros((0, 0, 0, 0), dtype=np.float32)
            return KeySketches(np.zeros((0, 0, 0, 0, 0), dtype=np.int8), none, none, slots)
        used = self._used
        return KeySketches(
            self._keys[..., :used], self._scale[..., :used], self._norms[..., :used], slots
        )

    def _take(self, shape: tuple[int, ...]) -> int:
        """A new slot for sketches of ``shape``, the arena grown where it is full: to the
        reservation, or by half again past it."""
        held = 0 if self._keys is None else int(self._keys.shape[4])
        if self._used == held:
            n_layer, n_head, vectors, dim = shape
            slots = self._want if self._want > held else max(_FIRST_SLOTS, held + held // 2)
            keys = np.empty((n_layer, n_head, vectors, dim, slots), dtype=np.int8)
            scale = np.empty((n_layer, n_head, vectors, slots), dtype=np.float32)
            norms = np.empty((n_layer, n_head, vectors, slots), dtype=np.float32)
            if self._keys is not None and self._scale is not None and self._norms is not None:
                keys[..., :held] = self._keys
                scale[..., :held] = self._scale
                norms[..., :held] = self._norms
            self._keys, self._scale, self._norms = keys, scale, norms
        self._used += 1
        return self._used - 1
