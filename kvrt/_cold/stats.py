"""What the cold store reports of itself: one struct for all its tiers."""

from __future__ import annotations

import msgspec

from .disk import DiskStats
from .remote import RemoteStats

__all__ = ["ColdStats"]


class ColdStats(msgspec.Struct, frozen=True, kw_only=True):
    """The cold store's figures, shared by every session of a runtime."""

    entries: int
    """Blocks held."""
    bytes: int
    """Bytes held."""
    budget_bytes: int
    """The store's budget; ``bytes`` never passes it."""
    exact_hits: int
    """Lookups that found an exact copy (same model, prefix, tokens, position), in any tier."""
    disk_hits: int
    """Of ``exact_hits``, those read back from disk (and promoted into RAM)."""
    approximate_hits: int
    """Approximate copies used (same tokens after another prefix)."""
    misses: int
    """Lookups that found nothing."""
    puts: int
    """Blocks stored."""
    evictions: int
    """Blocks dropped from RAM to stay within budget (the cold-victim policy's choice)."""
    demoted: int
    """Of ``evictions``, blocks that stayed on disk (their copy written or on its way)."""
    promoted: int
    """Disk hits taken back into RAM."""
    refused: int
    """Entries larger than the whole budget."""
    rejected: int = 0
    """Blocks whose bytes passed their tier's checks but the engine refused (malformed
    state): dropped from every tier and computed instead."""
    pinned: int
    """Entries in use by a restore or a prefetch, which cannot be dropped."""
    full_waits: int
    """Puts that waited for a pin to be released."""
    full_failures: int
    """Puts that gave up after the bounded wait."""
    queue: dict[str, int]
    """The bounded stream of puts toward the store: buffered, size, waiting senders."""
    disk: DiskStats | None = None
    """The disk tier's figures (None when it is off)."""
    remote: RemoteStats | None = None
    """The remote tier's figures (None when it is off)."""
    remote_hits: int = 0
    """Of ``exact_hits``, those read from the remote tier (and promoted into RAM)."""
    pending_writes: int = 0
    """Blocks queued for, or being written to, the tiers below RAM."""
