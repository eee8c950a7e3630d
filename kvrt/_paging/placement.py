"""Placement: a context asked for becomes blocks (plan), the blocks come in left to right
within the hot budget (place), and planned blocks pushed out meanwhile come back
(converge); then logits follow the context's last token.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .._errors import (
    ColdBlockMismatchError,
    EngineError,
    HotWindowFullError,
    InvalidContextError,
    NotVisibleError,
)
from .._reports import ContextStatus
from .._types import PartialWindowQuery, Residency, RestoreQuery
from .approximate import ApproximateHits
from .computing import Computing
from .gate import EngineGate, Tally, Written
from .moves import Paging
from .planner import (
    Begin,
    Compute,
    Cursor,
    RestoreRun,
    Scene,
    Step,
    WaitFor,
    advance,
    plan,
    query_first,
)
from .scoring import Scoring
from .segments import Placed, Segment
from .tokens import ReplyTokens, TokenKey, check_fits, segment_tokens
from .window import Block

__all__ = ["LEADING_MIN_TOKENS", "Placement"]

LEADING_MIN_TOKENS = 8
"""The fewest leading tokens of a block worth restoring from a cold block that diverges
after them (a whole block comes back to keep them): fewer are computed with the rest."""


@dataclass(slots=True)
class Placing:
    """What one placement chose before it moved anything: a value of that placement,
    handed to what reads it."""

    recompute: set[int] = field(default_factory=set)
    """Cold blocks the restore policy chose to compute again rather than restore."""
    refresh: set[int] = field(default_factory=set)
    """Blocks whose partial-window KV the partial-window policy has computed again, now
    that their whole prefix fits hot."""
    approximate_runs: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Block id -> (start, tokens) of its run of approximate-hit candidates."""


class Placement:
    """Makes the hot window hold a context the way the eviction policy plans it: the
    planner (:mod:`.planner`) decides each step, paging runs it."""

    def __init__(self, gate: EngineGate, paging: Paging, scoring: Scoring) -> None:
        self.gate, self.paging, self.scoring = gate, paging, scoring
        self.approximate = ApproximateHits(paging)
        self.computing = Computing(gate, paging)
        self.engine, self.ctx, self.window = gate.engine, gate.ctx, gate.window
        self.cold, self.policies = gate.cold, gate.policies
        self.texts: dict[TokenKey, Placed] = {}
        """The last context's segments with their tokens: a follow-up sending a long
        document again does not tokenize it again."""

    # -- commands --

    def tokenize(
        self,
        segments: Sequence[Segment],
        *,
        known: dict[TokenKey, Placed] | None = None,
        remember: dict[TokenKey, Placed] | None = None,
        replies: Mapping[str, ReplyTokens] | None = None,
    ) -> list[Placed]:
        """Each segment with its tokens (empty segments left out); safe from any thread.

        Uses the tokenizations in ``known`` (a prefetch's) and the last call's (its
        segments sent again); ``remember`` receives every
        tokenization made; ``replies`` names segments holding a reply to place with its
        generated tokens (a plain segment whose whole text is a reply this runtime
        generated is placed so without being named).
        """
        texts = self.texts
        keys = [(s.text, i == 0, s.parse_special, s.markup) for i, s in enumerate(segments)]
        counted = sum(len(texts[k].tokens) for k in keys if k in texts)
        unknown = [s for s, k in zip(segments, keys, strict=True) if k not in texts]
        check_fits(self.engine, unknown, self.window.context_limit - counted)
        out = []
        cache = {**texts, **(known or {})}
        replies = replies or {}
        for i, (seg, key) in enumerate(zip(segments, keys, strict=True)):  # checked Segments
            reply = replies.get(seg.name)
            if reply is None and i and not seg.markup and not seg.parse_special:
                # A segment holding a reply this runtime generated, sent back as it was.
                found = self.gate.replies.lookup(seg.text)
                reply = (seg.text, *found) if found is not None else None
            placed = cache.get(key) if reply is None else None
            if placed is None:
                placed = segment_tokens(self.engine, seg, first=i == 0, reply=reply)
            else:
                placed = placed._replace(segment=seg)
            if remember is not None:
                remember[key] = placed
            out.append(placed)
        if not any(p.tokens for p in out):
            raise InvalidContextError("the context is empty: every segment's text is empty")
        self.texts = {k: p for k, p in zip(keys, out, strict=True) if not p.lone}
        return [p for p in out if p.tokens]

    async def ensure_placed(
        self, tokenized: list[Placed], require: tuple[str, ...] = ()
    ) -> tuple[ContextStatus, Tally]:
        self._check_visible(tokenized, require)
        layout, stale = self.window.plan_layout(tokenized)
        copies = self.window.partial_copies  # forget the copies the store let go
        self.window.partial_copies = {k: v for k, v in copies.items() if v in self.cold}
        await self.cold.discover(b.key(self.window.fingerprint) for b in layout)
        resident = self.gate.resident(layout)  # as the new layout's blocks see the engine
        tally = Tally(
            reused=sum(
                b.n_tokens
                for b in layout
                if self.window.residency(b, resident, ()) is Residency.HOT
            )
        )
        # A replaced block whose tokens the new context starts with the same (a reply that
        # grew, the same question asked again) stays where it is for them: it is copied to
        # the cold store, not evicted, and the rest of it is tidied away.
        kept = self.window.kept_positions(layout, resident)
        stale.sort(key=lambda b: b.start)
        superseded = [b for b in stale if any(p in kept for p in range(b.start, b.end))]
        await self.paging.write_back(superseded, local=True)
        tally += await self.paging.evict_leaving([b for b in stale if b not in superseded])
        self.gate.placed = False
        self.window.adopt(layout)
        self.window.required = frozenset(require)
        tally += await self.gate.tidy()
        tally += await self._place(layout)
        tally += await self.last_logits()
        self.gate.placed = True
        unseen = [
            b.segment
            for b in layout
            if b.segment in require and self.gate.state(b) is not Residency.HOT
        ]
        if unseen:  # the plan keeps them hot, so this means a block could not come back
            raise NotVisibleError(
                f"segment {unseen[0]!r} is required visible but not all of it is hot"
            )
        self.gate.record(tally)
        return self.gate.status(tally), tally

    def _check_visible(self, tokenized: list[Placed], require: tuple[str, ...]) -> None:
        """Refuse, before anything moves, a context whose required segments cannot be hot
        together with the sinks and the recent window."""
        if not require:
            return
        need = self.window.protected_tokens(tokenized, require)
        if need > self.ctx.n_ctx:
            sizes = ", ".join(
                f"{p.segment.name!r} {len(p.tokens)}"
                for p in tokenized
                if p.segment.name in require
            )
            raise NotVisibleError(
                f"the segments required visible ({sizes} tokens), with the sinks and the recent "
                f"window, need {need} tokens hot, more than the hot window's {self.ctx.n_ctx}: "
                "require fewer segments, shorten them, or open the session with more hot_tokens"
            )

    async def _place(self, layout: list[Block]) -> Tally:
        """Bring the layout's blocks in, keeping the window within budget, as the
        planner (:mod:`.planner`) says: cold blocks come back when the plan (the policy
        applied to the whole context) keeps them hot, dropped ones are computed in order.

        In a context larger than the window, what comes before the last segment (the
        query) is placed first, and the query after a second plan (made once every block
        has KV, and keys to score) has brought back what it keeps hot: computed in one go
        with the blocks before it, the query would push planned blocks out unseen."""
        moved = Tally()
        resident = self.gate.resident()
        states = [self.gate.state(b, resident) for b in layout]
        segments, sizes = [b.segment for b in layout], [b.n_tokens for b in layout]
        body = query_first(segments, sizes, states, self.ctx.n_ctx)
        if body:
            moved += await self._place_once(layout[:body])
        moved += await self._place_once(layout)
        return moved

    async def _place_once(self, layout: list[Block]) -> Tally:
        """One plan, run until ``layout`` (the window's blocks, or their first ones) is in
        place."""
        policy = self.policies.hot_eviction
        await self.scoring.score()
        planned = self.window.plan_hot(policy.order, self.ctx.n_ctx)
        placing = Placing()
        resident = self.gate.resident()
        for block in layout:
            if self.gate.state(block, resident) is Residency.COLD:
                size = self.cold.size(block.key(self.window.fingerprint))
                query = self.paging.query(block, size or 0)
                if not self.policies.restore.restore(query):
                    placing.recompute.add(block.id)
        placing.approximate_runs = self._approximate_runs(layout, placing)
        moved = await self._refresh_partial(layout, planned, placing)
        moved += await self._run_plan(layout, planned, placing)
        return moved

    def _state(self, block: Block, resident: dict[int, int], placing: Placing) -> Residency:
        """Where ``block``'s KV is, as this placement treats it: a cold block it computes
        again (the restore policy's choice, or partial-window KV it refreshes) is dropped."""
        found = self.gate.state(block, resident)
        if found is Residency.COLD:
            if block.id in placing.recompute:
                return Residency.DROPPED  # the restore policy chose to compute it again
            if block.id in placing.refresh and block.key(self.window.fingerprint) not in self.cold:
                return Residency.DROPPED  # its only copy is partial-window KV: computed again
        return found

    def _approximate_runs(
        self, layout: Sequence[Block], placing: Placing
    ) -> dict[int, tuple[int, int]]:
        """Runs of adjacent blocks that are neither hot nor cold but have a cold copy of
        their tokens after another prefix: block id -> (run start, run tokens)."""
        runs: dict[int, tuple[int, int]] = {}
        resident = self.gate.resident()
        run: list[Block] = []
        for block in [*layout, None]:
            candidate = (
                block is not None
                and self._state(block, resident, placing) is Residency.DROPPED
                and self.cold.similar(block.key(self.window.fingerprint), count=False) is not None
            )
            if candidate and block is not None:
                run.append(block)
                continue
            size = sum(b.n_tokens for b in run)
            for b in run:
                runs[b.id] = (run[0].start, size)
            run = []
        return runs

    def _why_computed(self, block: Block, placing: Placing) -> str | None:
        """Why this placement computes ``block`` though it has a cold copy (for
        ``explain()``), if it does."""
        if block.id in placing.recompute:
            size = self.cold.size(block.key(self.window.fingerprint))
            why = self.paging.estimate(block, size) if size is not None else ""
            return f"recomputed (restore policy: {why})" if why else "recomputed (restore policy)"
        if block.id in placing.refresh:
            return (
                "recomputed: its whole prefix is hot again, so its partial-window KV was "
                "replaced (partial-window policy)"
            )
        return None

    async def _refresh_partial(
        self, layout: list[Block], planned: set[int], placing: Placing
    ) -> Tally:
        """Blocks holding partial-window KV whose whole prefix the plan keeps hot (with
        themselves) are computed again where the partial-window policy says so: the
        session's context is exact again once it fits. A hot one leaves the window first,
        its KV kept in this session's own cold copy until the exact KV replaces it (a
        cancelled call loses nothing)."""
        fingerprint = self.window.fingerprint
        moved = Tally()
        for block in layout:
            if block.id not in planned:
                break  # from here on, the prefix is not all hot
            resident = self.gate.resident()
            hot = self.window.residency(block, resident, ()) is Residency.HOT
            # Resident partial-window KV: the whole block, or its leading tokens at the tail.
            resident_partial = self.gate.is_partial(block, resident)
            key = block.key(fingerprint)
            local = self.window.partial_copies.get(key)
            only_copy = not hot and local in self.cold and key not in self.cold
            if not (resident_partial or only_copy):
                continue
            query = PartialWindowQuery(
                cache_class=block.cache_class,
                start=block.start,
                n_tokens=block.n_tokens,
                hot=hot,
            )
            if self.policies.partial_window.recompute(query):
                if hot:
                    moved += await self.paging.evict_blocks([block])
                elif resident_partial:  # a fragment, not a block: no copy to keep of it
                    inside = [p for p in self.ctx.positions if block.start <= p < block.end]
                    moved += await self.gate.drop(inside[0], inside[-1] + 1)
                placing.refresh.add(block.id)
        return moved

    async def _run_plan(self, layout: list[Block], planned: set[int], placing: Placing) -> Tally:
        """Run the planner's steps (:mod:`.planner`) until the context is in place, each
        planned on a fresh snapshot of the window; what they did."""
        cursor, tally = Cursor(), Tally()
        while (step := plan(self._scene(layout, planned, placing), cursor)) is not None:
            outcome, moved = await self._run_step(step, layout, tally.sources, placing)
            tally += moved
            cursor = advance(cursor, step, outcome)
        return tally

    def _scene(self, layout: list[Block], planned: set[int], placing: Placing) -> Scene:
        """What the planner sees of the window now (``layout`` is the window's blocks)."""
        resident = self.gate.resident()
        states = tuple(self._state(b, resident, placing) for b in layout)
        dropped = [(i, b) for i, b in enumerate(layout) if states[i] is Residency.DROPPED]
        fingerprint = self.window.fingerprint
        protected = self.window.protected()
        approximate = frozenset(
            i
            for i, b in dropped
            if self.approximate.entry(b, placing.approximate_runs.get(b.id)) is not None
        )
        # In a long context's window a copy restored whole beats computing a block's rest
        # after its resident first tokens: both are approximate, the copy costs no compute.
        resumes = tuple(
            0
            if self.window.virtual and i in approximate
            else self.window.resident_prefix(b, resident)
            for i, b in enumerate(layout)
        )
        return Scene(
            sizes=tuple(b.n_tokens for b in layout),
            starts=tuple(b.start for b in layout),
            states=states,
            resumes=resumes,
            planned=frozenset(i for i, b in enumerate(layout) if b.id in planned),
            protected=frozenset(i for i, b in enumerate(layout) if b.id in protected),
            approximate=approximate,
            elsewhere=frozenset(
                i for i, b in dropped if self.cold.computed(b.key(fingerprint)) is not None
            ),
            budget=self.ctx.n_ctx,
            resident=self.ctx.n_resident,
        )

    async def _run_step(
        self, step: Step, layout: list[Block], earlier: dict[int, str], placing: Placing
    ) -> tuple[int | None, Tally]:
        """Run one planned step: its outcome for :func:`~.planner.advance`, and what it
        did. ``earlier``: the sources of what the placement wrote before it."""

        def ids(indices: frozenset[int]) -> set[int]:
            return {layout[k].id for k in indices}

        match step:
            case RestoreRun(blocks=blocks, keep=keep, required=required):
                try:
                    return await self.paging.restore_run([layout[k] for k in blocks], ids(keep))
                except HotWindowFullError:
                    if required:
                        raise
                    return None, Tally()  # no room beside what must stay: they stay cold
            case Begin(index=i, clear_from=clear_from, keep=keep):
                moved = await self.paging.truncate_from(clear_from)
                if step.restore_before:
                    moved += await self.paging.restore(layout[i - 1], set())
                if step.leading:
                    moved += await self._restore_leading(layout[i], ids(keep))
                return 0, moved
            case WaitFor(index=i):
                await self._computed_elsewhere(layout[i])
                return 0, Tally()
            case Compute(index=i, blocks=blocks, keep=keep):
                moved = Tally()
                if step.restore_before:
                    moved += await self.paging.restore(layout[i - 1], set())
                    if not moved.restored:
                        # The tail must end right before the block: the block before could
                        # not come back (the store let it go), so plan again (it is
                        # computed first then).
                        return 0, moved
                if step.approximate:
                    run = placing.approximate_runs.get(layout[i].id)
                    hit, tried = await self.approximate.hit(layout[i], ids(keep), run)
                    moved += tried
                    if hit:
                        return 1, moved
                computing = [layout[k] for k in blocks]
                why = {b.id: r for b in computing if (r := self._why_computed(b, placing))}
                earlier = {**earlier, **moved.sources}
                moved += await self.computing.prefill(computing, ids(keep), earlier, why)
                return len(blocks), moved

    async def _restore_leading(self, block: Block, keep: set[int]) -> Tally:
        """Where the context diverges inside ``block``, restore the leading tokens it
        shares with a cold block at its place (the same tokens before it, so the same KV):
        the whole block comes back in place, then its tokens after the divergence go, and
        computing resumes there. Exact reuse reaches the longest shared prefix, not the
        last whole block. Only when the restore policy would restore those tokens."""
        moved = Tally()
        if self.ctx.capabilities.sliding_window:
            return moved  # not measured exact there: windowed layers keep only the window's KV
        if self.ctx.capabilities.recurrent:
            return moved  # dropping the block's tail computes its head again from a checkpoint
        found = self.cold.leading(
            self.window.fingerprint, block.prefix, block.start, block.tokens, block.lone
        )
        if found is None:
            return moved
        entry, shared = found
        shared = min(shared, block.n_tokens - 1)  # a whole match is an exact hit, not this
        if shared < LEADING_MIN_TOKENS:
            return moved
        held = entry.meta.n_tokens
        query = RestoreQuery(
            cache_class=block.cache_class, start=block.start, n_tokens=shared, n_bytes=entry.n_bytes
        )
        if held > self.paging.room(keep) or not self.policies.restore.restore(query):
            return moved
        start = block.start
        with self.cold.pinned([entry.key]):
            moved += await self.paging.make_room(held, keep | {block.id})
            began = time.perf_counter()
            lone = frozenset(start + i for i in entry.lone)
            marks = [Written(start, start + held, None, "restored", lone=lone)]
            try:
                await self.gate.call("admit", self.ctx.admit_run, [entry.block], writes=marks)
            except (EngineError, ColdBlockMismatchError):
                rejected = True
            else:
                rejected = False
                self.gate.observed_restore(began, entry.n_bytes)
                moved.wrote(marks)
        if rejected:  # bytes the engine refuses: gone from every tier, computed instead
            await self.cold.discard(entry.key)
            return moved
        if shared < held:  # the cold block may also be this one's prefix (it grew)
            moved += await self.gate.drop(start + shared, start + held)
        moved.restored += shared
        return moved

    async def _computed_elsewhere(self, block: Block) -> None:
        """Wait while another session computes ``block`` (the same tokens after the same
        prefix); the next plan sees whether its copy is in the cold store now. The wait
        cannot deadlock: a session computing blocks waits for no other session meanwhile,
        and lets go of them when it is done, fails or is cancelled."""
        done = self.cold.computed(block.key(self.window.fingerprint))
        if done is not None:
            await done.wait()

    async def last_logits(self) -> Tally:
        """Make sure logits follow the context's last token; what that did.

        They are the engine's own when it computed that token last; the ones kept with
        its block when the block left a window with exact KV (in this session, or with the
        cold copy any session restores); otherwise the token is computed again, with the
        one before it (see :meth:`.Paging.compute`).
        """
        self.gate.override = None
        last = self.window.length - 1
        if last < 0 or self.ctx.logits_position == last:
            return Tally()
        token = self.window.blocks[-1].tokens[-1]
        held = self.gate.held
        tail = self.window.blocks[-1]
        resident = self.gate.resident()
        if (
            held is not None
            and held[0] == tail.key(self.window.fingerprint)
            and held[1] == last
            and resident.get(last) == token
            and not self.gate.provenance.inexact(tail.start, tail.end, resident)
        ):
            self.gate.override = held[2]  # kept only while the whole context was exact
            return Tally()
        moved = Tally()
        if resident.get(last) == token and not self.paging.drops_alone(last):
            # On a model with recurrent layers, the state before the last token lies
            # behind a gap (no checkpoint after it): the last block is computed again,
            # after what comes back before it, instead of restored as the window's end.
            self.window.unresumable.add(tail.key(self.window.fingerprint))
            moved += await self.paging.truncate_from(tail.start)
            moved += await self._place(self.window.blocks)
            if self.ctx.logits_position == last:
                return moved
            resident = self.gate.resident()
        if resident.get(last) == token:
            moved += await self.gate.drop(last, last + 1)
        moved += (await self.computing.compute([token], last, {tail.id}))[2]
        moved.prefilled += 1
        return moved
