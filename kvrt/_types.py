"""Plain values shared by the runtime and the policies: cache classes, snapshots and key
sketches."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "ApproximateQuery",
    "BlockView",
    "CacheClass",
    "CheckpointView",
    "ColdEntryView",
    "KernelSetting",
    "KernelTrial",
    "KeySketch",
    "KeySketches",
    "PartialWindowQuery",
    "Residency",
    "RestoreQuery",
    "SequenceStep",
    "TurnView",
]


class CacheClass(enum.StrEnum):
    """How readily a segment's blocks leave the hot window (and the cold store).

    ``VOLATILE`` goes before ``REPO_MAP``, which goes before ``TASK_PINNED``.
    """

    VOLATILE = "volatile"
    REPO_MAP = "repo_map"
    TASK_PINNED = "task_pinned"

    @property
    def rank(self) -> int:
        """Lower ranks are evicted first."""
        return _RANK[self]


_RANK = {CacheClass.VOLATILE: 0, CacheClass.REPO_MAP: 1, CacheClass.TASK_PINNED: 2}


class Residency(enum.StrEnum):
    """Where a block's KV lives."""

    HOT = "hot"
    """In the engine's KV cache, attended to."""
    COLD = "cold"
    """KV bytes in the cold store; restorable without compute."""
    DROPPED = "dropped"
    """Tokens only: bringing it back means prefilling it again."""


class BlockView(msgspec.Struct, frozen=True, kw_only=True):
    """What a hot-eviction policy sees of one resident block."""

    id: int
    cache_class: CacheClass
    start: int
    n_tokens: int
    last_used: int
    """A logical clock: larger is more recent."""
    score: float | None = None
    """Optional importance (e.g. attention mass); higher is more important."""
    relevance: float | None = None
    """How relevant the block is to the context's query (its last segment), as the
    session's hot-eviction policy scored it (:class:`kvrt.policy.Relevance`); None when
    that policy scores nothing."""
    shown: bool = True
    """Whether the block is in the window the engine holds now. In a long context, blocks
    the window leaves out compete with those it shows for the next one: a policy may keep
    the shown ones on near ties, so the window (and the KV after it) stays put."""


class ColdEntryView(msgspec.Struct, frozen=True, kw_only=True):
    """What a cold-victim policy sees of one cold-store entry."""

    id: int
    cache_class: CacheClass
    n_bytes: int
    last_used: int
    spare: bool = False
    """A copy written through while its block is still hot in a session: dropping it
    loses nothing that session holds (the block is written again when it leaves)."""


class RestoreQuery(msgspec.Struct, frozen=True, kw_only=True):
    """What a restore-vs-recompute policy sees of one exact cold hit."""

    cache_class: CacheClass
    start: int
    """Position of the block's first token (prefill cost grows with it)."""
    n_tokens: int
    n_bytes: int


class ApproximateQuery(msgspec.Struct, frozen=True, kw_only=True):
    """What an approximate-hit policy sees: a cold block with the same tokens as a block
    of the context, computed after different preceding tokens.

    Restoring it is cheap but not equal to recomputing: its keys and values attended to
    another prefix, and its keys are re-rotated by ``shift`` positions.
    """

    cache_class: CacheClass
    start: int
    """Where the block sits in the context now."""
    source_start: int
    """Where the cold copy was computed."""
    n_tokens: int
    n_bytes: int
    run_start: int | None = None
    """Where the run of approximate hits holding this block begins: the first token after
    the changed prefix (None: the block itself)."""
    run_tokens: int | None = None
    """Tokens in that run (None: the block's own)."""

    @property
    def shift(self) -> int:
        return self.start - self.source_start


class PartialWindowQuery(msgspec.Struct, frozen=True, kw_only=True):
    """What a partial-window policy sees: a block of the context whose KV was computed
    while earlier tokens of the context were not hot, now that the plan keeps its whole
    prefix hot with it, so computing it again gives exact KV.

    Keeping it costs nothing but exactness: the model attends to KV that saw less of the
    context than the tokens before it now say (``ContextStatus.exact`` stays false).
    """

    cache_class: CacheClass
    start: int
    """Position of the block's first token (computing it again costs more further in)."""
    n_tokens: int
    hot: bool
    """The KV is in the hot window (else in this session's own cold copy)."""


class CheckpointView(msgspec.Struct, frozen=True, kw_only=True):
    """What a checkpoint policy sees of one block of a model with recurrent layers."""

    cache_class: CacheClass
    n_tokens: int
    kv_bytes: int
    """The block's attention KV bytes."""
    checkpoint_bytes: int
    """Bytes of the checkpoint of the recurrent state the block would carry (the same for
    every block of the model)."""


class TurnView(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine-turn policy sees of one engine call waiting for its turn."""

    id: int
    served: float
    """Seconds of engine time the waiting session's current command has had so far (0
    for a command that has not run yet, and for calls outside any session's command)."""
    left: int
    """Tokens the command may still generate: its ``max_tokens`` less those it has
    generated (0 for a command that generates none, such as placing a context)."""
    arrived: int
    """A logical clock: smaller waited longer."""
    call: str
    """What the call does (``step``, ``prefill``, ``restore``, ``open``, ...)."""


class KernelTrial(msgspec.Struct, frozen=True, kw_only=True):
    """One way of cutting the same work, against computing it in one batch."""

    name: str
    """What was cut and how (``72 tokens in pieces of 64 after 192 cells``)."""
    max_delta: float
    """The largest difference between the two next-token logits (0: bit for bit)."""
    lone: bool = False
    """The cut computes tokens one at a time (as decoding does) rather than in pieces."""


class SequenceStep(msgspec.Struct, frozen=True, kw_only=True):
    """``sequences`` sequences advanced a token each: one after another, then together."""

    sequences: int
    serial_ms: float
    """One step of every sequence, each decoded alone."""
    batched_ms: float
    """The same step in one engine call."""
    max_delta: float
    """The largest difference between a sequence's logits decoded alone and together
    (for one sequence: in the context of several, and in a context of its own, as a
    session's window steps alone)."""


class KernelSetting(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration of an engine's kernels as the kernel probe measured it on this
    CPU, build, model, KV type and thread count: what a kernel policy chooses among."""

    flash_attention: bool
    trials: tuple[KernelTrial, ...]
    """Each cut of the same tokens against one batch."""
    name: str = ""
    """The configuration in words, where flash attention alone does not name it."""
    depth: int
    """Cells in the context where the speeds were timed."""
    prefill_tps: float
    """Tokens a second computing a batch after ``depth`` cells."""
    decode_tps: float
    """Tokens a second decoding one at a time after ``depth`` cells."""
    steps: tuple[SequenceStep, ...] = ()
    """Sequences decoded together against alone."""

    @property
    def label(self) -> str:
        return self.name or f"flash attention {'on' if self.flash_attention else 'off'}"

    @property
    def exact(self) -> bool:
        """Every cut in pieces gave the logits of one batch, bit for bit: a context
        computed in other pieces (restored, or computed again) equals it."""
        return all(t.max_delta == 0 for t in self.trials if not t.lone)

    @property
    def lone_exact(self) -> bool:
        """Tokens computed one at a time gave a batch's logits too, bit for bit."""
        return all(t.max_delta == 0 for t in self.trials if t.lone)

    @property
    def batch_exact(self) -> bool:
        """Every sequence decoded beside others gave its logits decoded alone."""
        return bool(self.steps) and all(s.max_delta == 0 for s in self.steps)


@dataclass(frozen=True, slots=True, eq=False)
class KeySketch:
    """A block's key sketch, as kvrt's adapters make it and the ``relevance`` policy reads
    it: ``keys[layer, kv_head, vector, head_dim]`` (int8) times ``scale[layer, kv_head,
    vector]`` (float32) are its vectors; ``np.asarray(sketch)`` gives them.

    Int8 halves what float16 held (SmolLM2: 52 KB a block, not 104 KB) and turns into
    float32 about fifteen times faster, which is most of what scoring a thousand blocks a
    turn costs. A vector's error is at most half a step of its own scale (1/254 of its
    largest component): cosines move in the third decimal, rankings do not."""

    keys: npt.NDArray[np.int8]
    scale: npt.NDArray[np.float32]

    @classmethod
    def quantize(cls, vectors: npt.ArrayLike) -> KeySketch:
        """The sketch of ``vectors[layer, kv_head, vector, head_dim]``, each vector
        scaled to its largest component."""
        v = np.asarray(vectors, dtype=np.float32)
        if v.ndim != 4:
            raise ValueError(f"a key sketch is [layer, head, vector, dim], got shape {v.shape}")
        scale = np.abs(v).max(axis=-1) / 127.0
        safe = np.where(scale > 0, scale, 1.0)
        keys = np.rint(v / safe[..., None]).astype(np.int8)
        return cls(keys, scale.astype(np.float32))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.keys.shape

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.scale.nbytes

    def __array__(self, dtype: object = None, copy: object = None) -> npt.NDArray[np.float32]:
        out = self.keys.astype(np.float32) * self.scale[..., None]
        return out if dtype is None else out.astype(dtype)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True, eq=False)
class KeySketches(Sequence["KeySketch | None"]):
    """Many blocks' key sketches packed side by side, as a long context keeps them: a
    sequence of :class:`KeySketch` (None where a block has none), and the packed arrays a
    policy can read all at once, without gathering a thousand small arrays a turn.

    ``keys[layer, kv_head, vector, head_dim, slot]`` (int8, a slot's vectors down a column)
    times ``scale[layer, kv_head, vector, slot]`` are the vectors of every slot; ``norms``
    their int8 vectors' squared lengths; ``slots[i]`` the slot of the i-th block, -1 where
    it has no sketch. Slots no block names hold nothing a policy should read."""

    keys: npt.NDArray[np.int8]
    scale: npt.NDArray[np.float32]
    norms: npt.NDArray[np.float32]
    slots: npt.NDArray[np.intp]

    def __len__(self) -> int:
        return len(self.slots)

    @overload
    def __getitem__(self, i: int) -> KeySketch | None: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[KeySketch | None]: ...
    def __getitem__(self, i: int | slice) -> KeySketch | Sequence[KeySketch | None] | None:
        if isinstance(i, slice):
            return [self[k] for k in range(len(self))[i]]
        slot = int(self.slots[i])
        if slot < 0:
            return None
        return KeySketch(self.keys[..., slot], self.scale[..., slot])
