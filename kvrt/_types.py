"""Plain values shared by the runtime and the policies: cache classes and snapshots."""

from __future__ import annotations

import enum

import msgspec

__all__ = [
    "ApproximateQuery",
    "BlockView",
    "CacheClass",
    "CheckpointView",
    "ColdEntryView",
    "PartialWindowQuery",
    "Residency",
    "RestoreQuery",
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
