"""Approximate hits: a block restored from a cold copy of its tokens computed after
another prefix (its keys turned to the block's positions where they differ), when the
session's approximate-hit policy accepts it. Never exact: the KV is marked approximate
(see :mod:`.provenance`) and every report says so.
"""

from __future__ import annotations

import time

import anyio

from .._cold import ColdEntry
from .._engine.contract import AdmitMode
from .._types import ApproximateQuery
from ..policy import Blending
from .gate import Tally, Written
from .moves import Paging
from .provenance import APPROXIMATE
from .window import Block

__all__ = ["ApproximateHits"]


class ApproximateHits:
    """Finds and places approximate hits, through the session's paging."""

    def __init__(self, paging: Paging) -> None:
        self.paging, self.gate = paging, paging.gate
        self.ctx, self.window, self.cold = paging.ctx, paging.window, paging.cold
        self.policies = paging.policies

    def entry(
        self, block: Block, run: tuple[int, int] | None = None
    ) -> tuple[ColdEntry, ApproximateQuery] | None:
        """The cold copy of ``block``'s tokens after another prefix that the session's
        approximate-hit policy accepts, if any, with what the policy was asked. ``run``:
        the (start, tokens) of the run of approximate-hit candidates ``block`` is in."""
        entry = self.cold.similar(block.key(self.window.fingerprint), count=False)
        if entry is None:
            return None
        run_start, run_tokens = run if run is not None else (None, None)
        query = ApproximateQuery(
            cache_class=block.cache_class,
            start=block.start,
            source_start=entry.key.start,
            n_tokens=block.n_tokens,
            n_bytes=entry.n_bytes,
            run_start=run_start,
            run_tokens=run_tokens,
        )
        if query.shift and not self.ctx.capabilities.position_shift:
            return None
        if self.window.virtual:
            # A long context's window: how its blocks come back, except those it computes.
            return (
                None
                if block.key(self.window.fingerprint) in self.window.long_copies
                else (entry, query)
            )
        return (entry, query) if self.policies.approximate.accept(query) else None

    async def hit(
        self, block: Block, keep: set[int], run: tuple[int, int] | None = None
    ) -> tuple[bool, Tally]:
        """Restore ``block`` from a cold copy of its tokens after another prefix, if the
        approximate-hit policy accepts it (whether it did; ``run`` as for
        :meth:`entry`); the window must end right before the block. A blending
        policy has the block's first tokens computed afresh, the rest restored."""
        moved = Tally()
        if self.ctx.next_position != block.start:
            return False, moved
        found = self.entry(block, run)
        if found is None:
            return False, moved
        entry, query = found
        policy = self.policies.approximate
        fresh = policy.recompute_tokens(query) if isinstance(policy, Blending) else 0
        if fresh >= block.n_tokens:
            return False, moved  # all of it computed afresh: an ordinary prefill
        self.cold.count_approximate(entry.key)
        with self.cold.pinned([entry.key]):
            # The engine holds the whole block in scratch while splicing its tail in.
            moved += await self.paging.make_room(block.n_tokens + fresh, keep | {block.id})
            if self.ctx.next_position != block.start:
                return False, moved
            if fresh:
                began = time.perf_counter()
                lone = frozenset(block.lone_positions())  # approximate KV: never stored
                marks = [
                    Written(block.start, block.start + fresh, APPROXIMATE, "prefilled", lone=lone)
                ]
                await self.gate.call(
                    "prefill",
                    self.ctx.prefill,
                    block.tokens[:fresh],
                    start=block.start,
                    checkpoint=anyio.from_thread.check_cancelled,
                    writes=marks,
                )
                self.gate.observed_prefill(began, block.start, fresh)
                moved.wrote(marks)
            began = time.perf_counter()
            lone = frozenset(block.lone_positions())
            marks = [Written(block.start + fresh, block.end, APPROXIMATE, "approximate", lone=lone)]
            await self.gate.call(
                "admit", self.ctx.admit, entry.block, AdmitMode.TAIL, skip=fresh, writes=marks
            )
            self.gate.observed_restore(began, entry.n_bytes)
            moved.wrote(marks)
        moved.approximate += block.n_tokens - fresh
        moved.prefilled += fresh
        shift = block.start - entry.key.start
        how = f"keys re-rotated by {shift:+d}" if shift else ""
        if fresh:
            how = f"first {fresh} tokens computed afresh" + (f", {how}" if how else "")
        self.gate.choices[block.id] = (
            f"restored approximately (same tokens after another prefix; {how})"
            if how
            else "restored approximately (same tokens after another prefix)"
        )
        return True, moved
