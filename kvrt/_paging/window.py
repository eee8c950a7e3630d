"""The hot-window bookkeeping of one session: segments, blocks and where each block lives.

Everything here is synchronous and free of ``await``: the session actor calls it between
engine operations. Residency is never stored; it is derived from the engine context's own
record of resident tokens and from the cold store, so a cancelled operation can never
leave the bookkeeping believing something that is not so.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from .._cold import ColdKey, token_digest
from .._engine.contract import EngineContext, ModelFacts
from .._errors import (
    ContextTooLargeError,
    InvalidArgumentError,
    InvalidContextError,
    UnknownSegmentError,
)
from .._types import BlockView, CacheClass, Residency
from .segments import Placed, Segment

__all__ = ["Block", "HotWindow", "long_limit", "runs_of"]


def runs_of(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Ascending positions as [start, end) ranges of consecutive ones."""
    ranges: list[tuple[int, int]] = []
    for p in positions:
        if ranges and ranges[-1][1] == p:
            ranges[-1] = (ranges[-1][0], p + 1)
        else:
            ranges.append((p, p + 1))
    return ranges


@dataclass(slots=True, eq=False)
class Block:
    """A token range of one segment: the unit of residency."""

    id: int
    segment: str
    index: int
    cache_class: CacheClass
    start: int
    tokens: list[int]
    prefix: str
    """Digest of every logical token before ``start``."""
    last_used: int
    score: float | None = None
    lone: set[int] = field(default_factory=set)
    """Offsets of the tokens whose KV is computed alone, as a generated token's is (the
    rest in batches): part of the block's identity and of every later block's prefix."""
    _key: ColdKey | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def key(self, fingerprint: str) -> ColdKey:
        if self._key is None or self._key.fingerprint != fingerprint:
            digest = token_digest(self.tokens, lone=self.lone)
            self._key = ColdKey(fingerprint, self.prefix, digest, self.start)
        return self._key

    @property
    def next_prefix(self) -> str:
        """The prefix digest of a block that follows this one."""
        return token_digest(self.tokens, self.prefix.encode(), lone=self.lone)

    def lone_positions(self) -> set[int]:
        """The positions of the tokens computed alone."""
        return {self.start + i for i in self.lone}

    def append(self, token: int, *, lone: bool = False) -> None:
        if lone:
            self.lone.add(len(self.tokens))
        self.tokens.append(token)
        self._key = None

    def cut(self, length: int) -> None:
        """Keep the first ``length`` tokens."""
        del self.tokens[length:]
        self.lone = {i for i in self.lone if i < length}
        self._key = None


class HotWindow:
    """One session's logical context as blocks, and the rules for what may leave the window."""

    def __init__(
        self,
        *,
        fingerprint: str,
        planner_context: int,
        block_tokens: int,
        sink_tokens: int,
        recent_tokens: int,
        planner_note: str = "",
        long_limit: int = 0,
    ) -> None:
        self.fingerprint = fingerprint
        self.planner_context = planner_context
        self.planner_note = planner_note
        """Why the planner context is what it is, where a context past it needs saying."""
        self.block_tokens = block_tokens
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.blocks: list[Block] = []
        self.relevance: dict[int, float] = {}
        """Block id -> relevance to the query, when the hot-eviction policy scores it."""
        self.relevance_scoring: str | None = None
        """How the last scores were made (see :attr:`SessionReport.relevance_scoring`)."""
        self.long_limit = long_limit
        """Tokens a long context may span (the cold tiers' worth, past the trained
        context); 0: the session serves none (see :mod:`.long`)."""
        self.virtual = False
        """The context placed is what a long context shows the engine (see :mod:`.long`):
        its blocks come back at other positions whenever they have a copy."""
        self.long_copies: dict[ColdKey, ColdKey] = {}
        """A block's exact key -> the key its approximate KV is stored under, for the
        blocks a long context computes at window positions (see :mod:`.long`)."""
        self.partial_copies: dict[ColdKey, ColdKey] = {}
        """A block's exact key -> the key of this session's own cold copy of its
        partial-window KV (see :mod:`.provenance`), which no other session asks for."""
        self.unresumable: set[ColdKey] = set()
        """Blocks (by their exact key) whose cold copies, shared or this session's own,
        cannot end this window (a hybrid's blocks exported without the recurrent state
        after them; a last block whose logits need the state before its last token, which
        lies behind a gap): computed instead of restored."""
        self.required: frozenset[str] = frozenset()
        """Segments the last ``ensure_context`` required visible: protected like the sinks
        until the next context is placed."""
        self._next_id = 0
        self.clock = 0

    # -- layout --

    @property
    def context_limit(self) -> int:
        """Tokens a context sent to this session may hold."""
        return max(self.planner_context, self.long_limit)

    @property
    def length(self) -> int:
        return self.blocks[-1].end if self.blocks else 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def plan_layout(self, segments: Sequence[Placed]) -> tuple[list[Block], list[Block]]:
        """Blocks for ``segments`` (reusing matching blocks) and the current blocks dropped."""
        names = [p.segment.name for p in segments]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidContextError(f"segment name {dup!r} appears twice; names must be unique")
        total = sum(len(p.tokens) for p in segments)
        if total > self.planner_context:
            biggest = max(segments, key=lambda s: len(s.tokens))
            raise ContextTooLargeError(
                f"the context needs {total} tokens but the session's planner context is "
                f"{self.planner_context} (largest segment {biggest.segment.name!r}: "
                f"{len(biggest.tokens)} tokens)"
                + (f": {self.planner_note}" if self.planner_note else "")
            )
        current = {(b.prefix, b.start, tuple(b.tokens), frozenset(b.lone)): b for b in self.blocks}
        now = self.tick()
        layout: list[Block] = []
        for seg, index, pos, chunk, prefix, lone in self.chunks(segments):
            block = current.pop((prefix, pos, tuple(chunk), frozenset(lone)), None)
            if block is None or block.segment != seg.name or block.cache_class != seg.cache_class:
                self._next_id += 1
                block = Block(
                    self._next_id,
                    seg.name,
                    index,
                    seg.cache_class,
                    pos,
                    chunk,
                    prefix,
                    now,
                    lone=lone,
                )
            block.last_used = now
            block.index = index
            block.score = seg.score
            layout.append(block)
        return layout, list(current.values())

    def keys_for(self, segments: Sequence[Placed]) -> list[ColdKey]:
        """The cold-store keys the blocks of ``segments`` would have (nothing changes)."""
        return [
            ColdKey(self.fingerprint, prefix, token_digest(chunk, lone=lone), pos)
            for _, _, pos, chunk, prefix, lone in self.chunks(segments)
        ]

    def chunks(
        self, segments: Sequence[Placed]
    ) -> Iterator[tuple[Segment, int, int, list[int], str, set[int]]]:
        """Each block-sized chunk: its segment, index in it, start, tokens, prefix digest
        and the offsets of its tokens computed alone."""
        prefix, pos = token_digest(()), 0
        for seg, toks, alone in segments:
            for index, k in enumerate(range(0, len(toks), self.block_tokens)):
                chunk = toks[k : k + self.block_tokens]
                lone = {i - k for i in alone if k <= i < k + len(chunk)}
                yield seg, index, pos, chunk, prefix, lone
                prefix = token_digest(chunk, prefix.encode(), lone=lone)
                pos += len(chunk)

    def adopt(self, layout: list[Block]) -> None:
        self.blocks = layout

    def append_place(self, segment: str) -> tuple[int, str]:
        """The start and prefix of the block a token of ``segment`` appended now joins."""
        last = self.blocks[-1] if self.blocks else None
        if last is not None and not self._starts_block(last, segment):
            return last.start, last.prefix
        if last is None:
            return 0, token_digest(())
        return self.length, last.next_prefix

    def _starts_block(self, last: Block, segment: str) -> bool:
        return last.segment != segment or last.n_tokens >= self.block_tokens

    def append_token(self, token: int, segment: str, cache_class: CacheClass) -> Block:
        """Record a generated token (computed alone) at the end of the context (a new
        block when full)."""
        last = self.blocks[-1] if self.blocks else None
        if last is None or self._starts_block(last, segment):
            prefix = token_digest(())
            if last is not None:
                prefix = last.next_prefix
            index = last.index + 1 if last is not None and last.segment == segment else 0
            self._next_id += 1
            last = Block(
                self._next_id, segment, index, cache_class, self.length, [], prefix, self.tick()
            )
            self.blocks.append(last)
        last.append(token, lone=True)
        last.last_used = self.clock
        return last

    def lone_positions(self, start: int, end: int) -> set[int]:
        """The positions in ``[start, end)`` whose KV the context has computed alone."""
        return {
            p for b in self.blocks if b.start < end and b.end > start for p in b.lone_positions()
        } & set(range(start, end))

    def truncate(self, length: int) -> None:
        """Drop every token at position ``length`` or later (a stop sequence generated at
        the end of the context)."""
        kept = []
        for block in self.blocks:
            if block.start >= length:
                continue
            if block.end > length:
                block.cut(length - block.start)
            kept.append(block)
        self.blocks = kept

    def token_at(self, position: int) -> int | None:
        """The context's token at ``position`` (None past its end)."""
        for b in self.blocks:
            if b.start <= position < b.end:
                return b.tokens[position - b.start]
        return None

    def segment_blocks(self, name: str) -> list[Block]:
        blocks = [b for b in self.blocks if b.segment == name]
        if not blocks:
            known = ", ".join(dict.fromkeys(b.segment for b in self.blocks)) or "none"
            raise UnknownSegmentError(
                f"no segment named {name!r} in this session (segments: {known})"
            )
        return blocks

    def range_blocks(self, start: int, end: int) -> list[Block]:
        return [b for b in self.blocks if b.start >= start and b.end <= end]

    # -- residency (derived) --

    @staticmethod
    def resident_map(positions: Sequence[int], tokens: Sequence[int]) -> dict[int, int]:
        return dict(zip(positions, tokens, strict=True))

    def residency(
        self, block: Block, resident: Mapping[int, int], cold: Container[ColdKey]
    ) -> Residency:
        if all(resident.get(block.start + i) == t for i, t in enumerate(block.tokens)):
            return Residency.HOT
        key = block.key(self.fingerprint)
        if key in cold and key not in self.unresumable:
            return Residency.COLD
        local = self.partial_copies.get(key)
        if local is not None and local in cold and key not in self.unresumable:
            return Residency.COLD
        return Residency.DROPPED

    @staticmethod
    def resident_prefix(block: Block, resident: Mapping[int, int]) -> int:
        """How many of ``block``'s leading tokens are resident at their positions."""
        n = 0
        for i, t in enumerate(block.tokens):
            if resident.get(block.start + i) != t:
                break
            n += 1
        return n

    def kept_positions(self, blocks: Sequence[Block], resident: Mapping[int, int]) -> set[int]:
        """The resident positions a context of ``blocks`` keeps: those of its fully
        resident blocks, and the resident leading tokens of its first block not fully
        resident when no fully resident block follows it (the window's tail: computing
        resumes right after them, so a block that grew is not computed again whole)."""
        kept: set[int] = set()
        partial: range | None = None
        hot_after = False
        for b in blocks:
            n = self.resident_prefix(b, resident)
            if n == b.n_tokens:
                kept.update(range(b.start, b.end))
                hot_after = partial is not None
            elif partial is None:
                partial = range(b.start, b.start + n)
        if partial is not None and not hot_after:
            kept.update(partial)
        return kept

    def strays(self, resident: Mapping[int, int]) -> list[tuple[int, int]]:
        """Resident position ranges the context does not keep (see :meth:`kept_positions`)."""
        owned = self.kept_positions(self.blocks, resident)
        return runs_of(sorted(p for p in resident if p not in owned))

    # -- eviction rules --

    def protected(self) -> set[int]:
        """Ids of blocks that never leave the window: sinks, the recent window and the
        segments required visible."""
        length = self.length
        return {
            b.id
            for b in self.blocks
            if self._stays_hot(b.segment, b.start, b.end, length, self.required)
        }

    def protected_tokens(self, segments: Sequence[Placed], required: Container[str]) -> int:
        """Tokens that would have to stay hot if ``segments`` were the context and the
        segments named in ``required`` were required visible (nothing changes)."""
        length = sum(len(p.tokens) for p in segments)
        return sum(
            len(chunk)
            for seg, _, pos, chunk, _, _ in self.chunks(segments)
            if self._stays_hot(seg.name, pos, pos + len(chunk), length, required)
        )

    def _stays_hot(
        self, segment: str, start: int, end: int, length: int, required: Container[str]
    ) -> bool:
        return start < self.sink_tokens or end > length - self.recent_tokens or segment in required

    def plan_hot(self, order: Callable[[Sequence[BlockView]], list[int]], budget: int) -> set[int]:
        """Ids of the blocks the window should hold once the context is placed.

        Everything, less the blocks the policy would evict first, until the rest fits
        ``budget`` (the engine context's, its one owner); sinks and the recent window are
        always in.
        """
        keep = self.protected()
        total = sum(b.n_tokens for b in self.blocks)
        others = [b for b in self.blocks if b.id not in keep]
        planned = {b.id for b in self.blocks}
        for block in self.eviction_order(others, order):
            if total <= budget:
                break
            planned.discard(block.id)
            total -= block.n_tokens
        return planned

    def view(self, block: Block) -> BlockView:
        """What a policy sees of ``block``."""
        return BlockView(
            id=block.id,
            cache_class=block.cache_class,
            start=block.start,
            n_tokens=block.n_tokens,
            last_used=block.last_used,
            score=block.score,
            relevance=self.relevance.get(block.id),
        )

    def query_tokens(self) -> list[int]:
        """The query relevance is scored against: the last segment's tokens."""
        if not self.blocks:
            return []
        last = self.blocks[-1].segment
        return [t for b in self.blocks if b.segment == last for t in b.tokens]

    def score_relevance(self, scorer: Callable[[list[list[int]], list[int]], list[float]]) -> None:
        """Score every block against the query (the last segment's tokens) with ``scorer``."""
        if not self.blocks:
            self.relevance = {}
            return
        self.set_relevance(scorer([b.tokens for b in self.blocks], self.query_tokens()))

    def set_relevance(self, scores: Sequence[float | None]) -> None:
        """One score per block, in order; None leaves a block unscored."""
        self.relevance = {
            b.id: float(s) for b, s in zip(self.blocks, scores, strict=True) if s is not None
        }

    def eviction_order(
        self,
        candidates: Sequence[Block],
        order: Callable[[Sequence[BlockView]], list[int]],
    ) -> list[Block]:
        """``candidates`` in the order the hot-eviction policy would evict them."""
        by_id = {b.id: b for b in candidates}
        views = [self.view(b) for b in candidates]
        return [by_id[i] for i in order(views) if i in by_id]


def long_limit(ctx: EngineContext, facts: ModelFacts, cold: int, disk: int) -> int:
    """Tokens a long context may span in ``ctx`` (its hot window plus the cold tiers'
    budgets, ``cold`` and ``disk`` tokens); refused, with the reason, where the engine
    cannot show a long context's blocks at other positions."""
    why = ""
    if facts.recurrent is not None:
        why = f"{facts.architecture} keeps a recurrent state, which no window can skip"
    elif not ctx.capabilities.position_shift:
        why = "its engine context cannot shift positions (turn a block's keys)"
    elif not ctx.capabilities.remove_middle:
        why = "its engine context cannot remove blocks from the middle of the window"
    if why:
        raise InvalidArgumentError(f"long_context: this model cannot serve one: {why}")
    return ctx.n_ctx + cold + disk
