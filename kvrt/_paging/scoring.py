"""Scoring: how relevant each block is to the query, for a hot-eviction policy that asks.

A policy with ``relevance`` (:class:`kvrt.policy.Relevance`) scores blocks by their tokens;
one that also has ``key_relevance`` (:class:`kvrt.policy.KeyScoring`) scores them by key
vectors, where the engine context can sketch them (:class:`kvrt.backend.KeySketching`),
blended with the token scores when it has ``blend`` (:class:`kvrt.policy.LexicalBlending`).
Sketches are computed once per block and kept while the block is in the context: a hot
block's from its KV (a copy out, the window unchanged), a cold block's from its bytes in
RAM; the query's by running its tokens on their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence

from .._cold import ColdEntry, ColdKey
from .._engine.contract import KeySketching
from .._threads import in_thread
from .._types import Residency
from ..policy import KeyScoring, LexicalBlending, Relevance
from .gate import EngineGate
from .window import Block

__all__ = ["Scoring"]


class Scoring:
    """Keeps the window's relevance scores current before a context is placed."""

    def __init__(self, gate: EngineGate) -> None:
        self.gate = gate
        self.ctx, self.window, self.cold = gate.ctx, gate.window, gate.cold
        self.policies = gate.policies
        self._sketches: dict[ColdKey, object] = {}
        self._query_sketch: tuple[tuple[int, ...], object | None] | None = None
        self._given: tuple[dict[ColdKey, float | None], str | None] | None = None

    @contextlib.contextmanager
    def given(self, scores: dict[ColdKey, float | None], how: str | None) -> Iterator[None]:
        """Within: scores of the window being placed, by block key, made by what chose its
        blocks (a long context); its scoring takes them (``how`` they were made) instead of
        scoring the window again."""
        self._given = (scores, how)
        try:
            yield
        finally:
            self._given = None

    async def score(self) -> None:
        if self._given is not None:
            given, made = self._given
            fingerprint = self.window.fingerprint
            self.window.set_relevance([given.get(b.key(fingerprint)) for b in self.window.blocks])
            self.window.relevance_scoring = made
            return
        blocks = self.window.blocks
        query = self.window.query_tokens()
        tokens = [b.tokens for b in blocks]
        scores, how = await self.relevance(tokens, query, self._sketch_blocks)
        if how is not None:
            self.window.set_relevance(scores)
        self.window.relevance_scoring = how

    async def relevance(
        self,
        tokens: Sequence[Sequence[int]],
        query: Sequence[int],
        sketches: Callable[[], Awaitable[Sequence[object | None]]],
        key_query: Sequence[int] | None = None,
    ) -> tuple[list[float | None], str | None]:
        """Each block's relevance to ``query`` (the blocks' ``tokens`` given), as the
        session's hot-eviction policy scores it, None where it scores nothing; and how
        (:attr:`SessionReport.relevance_scoring`). By key vectors where the policy and the
        engine can (the blocks' ``sketches()`` against those of ``key_query``, ``query``
        unless given), blended with the token scores where the policy blends; else by
        tokens."""
        policy = self.policies.hot_eviction
        if not isinstance(policy, Relevance):
            return [None] * len(tokens), None
        lexical = list(await in_thread(policy.relevance, tokens, query))
        if not isinstance(policy, KeyScoring):
            return list(lexical), "lexical"
        if not isinstance(self.ctx, KeySketching):
            return list(lexical), "lexical: the engine gives no key vectors"
        wanted = await self.query_sketch(tuple(query if key_query is None else key_query))
        if wanted is None:
            return list(lexical), "lexical: the engine cannot read this model's keys"
        made = await sketches()
        if all(s is None for s in made):
            return list(lexical), "lexical: no block has key vectors yet"
        keys = await in_thread(policy.key_relevance, made, wanted)
        if isinstance(policy, LexicalBlending):
            return policy.blend(keys, lexical), "keys"
        return keys, "keys"

    async def query_sketch(self, tokens: tuple[int, ...]) -> object | None:
        """The sketch of a query's keys (see :class:`kvrt.backend.KeySketching`), computed
        again only when the query changed: a long context's window and its placement ask
        for the same one."""
        assert isinstance(self.ctx, KeySketching)
        if self._query_sketch is None or self._query_sketch[0] != tokens:
            sketch = await self.gate.call("sketch query", self.ctx.query_sketch, tokens)
            self._query_sketch = (tokens, sketch)
        return self._query_sketch[1]

    async def _sketch_blocks(self) -> list[object | None]:
        """Each block's sketch, computing those missing; forgets blocks no longer there."""
        ctx = self.ctx
        assert isinstance(ctx, KeySketching)
        fingerprint = self.window.fingerprint
        keys = [b.key(fingerprint) for b in self.window.blocks]
        known = {k: self._sketches[k] for k in keys if k in self._sketches}
        resident = self.gate.resident()
        hot: list[tuple[ColdKey, Block]] = []
        for key, block in zip(keys, self.window.blocks, strict=True):
            if key in known:
                continue
            state = self.window.residency(block, resident, self.cold)
            if state is Residency.HOT:
                hot.append((key, block))
            elif state is Residency.COLD and (entry := self._cold_entry(key)) is not None:
                sketch = await self.gate.call("sketch cold", ctx.cold_key_sketch, entry.block)
                if sketch is not None:
                    known[key] = sketch
        if hot:
            ranges = [(b.start, b.end) for _, b in hot]
            sketches = await self.gate.call("sketch hot", ctx.key_sketches, ranges)
            for (key, _), sketch in zip(hot, sketches, strict=True):
                if sketch is not None:
                    known[key] = sketch
        self._sketches = known
        return [known.get(k) for k in keys]

    def _cold_entry(self, key: ColdKey) -> ColdEntry | None:
        """The cold copy a block comes back from: its exact entry, else this session's
        own partial-window copy (a block computed while earlier tokens were not hot)."""
        entry = self.cold.peek(key)
        if entry is None and (local := self.window.partial_copies.get(key)) is not None:
            entry = self.cold.peek(local)
        return entry
