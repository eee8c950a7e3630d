"""The tiers below RAM, behind one protocol.

The cold store holds RAM first, then an ordered list of :class:`ColdTier` (the disk tier,
the remote tier): every block committed to RAM is written through to each tier lacking it;
a RAM victim with a copy below is demoted, not lost; a hit below is read, verified and
promoted back into RAM. Each tier keeps its own counters and reports them in ``stats()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import msgspec

from .entry import ColdEntry, ColdKey

__all__ = ["ColdTier", "TierName"]

TierName = Literal["disk", "remote"]


class ColdTier(Protocol):
    """One tier below RAM."""

    @property
    def name(self) -> TierName: ...

    def __contains__(self, key: object) -> bool:
        """Whether the tier holds ``key`` (as far as this process knows)."""
        ...

    def size(self, key: ColdKey) -> int | None:
        """Bytes the tier holds for ``key``, if it knows."""
        ...

    async def discover(self, keys: Sequence[ColdKey]) -> int:
        """Learn which of ``keys`` the tier holds, in one round trip where it is remote;
        how many it newly learnt."""
        ...

    async def read(self, key: ColdKey) -> ColdEntry | None:
        """The verified block under ``key``; None if it is gone or fails a check (counted)."""
        ...

    async def write(self, entry: ColdEntry) -> bool:
        """Write ``entry``'s block; True once the tier holds it. A failure is counted and
        returns False, never raises."""
        ...

    async def discard(self, key: ColdKey) -> None:
        """Remove the block under ``key``: its bytes read back well but the engine
        rejected them (counted by the tier). Never raises."""
        ...

    def left_ram(self, key: ColdKey) -> None:
        """The block under ``key`` left RAM with no copy in any tier: kept as tokens only
        (a tier that counts such losses counts it)."""
        ...

    def stats(self) -> msgspec.Struct: ...

    def close(self) -> None: ...
