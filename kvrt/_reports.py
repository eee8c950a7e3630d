"""What sessions report: per-call status, streamed pieces and ``explain()``."""

from __future__ import annotations

import msgspec

from ._backend import Capabilities, Counters
from ._cold_store import ColdStats
from ._types import CacheClass, Residency

__all__ = [
    "BlockReport",
    "ContextStatus",
    "Piece",
    "PrefetchReport",
    "SessionCounters",
    "SessionReport",
]


class ContextStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What one call (``ensure_context``, and the tally of ``evict``/``admit``/``generate``)
    did, in tokens, and what the model attends to afterwards.

    The work counters count work done, not context tokens: a block computed, pushed out by
    a later one and brought back in the same call counts in ``prefilled_tokens``,
    ``evicted_tokens`` and ``restored_tokens``. The context counters (``logical_tokens``
    and its parts ``visible_tokens`` + ``cold_tokens`` + ``dropped_tokens``) describe the
    context once the call is done. The model attends only to ``visible_tokens``:
    ``invisible_segments`` names the segments it does not fully see.
    """

    reused_tokens: int
    """Work: already hot and unchanged, nothing done."""
    restored_tokens: int
    """Work: brought back from the cold store without computing anything (exact hits)."""
    prefilled_tokens: int
    """Work: computed by the engine."""
    evicted_tokens: int
    """Work: left the hot window (their KV bytes committed to the cold store first)."""
    hot_tokens: int
    """KV cells the engine context holds now."""
    logical_tokens: int
    """The whole context, hot or not."""
    cold_tokens: int
    """Context tokens whose KV is in the cold store, not in the window: not attended to."""
    dropped_tokens: int
    """Context tokens with neither hot nor cold KV: not attended to."""
    exact_restores: bool
    """The engine's capability: restores on this engine and KV precision are bit-identical
    to never having evicted (false for a quantized KV cache that re-quantizes on import).
    What this call did is :attr:`exact`."""
    exact: bool = True
    """This call's result: the hot context equals what a fresh prefill of it would hold.
    False when anything came back approximately (``approximate_tokens``), was computed
    after an approximate block (``approximate_context_tokens``), or was restored on an
    engine whose restores are not exact."""
    visible_tokens: int = 0
    """Context tokens the model attends to now: the hot blocks of the context."""
    invisible_segments: tuple[str, ...] = ()
    """Names of segments with any block not hot (cold or dropped), in context order:
    generation does not see them whole."""
    approximate_tokens: int = 0
    """Work: restored from a cold copy of the same tokens after a different prefix (only
    when the session's approximate-hit policy allows it): cheap, but not what recomputing
    gives."""
    approximate_context_tokens: int = 0
    """Resident tokens whose KV derives from an approximate restore (the restored blocks
    and what was computed after them); 0 means the hot context equals a fresh prefill."""


class Piece(msgspec.Struct, frozen=True, kw_only=True):
    """One generated token and the text it completes (may be empty mid-character)."""

    text: str
    token: int
    index: int


class SessionCounters(msgspec.Struct, kw_only=True):
    """Totals over a session's life."""

    reused_tokens: int = 0
    restored_tokens: int = 0
    approximate_tokens: int = 0
    prefilled_tokens: int = 0
    evicted_tokens: int = 0
    generated_tokens: int = 0
    ensure_calls: int = 0
    generate_calls: int = 0
    cancelled_calls: int = 0


class BlockReport(msgspec.Struct, frozen=True, kw_only=True):
    segment: str
    index: int
    start: int
    n_tokens: int
    cache_class: CacheClass
    residency: Residency
    protected: bool
    last_used: int
    choice: str | None = None
    """The last residency decision about this block (restored, recomputed, evicted ...)."""
    approximate: bool = False
    """Its KV derives from an approximate restore (itself, or one resident before it when
    it was computed)."""


class SessionReport(msgspec.Struct, frozen=True, kw_only=True):
    """A session's state: sizes, every block, the cold store, the mailbox, counters."""

    name: str
    closed: bool
    hot_budget: int
    hot_tokens: int
    planner_context: int
    logical_tokens: int
    blocks: list[BlockReport]
    residency_tokens: dict[str, int]
    cold_store: ColdStats
    mailbox: dict[str, int]
    counters: SessionCounters
    engine: Counters
    capabilities: Capabilities
    exact_restores: bool
    approximate_tokens: int
    """Resident tokens whose KV derives from an approximate restore."""
    consistent: bool
    problems: list[str]


class PrefetchReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefetch found and holds for the session's next ``ensure_context``."""

    blocks: int
    """Blocks the segments cut into."""
    tokens: int
    cold_blocks: int
    """Blocks with an exact hit in the cold store, now pinned there until the next call."""
    cold_tokens: int
    cold_bytes: int
