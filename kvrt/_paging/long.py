"""Every context a session is sent, placed: through :mod:`.placement` where it fits the
planner context, and, in a session opened with ``long_context=True``, as a *long context*
past it — as long as the cold tiers hold, however short the model's trained context.

A long context is kept as blocks at their logical positions (:class:`LongBlock`), each
block's KV in the cold store, and shown to the engine through *windows*: contexts that
fit the hot window, placed by :mod:`.placement` as any other, at positions from 0, so
attention never sees a position the model was not trained on.

- Blocks no window has computed yet are computed a window at a time (an *ingest*): the
  sinks, the tokens just before the new blocks (half the window at most), then as many new
  blocks as fit. The first window is the context itself, exact; later ones see what came
  just before them, not the whole context.
- The last window shows the sinks, the blocks the session's hot-eviction policy keeps for
  the query (scored by relevance to the context's last segment, with key sketches kept in
  RAM, so scoring reads no KV), and the recent tail, which holds the query.
- A block shown at another position than where it was computed comes back from its copy
  with its keys turned by the engine's own shift (an approximate hit), and what is
  computed after it is approximate too: every such token is labelled so, never an exact
  hit for anyone. Blocks computed at window positions are stored under this session's own
  keys (``LONG_PREFIX``), in RAM and on the disk tier, never in a shared one.

Positions past the window never exist: a long context costs the engine a window's
attention per token, whatever its length.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import NamedTuple

import msgspec

from .._cold import LONG_PREFIX, ColdKey, token_digest
from .._engine.contract import ColdBlock, KeySketching
from .._errors import ContextTooLargeError, InvalidArgumentError, NotVisibleError
from .._reports import ContextStatus, LongContextStatus
from .._threads import in_thread
from .._types import ApproximateQuery, BlockView, KeySketches, Residency
from ..policy import Arranging, Relevance
from .gate import Tally
from .placement import Placement
from .segments import LongBlock, Placed, Segment
from .sketches import SketchStore
from .tokens import Prepared, ReplyTokens

__all__ = ["LongContext"]


class LongContext:
    """Places a session's contexts, long ones as windows (see the module's text)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.gate, self.paging = placement.gate, placement.paging
        self.ctx, self.window, self.cold = placement.ctx, placement.window, placement.cold
        self.policies = placement.policies
        self.copies: dict[ColdKey, ColdKey] = {}
        """A block's logical key -> the key of its KV's copy in the cold store."""
        self.sketches = SketchStore()
        """A block's logical key -> the sketch of its keys (RoPE undone), for scoring."""
        self.unsketched: set[ColdKey] = set()
        """Logical keys of blocks the engine could not sketch."""
        self.last: _Hidden | None = None
        """What the window of the long context placed last leaves out."""
        self.shown: set[ColdKey] = set()
        """The logical keys of the blocks the window of the long context placed last shows."""
        self.arranged: list[ColdKey] = []
        """The logical keys of the blocks chosen for the last question, as its window
        showed them."""
        self.progress: tuple[int, int] | None = None
        """(tokens computed, tokens to compute) of the long context being placed now."""
        self._salt = os.urandom(16)

    async def ensure(
        self,
        segments: Sequence[Segment],
        prepared: Prepared | None = None,
        replies: Mapping[str, ReplyTokens] | None = None,
        require: tuple[str, ...] = (),
    ) -> tuple[ContextStatus, Tally]:
        """Place ``segments``: what the context is now, and what placing it did."""
        self.gate.counters.ensure_calls += 1
        known = None
        if prepared is not None:
            known = prepared.tokens
            if known is None:
                prepared.cancel()  # not ready when its call began: of no more use
        tokenize = partial(self.placement.tokenize, segments, known=known, replies=replies)
        tokenized = await in_thread(tokenize)
        total = sum(len(p.tokens) for p in tokenized)
        if not self.window.long_limit or total <= self.window.planner_context:
            self.window.virtual, self.window.long_copies = False, {}
            return await self.placement.ensure_placed(tokenized, require)
        return await self._ensure_long(tokenized, require)

    # -- a long context --

    async def _ensure_long(
        self, tokenized: list[Placed], require: tuple[str, ...]
    ) -> tuple[ContextStatus, Tally]:
        blocks = self._blocks(tokenized)
        total = blocks[-1].start + len(blocks[-1].tokens)
        if total > self.window.long_limit:
            raise ContextTooLargeError(
                f"the context needs {total} tokens but the session's long context holds "
                f"{self.window.long_limit} (the hot window plus what memory.cold and the disk "
                "tier's budget hold): raise memory.cold or disk.budget"
            )
        current = {b.key for b in blocks}  # what the next context may ask for again
        # The last context's other sketches go before this one's are made: their slots
        # are reused, and the arena holds one context's.
        self.sketches.keep(current)
        try:
            return await self._place_long(blocks, require)
        finally:
            self.progress = None
            self.copies = {k: v for k, v in self.copies.items() if k in current}
            self.sketches.keep(current)
            self.unsketched &= current

    async def _place_long(
        self, blocks: list[LongBlock], require: tuple[str, ...]
    ) -> tuple[ContextStatus, Tally]:
        """Compute the blocks no window has computed yet, a window at a time, then show
        the last window: the sinks, the blocks chosen for the query, the tail."""
        cap = self.ctx.n_ctx - self.window.block_tokens  # a restore splices through one spare block
        sinks = [i for i, b in enumerate(blocks) if b.start < max(1, self.window.sink_tokens)]
        tail = self._tail(blocks, cap)
        fixed = {*sinks, *tail} | {i for i, b in enumerate(blocks) if b.segment.name in require}
        room = cap - self._size(blocks, set(sinks))
        if room < 2 * self.window.block_tokens or self._size(blocks, fixed) > cap:
            raise NotVisibleError(
                f"a hot window of {self.ctx.n_ctx} tokens is too small to show a long context "
                f"of {self.window.block_tokens}-token blocks with its sinks, the recent window "
                "and the segments required visible: open the session with more hot_tokens"
            )
        self.window.virtual = True
        self.sketches.reserve(len(blocks))
        await self._sketch_copies(blocks, set(tail))
        todo = [i for i in range(len(blocks)) if i not in tail and not self._held(blocks[i])]
        due = self._size(blocks, {i for i in range(len(blocks)) if not self._held(blocks[i])})
        tally, windows, computed = Tally(), 0, 0
        self.progress = (0, due)
        while todo:
            self.shown = set()  # an ingest window takes the engine's window
            shown, new = self._ingest_window(blocks, sinks, todo, room)
            tally += await self._show(blocks, shown, new)
            windows += 1
            computed += self._size(blocks, set(new))
            self.progress = (computed, due)
            done = set(new)
            todo = [i for i in todo if i not in done]
        began = time.perf_counter()
        chosen, scores = await self._choose(blocks, fixed, cap - self._size(blocks, fixed))
        scoring = time.perf_counter() - began
        # The sinks and required segments, the chosen blocks as the policy arranges them,
        # the tail holding the query.
        shown = [*sorted(fixed.difference(tail)), *chosen, *tail]
        self.arranged = [blocks[i].key for i in chosen]
        new = self._computed(blocks, shown, set(sinks))
        due += self._size(blocks, {i for i in new if self._held(blocks[i])})  # afresh
        self.progress = (computed, due)
        self.shown = set()
        tally += await self._show(blocks, shown, new, scores, sketch=False)
        self.shown = {blocks[i].key for i in shown}
        computed += self._size(blocks, set(new))
        self.progress = (computed, due)
        self.last = self._summary(blocks, shown, len(chosen), computed, windows + 1, scoring)
        return self.told(self.gate.status(tally)), tally

    def _blocks(self, tokenized: list[Placed]) -> list[LongBlock]:
        fingerprint = self.window.fingerprint
        spans = {p.segment.name: len(p.tokens) > self.window.block_tokens for p in tokenized}
        out = []
        for seg, index, pos, chunk, prefix, lone in self.window.chunks(tokenized):
            name = f"{seg.name}#{index}" if spans[seg.name] else seg.name
            key = ColdKey(fingerprint, prefix, token_digest(chunk, lone=lone), pos)
            out.append(LongBlock(seg, name, pos, chunk, frozenset(lone), key))
        return out

    @staticmethod
    def _size(blocks: Sequence[LongBlock], which: set[int]) -> int:
        return sum(len(blocks[i].tokens) for i in which)

    def _tail(self, blocks: Sequence[LongBlock], cap: int) -> list[int]:
        """The last blocks, holding the query: the recent window, at least a quarter of
        the window shown."""
        want = max(self.window.recent_tokens, cap // 4)
        tail: list[int] = []
        size = 0
        for i in range(len(blocks) - 1, 0, -1):
            if size >= want:
                break
            tail.insert(0, i)
            size += len(blocks[i].tokens)
        return tail

    def _held(self, block: LongBlock) -> bool:
        """Whether a cold tier holds a copy of ``block``'s KV."""
        copy = self.copies.get(block.key)
        return copy is not None and copy in self.cold

    def _computed(
        self, blocks: Sequence[LongBlock], shown: list[int], sinks: set[int]
    ) -> list[int]:
        """The blocks of the window shown for the question that are computed in it: those
        without a copy, and those the long window's approximate-hit policy does not let
        come back from their copy at the position shown (``allow``, unless the session
        names one, restores them, keys turned; ``never`` computes them afresh in the
        window). The sinks, and blocks the engine's window still holds from the last
        question, stay as they are."""
        policy = self.policies.long_approximate
        per_token = self.gate.engine.facts.kv_bytes_per_token
        new, at = [], 0
        for i in shown:
            block = blocks[i]
            copy = self.copies.get(block.key)
            if not self._held(block):
                new.append(i)
            elif copy is not None and i not in sinks and block.key not in self.shown:
                query = ApproximateQuery(
                    cache_class=block.segment.cache_class,
                    start=at,
                    source_start=copy.start,
                    n_tokens=len(block.tokens),
                    n_bytes=len(block.tokens) * per_token,
                )
                if not policy.accept(query):
                    new.append(i)
            at += len(block.tokens)
        return new

    def _ingest_window(
        self, blocks: Sequence[LongBlock], sinks: list[int], todo: list[int], room: int
    ) -> tuple[list[int], list[int]]:
        """The blocks of the next ingest window (sinks, what comes just before the first
        block still to compute, then new blocks), and the new ones."""
        first = todo[0]
        recent: list[int] = []
        size = 0
        for i in range(first - 1, -1, -1):
            if i in sinks or size + len(blocks[i].tokens) > room // 2:
                break
            recent.insert(0, i)
            size += len(blocks[i].tokens)
        wanted = set(todo)
        new: list[int] = []
        for i in range(first, len(blocks)):
            if i not in wanted or size + len(blocks[i].tokens) > room:
                break
            new.append(i)
            size += len(blocks[i].tokens)
        shown = sorted({*sinks, *recent, *new})
        return shown, [i for i in shown if i in wanted]

    async def _show(
        self,
        blocks: Sequence[LongBlock],
        shown: list[int],
        new: list[int],
        scores: _Scores | None = None,
        *,
        sketch: bool = True,
    ) -> Tally:
        """Place the window of ``shown`` blocks; copy the ``new`` ones it computed to the
        cold store, under this session's own keys where their KV is approximate, and
        ``sketch`` them while they are hot (a question's window leaves its own to a later
        question, from their copies: not on the way to its first token).

        The window is not scored again: it fits the engine's whole, and its blocks keep
        the ``scores`` that chose them (an ingest window's, none) for what generating
        past its end evicts."""
        placed = [blocks[i].placed() for i in shown]
        fresh = set(new)
        fingerprint = self.window.fingerprint
        self.window.long_copies = {}
        given: dict[ColdKey, float | None] = {}
        for i, (_, _, pos, chunk, prefix, lone) in zip(
            shown, self.window.chunks(placed), strict=True
        ):
            key = ColdKey(fingerprint, prefix, token_digest(chunk, lone=lone), pos)
            if i in fresh:
                self.window.long_copies[key] = self._copy_key(blocks[i], key)
            if scores is not None:
                given[key] = scores.by_block.get(i)
        how = scores.how if scores is not None else "none: a window computing a long context"
        held = [c for i in shown if i not in fresh and (c := self.copies.get(blocks[i].key))]
        for key in held:
            if self.cold.tier(key) not in (None, "ram"):
                await self.cold.promote(key)
        with self.cold.pinned(held), self.placement.scoring.given(given, how):
            _, tally = await self.placement.ensure_placed(placed)
        shown_blocks = dict(zip(shown, self.window.blocks, strict=True))
        computed = [shown_blocks[i] for i in new]
        await self.paging.write_back(computed, local=True)
        resident = self.gate.resident()
        hot = []
        for i in new:
            block = shown_blocks[i]
            stored = self.gate.stored_key(block)
            if stored is not None and stored in self.cold:
                self.copies[blocks[i].key] = stored
            if self.window.residency(block, resident, ()) is Residency.HOT:
                hot.append((i, block))
        if sketch and hot and isinstance(self.ctx, KeySketching):
            ranges = [(b.start, b.end) for _, b in hot]
            made = await self.gate.call("sketch hot", self.ctx.key_sketches, ranges)
            for (i, _), one in zip(hot, made, strict=True):
                if one is not None:
                    self.sketches.put(blocks[i].key, one)
        return tally

    def _copy_key(self, block: LongBlock, shown: ColdKey) -> ColdKey:
        """This session's key for ``block``'s KV computed as ``shown`` (the key of the
        block in the window): unique to the session and to where it was computed."""
        h = hashlib.blake2b(self._salt, digest_size=16)
        h.update(block.key.prefix.encode() + b"\0" + shown.prefix.encode())
        return ColdKey(shown.fingerprint, LONG_PREFIX + h.hexdigest(), shown.tokens, shown.start)

    async def _choose(
        self, blocks: Sequence[LongBlock], fixed: set[int], budget: int
    ) -> tuple[list[int], _Scores]:
        """The blocks shown besides ``fixed``: all of them, less those the hot-eviction
        policy lets go first (by relevance to the query, for a policy that scores), until
        the rest fit ``budget``; in the order the policy shows them (the context's own
        where it does not say). And the scores it chose them by."""
        body = [i for i in range(len(blocks)) if i not in fixed]
        scores, how = await self._scores(blocks, body)
        scored = _Scores(dict(zip(body, scores, strict=True)), how)
        views = [
            BlockView(
                id=i,
                cache_class=blocks[i].segment.cache_class,
                start=blocks[i].start,
                n_tokens=len(blocks[i].tokens),
                last_used=i,
                score=blocks[i].segment.score,
                relevance=score,
                shown=blocks[i].key in self.shown,
            )
            for i, score in zip(body, scores, strict=True)
        ]
        chosen = set(body)
        size = self._size(blocks, chosen)
        for i in self.policies.hot_eviction.order(views):
            if size <= budget:
                break
            chosen.discard(i)
            size -= len(blocks[i].tokens)
        policy = self.policies.hot_eviction
        if not isinstance(policy, Arranging):
            return sorted(chosen), scored
        last = {key: k for k, key in enumerate(self.arranged)}
        given = sorted(
            (v for v in views if v.id in chosen),
            key=lambda v: (last.get(blocks[v.id].key, len(last)), v.start),
        )
        arranged = policy.arrange(given)
        if sorted(arranged) != sorted(chosen):
            raise InvalidArgumentError(
                f"{type(policy).__name__}.arrange returned {len(arranged)} ids: it must "
                f"return the {len(chosen)} blocks it was given, each once"
            )
        return arranged, scored

    async def _scores(
        self, blocks: Sequence[LongBlock], body: list[int]
    ) -> tuple[list[float | None], str | None]:
        """Each body block's relevance to the query (the last segment's last window of
        tokens), as the session's hot-eviction policy scores it, None where it scores
        nothing; and how they were scored (see :attr:`SessionReport.relevance_scoring`)."""
        if not body or not isinstance(self.policies.hot_eviction, Relevance):
            return [None] * len(body), None
        last = blocks[-1].segment.name
        segment = tuple(t for b in blocks if b.segment.name == last for t in b.tokens)
        query = segment[-self.window.block_tokens :]

        async def sketches() -> KeySketches:
            return self.sketches.select([blocks[i].key for i in body])

        # The whole last segment's keys, as a window's placement asks (the engine keeps its
        # last tokens): one sketch for both.
        tokens = [blocks[i].tokens for i in body]
        return await self.placement.scoring.relevance(tokens, query, sketches, key_query=segment)

    async def _sketch_copies(self, blocks: Sequence[LongBlock], tail: set[int]) -> None:
        """Sketch, from their copies in RAM (scoring never reads from disk), the blocks that
        have a copy but no sketch and may be scored now (the tail never is): those the
        last question's window computed, and any a cancelled placement computed without
        sketching them. Done before any new block is computed, which may push their
        copies out of RAM."""
        ctx = self.ctx
        if not isinstance(ctx, KeySketching):
            return
        found: list[tuple[ColdKey, ColdBlock]] = []
        for i, block in enumerate(blocks):
            if i in tail or block.key in self.sketches or block.key in self.unsketched:
                continue
            copy = self.copies.get(block.key)
            if copy is not None and (entry := self.cold.peek(copy)) is not None:
                found.append((block.key, entry.block))
        if not found:
            return
        made = await self.gate.call(
            "sketch cold", lambda: [ctx.cold_key_sketch(data) for _, data in found]
        )
        for (key, _), one in zip(found, made, strict=True):
            if one is None:
                self.unsketched.add(key)  # the engine cannot sketch it: not asked again
            else:
                self.sketches.put(key, one)

    def _summary(
        self,
        blocks: Sequence[LongBlock],
        shown: list[int],
        chosen: int,
        computed: int,
        windows: int,
        scoring: float,
    ) -> _Hidden:
        """What the window ``shown`` leaves out of the whole context, and how it was shown."""
        seen = set(shown)
        hidden = [i for i in range(len(blocks)) if i not in seen]
        unseen: list[str] = []
        for i in hidden:
            if blocks[i].segment.name not in unseen:
                unseen.append(blocks[i].segment.name)
        long = LongContextStatus(
            shown_tokens=self._size(blocks, seen),
            blocks=len(blocks),
            chosen_blocks=chosen,
            computed_tokens=computed,
            windows=windows,
            scoring_seconds=scoring,
            sketch_bytes=self.sketches.nbytes,
        )
        cold = self._size(blocks, {i for i in hidden if self._held(blocks[i])})
        return _Hidden(self._size(blocks, set(hidden)), cold, tuple(unseen), long)

    @property
    def hidden_tokens(self) -> int:
        """Tokens of the context placed last that the window shown leaves out (0 unless it
        is a long context)."""
        return self.last.tokens if self.window.virtual and self.last is not None else 0

    @property
    def hidden_segments(self) -> tuple[str, ...]:
        """Segments of the long context placed last not shown whole (none unless it is)."""
        return self.last.segments if self.window.virtual and self.last is not None else ()

    def told(self, status: ContextStatus) -> ContextStatus:
        """``status`` of the window shown, told of the whole context placed last (itself
        unless that is a long context)."""
        if not self.window.virtual or self.last is None:
            return status
        hidden, cold, unseen, long = self.last
        origins = msgspec.structs.replace(status.origins, not_hot=status.origins.not_hot + hidden)
        return msgspec.structs.replace(
            status,
            logical_tokens=status.logical_tokens + hidden,
            cold_tokens=status.cold_tokens + cold,
            dropped_tokens=status.dropped_tokens + hidden - cold,
            invisible_segments=unseen,
            origins=origins,
            exact=False,  # a window of the context, never what computing all of it gives
            long=long,
        )


class _Scores(NamedTuple):
    """How relevant each body block of a long context is to its query (None: unscored),
    by block index; and how they were scored."""

    by_block: dict[int, float | None]
    how: str | None


class _Hidden(NamedTuple):
    """What a long context's window leaves out: tokens, those with a cold copy, the
    segments not shown whole; and how it was shown."""

    tokens: int
    cold: int
    segments: tuple[str, ...]
    long: LongContextStatus
