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
    """What one ``ensure_context`` call did, in tokens."""

    reused_tokens: int
    """Already hot and unchanged."""
    restored_tokens: int
    """Brought back from the cold store without computing anything (exact hits)."""
    prefilled_tokens: int
    """Computed by the engine."""
    evicted_tokens: int
    """Left the hot window (their KV bytes committed to the cold store first)."""
    hot_tokens: int
    logical_tokens: int
    cold_tokens: int
    """Context tokens whose KV is in the cold store, not in the window."""
    dropped_tokens: int
    """Context tokens with neither hot nor cold KV (not attended to)."""
    exact_restores: bool
    """Restored tokens are bit-identical to never having evicted them (false for a
    quantized KV cache that re-quantizes on import: then restores are approximate)."""
    approximate_tokens: int = 0
    """Restored from a cold copy of the same tokens after a different prefix (only when
    the session's approximate-hit policy allows it): cheap, but not what recomputing gives."""
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
