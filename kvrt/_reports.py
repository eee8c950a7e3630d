"""What sessions report: per-call status, streamed pieces and ``explain()``."""

from __future__ import annotations

from collections.abc import Container, Sequence

import msgspec

from ._backend import Capabilities, Counters
from ._cold import ColdStats
from ._types import CacheClass, Residency

__all__ = [
    "BlockReport",
    "Completion",
    "ContextStatus",
    "Piece",
    "PrefetchReport",
    "SegmentReport",
    "SessionCounters",
    "SessionReport",
    "Timings",
    "Usage",
    "segment_reports",
]


class ContextStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What one ``ensure_context`` call did, in tokens, and what the model attends to
    afterwards.

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
    """The text this token completes; empty while a character's bytes are incomplete."""
    token: int
    """The token id."""
    index: int
    """Position of the token in this ``generate()`` call, from 0."""


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens one ``chat`` or ``generate`` call read, computed and wrote.

    The work counters (``reused_tokens`` ... ``approximate_tokens``) count the call's own
    work, as :class:`ContextStatus` does: for ``chat`` they include placing the messages;
    for ``generate`` only what generating needed (usually nothing: the context was placed
    by ``ensure_context``).
    """

    prompt_tokens: int
    """Context tokens the generation continued from."""
    completion_tokens: int
    """Tokens generated (a stop sequence's tokens included, though they left the context)."""
    total_tokens: int
    """``prompt_tokens + completion_tokens``."""
    cached_tokens: int
    """Prompt tokens this call did not compute (OpenAI's ``cached_tokens``): reused,
    restored or approximate."""
    reused_tokens: int
    """Work: already hot and unchanged."""
    restored_tokens: int
    """Work: restored exactly from the cold store."""
    prefilled_tokens: int
    """Work: computed by the engine."""
    approximate_tokens: int
    """Work: restored approximately (only where the approximate policy allows it)."""
    visible_tokens: int
    """Context tokens the model attended to when it generated: the hot window."""


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """How long one ``chat`` or ``generate`` call took, in seconds."""

    time_to_first_token: float | None
    """From sending the call to the first generated token (queueing and placing the
    context included); None when nothing was generated."""
    prompt_seconds: float
    """Placing the context (``chat``), from the moment the session began the call."""
    decode_seconds: float
    """From the first generated token to the last."""
    decode_tokens_per_second: float | None
    """Tokens generated after the first, per second of decoding; None below two tokens."""
    total_seconds: float
    """From sending the call to its end."""


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one ``chat`` or ``generate`` call."""

    text: str
    """The generated text (without the stop sequence that ended it)."""
    finish_reason: str
    """``stop`` (a stop sequence), ``eos`` (the model's end-of-generation token),
    ``length`` (``max_tokens``, or the planner context full) or ``closed`` (the reader
    stopped reading)."""
    usage: Usage
    """Tokens read, computed and generated."""
    timings: Timings
    """Where the time went."""
    tokens: tuple[int, ...]
    """The generated tokens that stayed in the context."""
    invisible_segments: tuple[str, ...]
    """Segments the model did not see whole when it generated (blocks not hot)."""
    context: ContextStatus
    """The context after the call."""


class SessionCounters(msgspec.Struct, kw_only=True):
    """Totals over a session's life."""

    reused_tokens: int = 0
    """Tokens already hot and kept, over all calls."""
    restored_tokens: int = 0
    """Tokens restored exactly from the cold store."""
    approximate_tokens: int = 0
    """Tokens restored approximately."""
    prefilled_tokens: int = 0
    """Tokens computed by prefill."""
    evicted_tokens: int = 0
    """Tokens that left the hot window."""
    generated_tokens: int = 0
    """Tokens generated."""
    ensure_calls: int = 0
    """``ensure_context`` calls."""
    generate_calls: int = 0
    """``generate`` calls."""
    cancelled_calls: int = 0
    """Calls cancelled (or skipped because their caller gave up)."""


class BlockReport(msgspec.Struct, frozen=True, kw_only=True):
    """One block of a session's context, as ``explain()`` shows it."""

    segment: str
    """The segment the block belongs to."""
    index: int
    """Its place in the segment, from 0."""
    start: int
    """Position of its first token in the context."""
    n_tokens: int
    """Its tokens."""
    cache_class: CacheClass
    """Its segment's cache class."""
    residency: Residency
    """Where its KV is: ``hot`` (attended to), ``cold`` (restorable bytes) or ``dropped`` (tokens only)."""
    protected: bool
    """A sink or in the recent window: never evicted."""
    last_used: int
    """A logical clock: larger is more recent."""
    choice: str | None = None
    """The last residency decision about this block (restored, recomputed, evicted ...)."""
    approximate: bool = False
    """Its KV derives from an approximate restore (itself, or one resident before it when
    it was computed)."""
    cold_tier: str | None = None
    """For a ``cold`` block, the nearest tier holding its bytes: ``ram``, ``disk`` or
    ``remote``."""
    relevance: float | None = None
    """Its relevance to the query, when the hot-eviction policy scores blocks
    (``relevance``): higher stays hot."""


class SegmentReport(msgspec.Struct, frozen=True, kw_only=True):
    """One segment of a session's context: how much of it the model attends to."""

    name: str
    """The segment's name."""
    cache_class: CacheClass
    """Its cache class."""
    n_tokens: int
    """Its tokens."""
    hot_tokens: int
    """Of those, tokens in the hot window: what the model attends to."""
    cold_tokens: int
    """Tokens kept as KV bytes in a cold tier: restorable, not attended to."""
    dropped_tokens: int
    """Tokens kept as tokens only: computed again when needed."""
    seen: str
    """``hot`` (all of it attended to), ``partly`` or ``unseen``."""
    required: bool
    """Named in the last ``ensure_context``'s ``require_visible``: kept hot."""


def segment_reports(blocks: Sequence[BlockReport], required: Container[str]) -> list[SegmentReport]:
    """One line per segment, in context order, from its blocks' residency."""
    order: dict[str, list[BlockReport]] = {}
    for b in blocks:
        order.setdefault(b.segment, []).append(b)
    out = []
    for name, parts in order.items():
        by = {r: sum(b.n_tokens for b in parts if b.residency is r) for r in Residency}
        total = sum(by.values())
        hot = by[Residency.HOT]
        out.append(
            SegmentReport(
                name=name,
                cache_class=parts[0].cache_class,
                n_tokens=total,
                hot_tokens=hot,
                cold_tokens=by[Residency.COLD],
                dropped_tokens=by[Residency.DROPPED],
                seen="hot" if hot == total else "partly" if hot else "unseen",
                required=name in required,
            )
        )
    return out


class SessionReport(msgspec.Struct, frozen=True, kw_only=True):
    """A session's state: sizes, every block, the cold store, the mailbox, counters."""

    name: str
    """The session's name."""
    closed: bool
    """Whether the session is closed."""
    hot_budget: int
    """Tokens the hot window may hold."""
    hot_tokens: int
    """KV cells the engine context holds now."""
    planner_context: int
    """Tokens the context may span, hot and cold."""
    logical_tokens: int
    """The context's tokens now."""
    blocks: list[BlockReport]
    """Every block of the context, in order."""
    segments: list[SegmentReport]
    """Every segment of the context, in order: how much of it is hot (seen by the model)."""
    residency_tokens: dict[str, int]
    """Context tokens by residency (``hot``, ``cold``, ``dropped``)."""
    cold_store: ColdStats
    """The runtime's shared cold store."""
    mailbox: dict[str, int]
    """The session's command mailbox: queued, size, waiting callers, in flight."""
    counters: SessionCounters
    """Totals over the session's life."""
    engine: Counters
    """The engine context's own counters."""
    capabilities: Capabilities
    """What the engine context can do exactly."""
    exact_restores: bool
    """Restores are bit-identical on this engine and KV precision."""
    approximate_tokens: int
    """Resident tokens whose KV derives from an approximate restore."""
    consistent: bool
    """The bookkeeping matches what the engine holds (checked now)."""
    problems: list[str]
    """What does not match, if anything."""


class PrefetchReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefetch found and holds for the session's next ``ensure_context``."""

    blocks: int
    """Blocks the segments cut into."""
    tokens: int
    """Tokens the segments hold."""
    cold_blocks: int
    """Blocks with an exact hit in the cold store, now pinned there until the next call."""
    cold_tokens: int
    """Tokens of the exact cold hits pinned."""
    cold_bytes: int
    """Bytes of the exact cold hits pinned."""
