"""Paging: blocks out of the hot window (exported to the cold store in runs, or kept as
tokens only) and back in (exact restore runs; computing them is :mod:`.computing`), room
made by the eviction policy. Every move returns the :class:`~.gate.Tally` of what it did.

Ordering rules that make cancellation safe: a block leaves the hot window only after its
cold copy is committed (or the cold store refused it, which makes it "dropped": tokens
kept, KV to be recomputed); a restore lands whole or not at all (the adapter's admit is
all-or-nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import anyio

from .._cold import ColdEntry, ColdKey
from .._errors import (
    ColdBlockMismatchError,
    ColdStoreFullError,
    EngineError,
    HotWindowFullError,
    KvrtError,
)
from .._types import Residency, RestoreQuery
from ..policy import Estimating
from .gate import EngineGate, Tally, Written
from .window import Block

log = logging.getLogger("kvrt")

PARTIAL_KV = "partial-window KV: not exact, kept for this session only"

__all__ = ["PARTIAL_KV", "Paging"]


class Paging:
    """Moves blocks between the hot window and the cold store: the executor of every
    block move, through the session's engine gate."""

    def __init__(self, gate: EngineGate) -> None:
        self.gate = gate
        self.ctx, self.window, self.cold = gate.ctx, gate.window, gate.cold
        self.policies, self.config = gate.policies, gate.config

    # -- moving single blocks --

    async def evict_block(self, block: Block, *, strict: bool = False) -> Tally:
        return await self.evict_blocks([block], strict=strict)

    def _needs_export(self, block: Block) -> bool:
        """Whether ``block`` leaving the window should export its KV: it is storable (not
        approximate), the store lacks it, and the cold admission policy keeps it."""
        key = self.gate.stored_key(block)
        return (
            key is not None
            and key not in self.cold
            and self.policies.cold_admission.admit(self.window.view(block))
        )

    async def evict_blocks(self, blocks: Sequence[Block], *, strict: bool = False) -> Tally:
        """Evict ``blocks`` (in order); adjacent hot blocks that all need a cold copy are
        exported in one engine call and leave the window in one."""
        resident = self.gate.resident()
        runs: list[list[Block]] = []
        for block in blocks:
            if self.gate.state(block, resident) is not Residency.HOT:
                continue
            last = runs[-1][-1] if runs else None
            if (
                last is not None
                and last.end == block.start
                and self._needs_export(last)
                and self._needs_export(block)
            ):
                runs[-1].append(block)
            else:
                runs.append([block])
        moved = Tally()
        for run in runs:
            moved += await self._evict_run(run, strict=strict)
        return moved

    async def evict_leaving(self, blocks: Sequence[Block]) -> Tally:
        """Evict ``blocks`` that leave the window with everything after them (a context's
        replaced blocks, or those past where it diverges). On an engine that can remove
        only the window's tail (a recurrent model), they leave from the last one down,
        each once the tokens after it have gone."""
        if self.ctx.capabilities.remove_middle:
            return await self.evict_blocks(blocks)
        moved = Tally()
        for block in sorted(blocks, key=lambda b: b.start, reverse=True):
            if self.gate.state(block) is not Residency.HOT:
                continue
            after = [p for p in self.ctx.positions if p >= block.end]
            if after:
                moved += await self.gate.drop(after[0], after[-1] + 1)
            moved += await self.evict_block(block)
        return moved

    async def _evict_run(self, run: list[Block], *, strict: bool) -> Tally:
        """Commit the run's KV to the cold store, then drop it from the window.

        A cold store that stays full for ``session.cold_wait`` seconds leaves a block with
        its tokens only, or, when ``strict`` (an explicit evict), raises and keeps it hot.
        Partial-window KV goes under a key of this session's own
        (``HotWindow.partial_copies``).
        """
        fingerprint = self.window.fingerprint
        logits = {}
        for block in run:
            found = await self.gate.logits_after(block)
            if found is not None:
                # Keep the logits after the block's last token: restoring the block later
                # (here, or in any session whose context ends there) needs no recompute,
                # and the continuation stays bit-exact.
                logits[block.id] = found
                self.gate.held = (block.key(fingerprint), block.end - 1, found)
        keys = {b.id: self.gate.stored_key(b) for b in run}
        wanted = [b for b in run if self._needs_export(b)]
        exported = {}
        if wanted:
            ranges = [(b.start, b.end) for b in wanted]
            cold_blocks = await self.gate.call("export", self.ctx.export_run, ranges)
            exported = {b.id: c for b, c in zip(wanted, cold_blocks, strict=True)}
        for block in run:
            key = keys[block.id]
            local = key is not None and key.session_local
            if key is not None and block.id in exported:
                if self.gate.fault is not None:
                    self.gate.fault("cold put")
                entry = ColdEntry(
                    key,
                    block.cache_class,
                    exported[block.id],
                    logits.get(block.id),
                    frozenset(block.lone),
                )
                try:
                    committed = await self.cold.put(entry, wait=self.config.cold_wait)
                except ColdStoreFullError:
                    if strict:
                        raise
                    self.gate.choices[block.id] = (
                        f"evicted, tokens only (cold store full for {self.config.cold_wait:g} s)"
                    )
                else:
                    if not committed:
                        self.gate.choices[block.id] = "evicted: too large for the cold store"
                    elif local:
                        self.window.partial_copies[block.key(fingerprint)] = key
                        self.gate.choices[block.id] = f"evicted to cold ({PARTIAL_KV})"
                    else:
                        self.gate.choices[block.id] = "evicted to cold"
            elif key is not None and key in self.cold:
                self.cold.keep(key)
                if local:
                    self.window.partial_copies[block.key(fingerprint)] = key
                self.gate.choices[block.id] = "evicted: cold copy already held"
            elif key is None:
                self.gate.choices[block.id] = (
                    "evicted, tokens only (approximate KV is never stored)"
                )
            else:
                self.gate.choices[block.id] = "evicted, tokens only (cold admission policy)"
        moved = await self.gate.drop(run[0].start, run[-1].end)
        moved.evicted += sum(b.n_tokens for b in run)
        return moved

    def room(self, keep: set[int]) -> int:
        """Tokens the window can hold besides what may not be evicted (protected, ``keep``)."""
        resident = self.gate.resident()
        shielded = self.window.protected() | keep
        evictable = sum(
            b.n_tokens
            for b in self.window.blocks
            if b.id not in shielded and self.gate.state(b, resident) is Residency.HOT
        )
        return self.ctx.n_ctx - (self.ctx.n_resident - evictable)

    def drops_alone(self, position: int) -> bool:
        """Whether dropping the window's tail from ``position`` removes only it (on a
        model with recurrent layers it may have to remove more: a gap before it)."""
        redo = self.ctx.recomputed_by_evict(position, self.ctx.next_position)
        return redo is None or redo.removed_from == position

    async def make_room(self, need: int, keep: set[int]) -> Tally:
        """Evict by policy until ``need`` more tokens fit; never touches ``keep`` or protected blocks."""
        moved = Tally()
        if self.ctx.n_ctx - self.ctx.n_resident < need and not self.ctx.capabilities.remove_middle:
            raise HotWindowFullError(
                f"the hot window ({self.ctx.n_ctx} tokens) cannot make room for {need} more: "
                f"{self.ctx.facts.architecture} is a recurrent model, whose state has "
                "integrated every token, so nothing can be paged out of it (open the "
                "session with more hot_tokens)"
            )
        while self.ctx.n_ctx - self.ctx.n_resident < need:
            resident = self.gate.resident()
            shielded = self.window.protected() | keep
            candidates = [
                b
                for b in self.window.blocks
                if b.id not in shielded and self.gate.state(b, resident) is Residency.HOT
            ]
            if not candidates:
                raise HotWindowFullError(
                    f"the hot window ({self.ctx.n_ctx} tokens) cannot make room for {need} more: "
                    "every resident block is protected (sinks, the recent window or in use)"
                )
            moved += await self.evict_block(
                self.window.eviction_order(candidates, self.policies.hot_eviction.order)[0]
            )
        return moved

    async def restore(self, block: Block, keep: set[int]) -> Tally:
        """Restore one cold block in place (``restored`` is 0 if the store let it go)."""
        return (await self.restore_run([block], keep))[1]

    def restorable_key(self, block: Block) -> ColdKey | None:
        """The cold copy ``block`` comes back from: its exact key when the store holds it,
        else this session's own partial-window copy, else None."""
        key = block.key(self.window.fingerprint)
        if key in self.cold:
            return key
        local = self.window.partial_copies.get(key)
        return local if local is not None and local in self.cold else None

    async def restore_run(self, blocks: list[Block], keep: set[int]) -> tuple[int, Tally]:
        """Restore adjacent cold blocks in place in one engine call; how many came back.

        Stops at the first block the store no longer holds.
        """
        entries, tiers = [], []
        for block in blocks:
            key = self.restorable_key(block)
            found = await self.cold.fetch(key) if key is not None else None
            if found is None:
                break
            entries.append(found.entry)
            tiers.append(found.tier)
        if not entries:
            return 0, Tally()
        run = blocks[: len(entries)]
        room = self.room(keep)
        while len(run) > 1 and sum(b.n_tokens for b in run) > room:
            run.pop()  # the rest come back in a later run, once earlier blocks can go
        entries = entries[: len(run)]
        ends = self.ctx.next_position <= run[-1].end  # the run ends the window: a hybrid's
        while ends and entries and not entries[-1].block.meta.resumable:  # with its state
            entries.pop()
            self.window.unresumable.add(run[len(entries)].key(self.window.fingerprint))
        if not (run := run[: len(entries)]):
            return 0, Tally()
        marks = [
            Written(
                b.start,
                b.end,
                e.key.prefix if e.key.session_local else None,
                "restored",
                lone=frozenset(b.lone_positions()),
            )
            for b, e in zip(run, entries, strict=True)
        ]
        with self.cold.pinned(e.key for e in entries):
            moved = await self.make_room(sum(b.n_tokens for b in run), keep | {b.id for b in run})
            inside = [p for p in self.ctx.positions if run[0].start <= p < run[-1].end]
            if inside:  # leading tokens of a block kept at the tail: the copy replaces them
                moved += await self.gate.drop(inside[0], inside[-1] + 1)
            began = time.perf_counter()
            rejected: KvrtError | None = None
            try:
                await self.gate.call(
                    "admit", self.ctx.admit_run, [e.block for e in entries], writes=marks
                )
            except (EngineError, ColdBlockMismatchError) as exc:
                rejected = exc
            else:
                self.gate.observed_restore(began, sum(e.n_bytes for e in entries))
        if rejected is not None:
            # Bytes that passed their tier's checks but not the engine's (malformed state
            # written by someone else): never an error to the caller. They leave every
            # tier and the blocks are computed instead (the planner sees them dropped).
            for entry in entries:
                await self.cold.discard(entry.key)
            log.warning("kvrt: dropped %d cold blocks the engine rejected: %s", len(run), rejected)
            return 0, moved
        moved.wrote(marks)
        moved.restored += sum(b.n_tokens for b in run)
        for block, entry in zip(run, entries, strict=True):
            if entry.logits is not None and not entry.key.session_local:
                self.gate.held = (entry.key, block.end - 1, entry.logits)
        for block, entry, tier in zip(run, entries, tiers, strict=False):
            why = self.estimate(block, entry.n_bytes)
            where = "restored from cold" if tier == "ram" else f"restored from cold ({tier})"
            if entry.key.session_local:
                why = f"{PARTIAL_KV}; {why}" if why else PARTIAL_KV
            self.gate.choices[block.id] = f"{where} ({why})" if why else where
        return len(run), moved

    def query(self, block: Block, n_bytes: int) -> RestoreQuery:
        return RestoreQuery(
            cache_class=block.cache_class,
            start=block.start,
            n_tokens=block.n_tokens,
            n_bytes=n_bytes,
        )

    def estimate(self, block: Block, n_bytes: int) -> str:
        """The restore policy's cost estimates for ``block``, as text ("" if it has none)."""
        restorer = self.policies.restore
        if not isinstance(restorer, Estimating):
            return ""
        restore_s, recompute_s = restorer.estimate(self.query(block, n_bytes))
        return (
            f"est. {restore_s * 1e3:.2f} ms to restore vs {recompute_s * 1e3:.1f} ms to recompute"
        )

    def _storable(self, blocks: Sequence[Block], *, local: bool) -> Iterator[tuple[Block, ColdKey]]:
        """Each hot block of ``blocks`` with the key its KV would be stored under: not
        approximate KV, nor partial-window KV unless ``local`` (of use to this session
        only). Synchronous: the residency read once, before the first."""
        resident = self.gate.resident()
        for block in blocks:
            if self.gate.state(block, resident) is not Residency.HOT:
                continue
            key = self.gate.stored_key(block)
            if key is not None and (local or not key.session_local):
                yield block, key

    def offered(self, blocks: Sequence[Block]) -> list[ColdKey]:
        """The keys :meth:`write_back` (not ``local``) would copy ``blocks`` under now: the
        hot ones the store lacks and the cold admission policy keeps. Synchronous."""
        return [
            key for block, key in self._storable(blocks, local=False) if self._needs_export(block)
        ]

    async def write_back(
        self, blocks: Sequence[Block], *, spare: bool = False, local: bool = False
    ) -> int:
        """Copy hot blocks the cold store lacks into it (as the cold admission policy
        allows), keeping them hot; the tokens copied. Never waits for room: a store full
        of entries it may not drop, or closed, leaves the rest uncopied. ``spare`` copies
        (blocks that stay hot) only use free room, never dropping another entry.
        Partial-window KV is copied only when ``local`` (for this session itself: it is
        of no use to another, nor once this session has closed)."""
        fingerprint = self.window.fingerprint
        runs: list[list[tuple[Block, ColdKey]]] = []
        for block, key in self._storable(blocks, local=local):
            if not self._needs_export(block):
                if not spare:
                    self.cold.keep(key)  # the hot copy goes
                continue
            if runs and runs[-1][-1][0].end == block.start:
                runs[-1].append((block, key))
            else:
                runs.append([(block, key)])
        copied = 0
        for run in runs:
            ranges = [(b.start, b.end) for b, _ in run]
            exported = await self.gate.call("export", self.ctx.export_run, ranges)
            for (block, key), cold_block in zip(run, exported, strict=True):
                logits = await self.gate.logits_after(block) if not key.session_local else None
                try:
                    entry = ColdEntry(
                        key, block.cache_class, cold_block, logits, frozenset(block.lone)
                    )
                    if await self.cold.put(entry, wait=0, spare=spare):
                        copied += block.n_tokens
                        if key.session_local:
                            self.window.partial_copies[block.key(fingerprint)] = key
                except (ColdStoreFullError, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return copied
        return copied

    async def share(self, blocks: Sequence[Block]) -> int:
        """Copy ``blocks``' exact KV that a tier below RAM lacks to every such tier, and
        wait until they hold it (or their writes under way finish): replicas sharing a
        remote server see it as soon as this returns. The tokens copied."""
        resident = self.gate.resident()
        runs: list[list[tuple[Block, ColdKey]]] = []
        under_way = []
        for block in blocks:
            key = self.gate.stored_key(block)
            if (
                key is None
                or key.session_local
                or self.gate.state(block, resident) is not (Residency.HOT)
            ):
                continue
            if not self.cold.needs_lower(key):
                under_way.append(key)
            elif runs and runs[-1][-1][0].end == block.start:
                runs[-1].append((block, key))
            else:
                runs.append([(block, key)])
        copied = 0
        for run in runs:
            exported = await self.gate.call(
                "export", self.ctx.export_run, [(b.start, b.end) for b, _ in run]
            )
            for (block, key), cold_block in zip(run, exported, strict=True):
                logits = await self.gate.logits_after(block)
                entry = ColdEntry(key, block.cache_class, cold_block, logits, frozenset(block.lone))
                if await self.cold.write_below(entry):
                    copied += block.n_tokens
        await self.cold.wait_written(under_way, self.cold.flush_timeout)
        return copied

    async def truncate_from(self, position: int) -> Tally:
        """Clear every resident token at ``position`` or later, committing whole blocks
        first. On an engine that can remove only the window's tail (a recurrent model),
        the blocks leave from the last one down, each once what follows it has gone."""
        moved = await self.evict_leaving([b for b in self.window.blocks if b.start >= position])
        moved += await self.gate.tidy()
        tail = [p for p in self.ctx.positions if p >= position]
        if tail:
            moved += await self.gate.drop(tail[0], tail[-1] + 1)
        return moved
