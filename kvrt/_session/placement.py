"""Placement: a context asked for becomes blocks (plan), the blocks come in left to right
within the hot budget (place), and planned blocks pushed out meanwhile come back
(converge); then logits follow the context's last token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import anyio

from .._backend import Engine, EvictMode
from .._errors import (
    ContextTooLargeError,
    HotWindowFullError,
    InvalidContextError,
    NotVisibleError,
)
from .._reports import ContextStatus
from .._types import PartialWindowQuery, Residency, RestoreQuery
from .gate import Tally, Written
from .layout import Block, Segment
from .scoring import Scoring

__all__ = [
    "LEADING_MIN_TOKENS",
    "Placement",
    "Prepared",
    "ReplyTokens",
    "TokenKey",
    "context_tokens",
    "segment_tokens",
]

LEADING_MIN_TOKENS = 8
"""The fewest leading tokens of a block worth restoring from a cold block that diverges
after them (a whole block comes back to keep them): fewer are computed with the rest."""

TokenKey = tuple[str, bool, bool, tuple[tuple[int, int], ...]]
"""What a segment's tokens depend on: its text, whether it opens the context, whether it
parses special tokens, and its markup ranges."""


ReplyTokens = tuple[str, list[int], str]
"""A reply placed with its generated tokens: its text, the tokens, and the text after
them still to tokenize (a stop sequence may have cut the last token short)."""


def segment_tokens(
    engine: Engine, segment: Segment, *, first: bool, reply: ReplyTokens | None = None
) -> list[int]:
    """A segment's tokens as a session places them: special tokens (BOS) only before the
    context's first segment; special-token markup read only where the segment says so;
    a plain piece holding ``reply``'s text placed with the reply's generated tokens."""
    out: list[int] = []
    for text, special in segment.pieces():
        if reply is not None and out and not special and text == reply[0]:
            out += reply[1]
            if reply[2]:
                out += engine.tokenize(reply[2], add_special=False, parse_special=False)
            continue
        out += engine.tokenize(text, add_special=first and not out, parse_special=special)
    return out


LONG_TEXT = 1 << 16
"""Characters past which a piece of text is first counted in chunks against the planner
context, so a text far too large is refused after reading a little of it."""


def check_fits(engine: Engine, segments: Sequence[Segment], limit: int) -> None:
    """Refuse, cheaply, a context whose text holds more tokens than ``limit``: long
    pieces are tokenized a chunk at a time, stopping as soon as the count passes the
    limit (a 10 MB prompt is refused after tokenizing about the planner context's worth,
    not all of it). Short contexts cost nothing here: placing them counts exactly."""
    if sum(len(seg.text) for seg in segments) <= LONG_TEXT:
        return
    count = 0
    for seg in segments:
        for text, special in seg.pieces():
            for at in range(0, len(text), LONG_TEXT):
                piece = text[at : at + LONG_TEXT]
                # A cut may split a token in two: one extra per chunk at most.
                count += len(engine.tokenize(piece, add_special=False, parse_special=special)) - 1
                if count > limit:
                    raise ContextTooLargeError(
                        f"the context needs more than {limit} tokens (the session's planner "
                        f"context): segment {seg.name!r} alone holds {len(seg.text)} characters"
                    )


def context_tokens(engine: Engine, segments: Sequence[Segment]) -> list[int]:
    """The tokens of a whole context, as a session lays them out."""
    return [t for i, seg in enumerate(segments) for t in segment_tokens(engine, seg, first=i == 0)]


class Prepared:
    """A prefetch's hand-over to the ``ensure_context`` it prepares, carried by that call's
    command through the mailbox: its tokenizations once they are done, and ``cancel`` to
    stop it when the call begins before they are (it is of no more use then)."""

    __slots__ = ("cancel", "tokens")

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.tokens: dict[TokenKey, list[int]] | None = None
        """Set by the prefetch when its tokenizations are done; ``None`` until then."""
        self.cancel = cancel


class Placement(Scoring):
    """Makes the hot window hold a context the way the eviction policy plans it."""

    # -- commands --

    def tokenize(
        self,
        segments: Sequence[Segment],
        *,
        known: dict[TokenKey, list[int]] | None = None,
        remember: dict[TokenKey, list[int]] | None = None,
        replies: Mapping[str, ReplyTokens] | None = None,
    ) -> list[tuple[Segment, list[int]]]:
        """Each segment with its tokens (empty segments left out); safe from any thread.

        Uses the tokenizations in ``known`` (a prefetch's); ``remember`` receives every
        tokenization made; ``replies`` names segments holding a reply to place with its
        generated tokens.
        """
        check_fits(self.engine, segments, self.window.planner_context)
        out = []
        cache = known or {}
        replies = replies or {}
        for i, seg in enumerate(segments):  # Segments, checked by the session handle
            key = (seg.text, i == 0, seg.parse_special, seg.markup)
            reply = replies.get(seg.name)
            toks = cache.get(key) if reply is None else None
            if toks is None:
                toks = segment_tokens(self.engine, seg, first=i == 0, reply=reply)
            if remember is not None:
                remember[key] = toks
            out.append((seg, toks))
        if not any(toks for _, toks in out):
            raise InvalidContextError("the context is empty: every segment's text is empty")
        return [(seg, toks) for seg, toks in out if toks]

    async def _ensure(
        self,
        segments: Sequence[Segment],
        prepared: Prepared | None = None,
        replies: Mapping[str, ReplyTokens] | None = None,
        require: tuple[str, ...] = (),
    ) -> ContextStatus:
        self.counters.ensure_calls += 1
        self._tally = tally = Tally()
        known = None
        if prepared is not None:
            known = prepared.tokens
            if known is None:
                prepared.cancel()  # not ready when its call began: of no more use
        tokenize = partial(self.tokenize, segments, known=known, replies=replies)
        tokenized = await anyio.to_thread.run_sync(tokenize)
        return await self._ensure_placed(tokenized, tally, require)

    async def _ensure_placed(
        self,
        tokenized: list[tuple[Segment, list[int]]],
        tally: Tally,
        require: tuple[str, ...] = (),
    ) -> ContextStatus:
        self._check_visible(tokenized, require)
        layout, stale = self.window.plan_layout(tokenized)
        copies = self.window.partial_copies  # forget the copies the store let go
        self.window.partial_copies = {k: v for k, v in copies.items() if v in self.cold}
        await self.cold.discover(b.key(self.window.fingerprint) for b in layout)
        resident = self.resident(layout)  # as the new layout's blocks see the engine
        tally.reused = sum(
            b.n_tokens for b in layout if self.window.residency(b, resident, ()) is Residency.HOT
        )
        # A replaced block whose tokens the new context starts with the same (a reply that
        # grew, the same question asked again) stays where it is for them: it is copied to
        # the cold store, not evicted, and the rest of it is tidied away.
        kept = self.window.kept_positions(layout, resident)
        stale.sort(key=lambda b: b.start)
        superseded = [b for b in stale if any(p in kept for p in range(b.start, b.end))]
        await self._write_back(superseded, local=True)
        await self._evict_blocks([b for b in stale if b not in superseded])
        self.placed = False
        self.window.adopt(layout)
        self.window.required = frozenset(require)
        await self._tidy()
        await self._place(layout)
        await self._last_logits()
        self.placed = True
        unseen = [
            b.segment for b in layout if b.segment in require and self.state(b) is not Residency.HOT
        ]
        if unseen:  # the plan keeps them hot, so this means a block could not come back
            raise NotVisibleError(
                f"segment {unseen[0]!r} is required visible but not all of it is hot"
            )
        return self._status(tally)

    def _check_visible(
        self, tokenized: list[tuple[Segment, list[int]]], require: tuple[str, ...]
    ) -> None:
        """Refuse, before anything moves, a context whose required segments cannot be hot
        together with the sinks and the recent window."""
        if not require:
            return
        need = self.window.protected_tokens(tokenized, require)
        if need > self.ctx.n_ctx:
            sizes = ", ".join(
                f"{seg.name!r} {len(toks)}" for seg, toks in tokenized if seg.name in require
            )
            raise NotVisibleError(
                f"the segments required visible ({sizes} tokens), with the sinks and the recent "
                f"window, need {need} tokens hot, more than the hot window's {self.ctx.n_ctx}: "
                "require fewer segments, shorten them, or open the session with more hot_tokens"
            )

    async def _place(self, layout: list[Block]) -> None:
        """Bring the layout's blocks in, left to right, keeping the window within budget.

        Cold blocks come back when the plan (the policy applied to the whole context) keeps
        them hot. llama.cpp computes only at the tail of the window, so from the first block
        that must be computed on, blocks are placed in order and a computed block's
        predecessor is made resident first.
        """
        policy = self.policies.hot_eviction
        await self._score()
        planned = self.window.plan_hot(policy.order, self.ctx.n_ctx)
        self._recompute = set()
        resident = self.resident()
        for block in layout:
            if self.window.residency(block, resident, self.cold) is Residency.COLD:
                size = self.cold.size(block.key(self.window.fingerprint))
                query = self._query(block, size or 0)
                if not self.policies.restore.restore(query):
                    self._recompute.add(block.id)
        self._find_approximate_runs(layout)
        try:
            await self._refresh_partial(layout, planned)
            await self._place_blocks(layout, planned)
            await self._converge(layout, planned)
        finally:
            self._recompute = set()
            self._refresh = set()
            self._approximate_runs = {}

    async def _refresh_partial(self, layout: list[Block], planned: set[int]) -> None:
        """Blocks holding partial-window KV whose whole prefix the plan keeps hot (with
        themselves) are computed again where the partial-window policy says so: the
        session's context is exact again once it fits. A hot one leaves the window first,
        its KV kept in this session's own cold copy until the exact KV replaces it (a
        cancelled call loses nothing)."""
        fingerprint = self.window.fingerprint
        for block in layout:
            if block.id not in planned:
                return  # from here on, the prefix is not all hot
            resident = self.resident()
            hot = self.window.residency(block, resident, ()) is Residency.HOT
            # Resident partial-window KV: the whole block, or its leading tokens at the tail.
            resident_partial = self.is_partial(block, resident)
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
                    await self._evict_blocks([block])
                elif resident_partial:  # a fragment, not a block: no copy to keep of it
                    inside = [p for p in self.ctx.positions if block.start <= p < block.end]
                    await self._engine(
                        "evict", self.ctx.evict, inside[0], inside[-1] + 1, EvictMode.GAP
                    )
                self._refresh.add(block.id)

    async def _converge(self, layout: list[Block], planned: set[int]) -> None:
        """Bring back planned blocks that computing later ones pushed out, in exchange for
        unplanned ones, so the window ends as the eviction policy chose."""
        for block in layout:
            if block.id in planned and self.state(block) is Residency.COLD:
                try:
                    await self._restore_run([block], planned)
                except HotWindowFullError:
                    return  # only planned or protected blocks left to evict

    async def _place_blocks(self, layout: list[Block], planned: set[int]) -> None:
        i, computing = 0, False
        while i < len(layout):
            block = layout[i]
            pred = {layout[i - 1].id} if i else set()
            state = self.state(block)
            if state is Residency.HOT:
                i += 1
                continue
            if state is Residency.COLD:
                # Restore what the plan keeps hot, and a block the next one is computed after;
                # adjacent planned cold blocks come back in one go.
                after = layout[i + 1] if i + 1 < len(layout) else None
                feeds = computing and after is not None and self.state(after) is Residency.DROPPED
                if block.id not in planned and not feeds:
                    i += 1
                    continue
                run = [block]
                while (
                    i + len(run) < len(layout)
                    and layout[i + len(run)].id in planned
                    and self.state(layout[i + len(run)]) is Residency.COLD
                ):
                    run.append(layout[i + len(run)])
                # The block before stays only if the plan keeps it or this run feeds a
                # computation; otherwise it may make room like any unplanned block.
                keep = pred if feeds or pred <= planned else set()
                try:
                    restored = await self._restore_run(run, keep)
                except HotWindowFullError:
                    if feeds:
                        raise
                    i += len(run)  # no room beside what must stay: these blocks stay cold
                    continue
                if not restored:
                    continue  # dropped from the store meanwhile: look again
                i += restored
                continue
            if not computing:
                j = i
                while j > 0 and self.state(layout[j - 1]) is Residency.DROPPED:
                    j -= 1
                resumes = self.window.resident_prefix(layout[j], self.resident())
                await self._truncate_from(layout[j].start + resumes)
                if j > 0 and self.state(layout[j - 1]) is Residency.COLD:
                    await self._restore(layout[j - 1], set())
                if not resumes:
                    keep = {layout[j - 1].id} if j else set()
                    await self._restore_leading(layout[j], keep)
                computing, i = True, j
                continue
            if i and self.state(layout[i - 1]) is not Residency.HOT:
                await self._restore(layout[i - 1], set())  # the tail must end right before it
            if await self._computed_elsewhere(block):
                continue  # another session computed it meanwhile: restore it instead
            if await self._approximate_hit(block, pred):
                i += 1
                continue
            run, room = [block], self._room(pred)
            while i + len(run) < len(layout):
                after = layout[i + len(run)]
                if (
                    self.state(after) is not Residency.DROPPED
                    or sum(b.n_tokens for b in run) + after.n_tokens > room
                    or self._approximate_entry(after) is not None
                ):
                    break
                run.append(after)
            await self._prefill(run, pred)
            i += len(run)

    async def _restore_leading(self, block: Block, keep: set[int]) -> None:
        """Where the context diverges inside ``block``, restore the leading tokens it
        shares with a cold block at its place (the same tokens before it, so the same KV):
        the whole block comes back in place, then its tokens after the divergence go, and
        computing resumes there. Exact reuse reaches the longest shared prefix, not the
        last whole block. Only when the restore policy would restore those tokens."""
        if self.ctx.capabilities.sliding_window:
            return  # not measured exact there: windowed layers keep only the window's KV
        found = self.cold.leading(self.window.fingerprint, block.prefix, block.start, block.tokens)
        if found is None:
            return
        entry, shared = found
        shared = min(shared, block.n_tokens - 1)  # a whole match is an exact hit, not this
        if shared < LEADING_MIN_TOKENS:
            return
        held = entry.meta.n_tokens
        query = RestoreQuery(
            cache_class=block.cache_class, start=block.start, n_tokens=shared, n_bytes=entry.n_bytes
        )
        if held > self._room(keep) or not self.policies.restore.restore(query):
            return
        start = block.start
        with self.cold.pinned([entry.key]):
            await self._make_room(held, keep | {block.id})
            began = time.perf_counter()
            await self._engine(
                "admit",
                self.ctx.admit_run,
                [entry.block],
                writes=[Written(start, start + held, None, "restored")],
            )
            self._observed_restore(began, entry.n_bytes)
            if shared < held:  # the cold block may also be this one's prefix (it grew)
                await self._engine(
                    "evict", self.ctx.evict, start + shared, start + held, EvictMode.GAP
                )
        self._tally.restored += shared

    async def _computed_elsewhere(self, block: Block) -> bool:
        """Wait while another session computes ``block`` (the same tokens after the same
        prefix); True if its copy is now in the cold store. The wait cannot deadlock: a
        session computing blocks waits for no other session meanwhile, and lets go of
        them when it is done, fails or is cancelled."""
        done = self.cold.computed(block.key(self.window.fingerprint))
        if done is None:
            return False
        await done.wait()
        return self.state(block) is Residency.COLD

    async def _last_logits(self) -> None:
        """Make sure logits follow the context's last token.

        They are the engine's own when it computed that token last; the ones kept with
        its block when the block left a window with exact KV (in this session, or with the
        cold copy any session restores); otherwise the token is computed again, with the
        one before it (see :meth:`_compute`).
        """
        self._override = None
        last = self.window.length - 1
        if last < 0 or self.ctx.logits_position == last:
            return
        token = self.window.blocks[-1].tokens[-1]
        held = self._held
        tail = self.window.blocks[-1]
        resident = self.resident()
        if (
            held is not None
            and held[0] == tail.key(self.window.fingerprint)
            and held[1] == last
            and resident.get(last) == token
            and not self.provenance.inexact(tail.start, tail.end, resident)
        ):
            self._override = held[2]  # kept only while the whole context was exact
            return
        if resident.get(last) == token:
            await self._engine("evict", self.ctx.evict, last, last + 1, EvictMode.GAP)
        await self._compute([token], last, {tail.id})
        self._tally.prefilled += 1
