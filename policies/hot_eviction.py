"""Which resident block leaves the hot window first."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvrt.policy import BlockView, KeySketch, KeySketches, register

from ._knobs import share

__all__ = ["ClassThenLRU", "KeyRelevance", "LexicalRelevance", "ScoreThenLRU"]

KIND = "hot_eviction"


@register(KIND, "class_lru")
class ClassThenLRU:
    """Lowest cache class first, then least recently used, then earliest position.

    Mechanism decides which blocks may go at all (sinks, the recent window); this only
    orders the candidates.
    """

    def order(self, candidates: Sequence[BlockView]) -> list[int]:
        ranked = sorted(candidates, key=lambda b: (b.cache_class.rank, b.last_used, b.start))
        return [b.id for b in ranked]


@register(KIND, "score_lru")
class ScoreThenLRU:
    """Lowest cache class first, then lowest importance score, then least recently used.

    Blocks without a score count as least important within their class.
    """

    def order(self, candidates: Sequence[BlockView]) -> list[int]:
        def key(b: BlockView) -> tuple[int, float, int, int]:
            score = float("-inf") if b.score is None else b.score
            return (b.cache_class.rank, score, b.last_used, b.start)

        return [b.id for b in sorted(candidates, key=key)]


@register(KIND, "relevance_lexical")
class LexicalRelevance:
    """Blocks least relevant to the query leave first: BM25 over token ids.

    Each block is a bag of token ids; the query is the context's last segment. A block
    sharing the query's rarer tokens (a name, a key, a term) scores high and stays hot;
    filler sharing only common ones goes. The cache class still comes first (a
    ``task_pinned`` block outlasts any ``volatile`` one); within a class, least relevant
    first, then least recently used. Cost: one pass over the context's tokens per placement.
    """

    k1 = 1.2
    b = 0.75

    def relevance(self, blocks: Sequence[Sequence[int]], query: Sequence[int]) -> list[float]:
        n = len(blocks)
        if not n or not query:
            return [0.0] * n
        counts = [Counter(tokens) for tokens in blocks]
        lengths = [len(tokens) for tokens in blocks]
        average = sum(lengths) / n or 1.0
        terms = set(query)
        df = {t: sum(1 for c in counts if t in c) for t in terms}
        idf = {t: math.log((n - df[t] + 0.5) / (df[t] + 0.5) + 1.0) for t in terms}
        scores = []
        for c, length in zip(counts, lengths, strict=True):
            norm = self.k1 * (1.0 - self.b + self.b * length / average)
            scores.append(
                sum(idf[t] * c[t] * (self.k1 + 1.0) / (c[t] + norm) for t in terms if t in c)
            )
        return scores

    def order(self, candidates: Sequence[BlockView]) -> list[int]:
        def key(b: BlockView) -> tuple[int, float, int, int]:
            relevance = 0.0 if b.relevance is None else b.relevance
            return (b.cache_class.rank, relevance, b.last_used, b.start)

        return [b.id for b in sorted(candidates, key=key)]


@register(KIND, "relevance")
class KeyRelevance(LexicalRelevance):
    """Blocks least relevant to the query leave first: similarity of key vectors.

    In the spirit of InfLLM's block retrieval, without engine changes: each block keeps a
    sketch of its keys (per layer and KV head, the mean key and the keys furthest from
    it, rotated back to position 0), and the query's tokens are run on their own to get
    theirs. Keys stand in for the queries the engine does not expose. A block's score is,
    over layers, heads and query tokens, the mean of the best cosine between a query key
    and one of the block's keys, both centred on the context's mean key. Blocks without a
    sketch (not computed yet, or cold outside RAM) are not scored and rank in the middle;
    where the engine gives no sketches at all, the lexical score (BM25) is used instead.

    Key sketches tell a needle from filler but not one look-alike needle from another
    (four "the magic number for KEY is" lines score alike): each block's score also gets
    its BM25 score against the query, over the best block's, times ``lexical_weight``, so
    the block holding the query's rarer words wins among look-alikes. Where the query
    shares no rare word with any block the BM25 scores are small and alike, and the keys
    decide. Measured (SmolLM2, a 512-token window, four look-alike needles in 2k and 4k
    tokens that never fitted, 8 prompts): the asked needle kept hot in 3 prompts with keys
    alone, 6 with weight 0.3, 8 with weight 1.
    """

    lexical_weight = 1.0
    hold = 0.05
    """A block the window shows ranks this share of the spread of the scores (the best
    one's over the median's) higher than one it leaves out: blocks scored alike (filler,
    look-alikes) keep their places when the query barely changes, so a follow-up computes
    only what is new; a block clearly more relevant still comes in."""
    DEFAULT_FOLLOW = 0.0

    def __init__(self, follow: str | float = DEFAULT_FOLLOW) -> None:
        """``follow`` (``"relevance:0.9"``): the block right after a relevant one ranks at
        least this share of its relevance, so the end of a sentence cut by a block edge
        (a key named in one block, its value in the next) stays with its start; 0, the
        default, ranks each block on its own."""
        self.follow = share(follow, "follow share")

    def key_relevance(self, blocks: Sequence[object | None], query: object) -> list[float | None]:
        """One score per block (None where it has no sketch), higher is more relevant.

        ``blocks`` packed (:class:`~kvrt.policy.KeySketches`, as a long context hands
        them) are read where they lie; others are packed first."""
        packed = blocks if isinstance(blocks, KeySketches) else _pack(blocks)
        if not (packed.slots >= 0).any():
            return [None] * len(blocks)
        totals = _key_scores(packed, np.asarray(query, dtype=np.float32))
        return [None if slot < 0 else float(totals[slot]) for slot in packed.slots]

    def blend(self, keys: Sequence[float | None], lexical: Sequence[float]) -> list[float | None]:
        """Key scores plus the BM25 scores over the best block's, times ``lexical_weight``."""
        top = max(lexical, default=0.0)
        if top <= 0.0:
            return list(keys)
        w = self.lexical_weight / top
        return [None if k is None else k + w * x for k, x in zip(keys, lexical, strict=True)]

    def order(self, candidates: Sequence[BlockView]) -> list[int]:
        middle, hold = self._spread(candidates)
        own = {b.id: middle if b.relevance is None else b.relevance for b in candidates}
        ranked = dict(own)
        if self.follow:
            before = {b.start + b.n_tokens: b.id for b in candidates}
            for b in candidates:
                if (prev := before.get(b.start)) is not None:
                    ranked[b.id] = max(own[b.id], self.follow * own[prev])
        for b in candidates:
            if b.shown:
                ranked[b.id] += hold

        def key(b: BlockView) -> tuple[int, float, int, int]:
            return (b.cache_class.rank, ranked[b.id], b.last_used, b.start)

        return [b.id for b in sorted(candidates, key=key)]

    def arrange(self, chosen: Sequence[BlockView]) -> list[int]:
        """The most relevant blocks nearest the query: runs of blocks that follow one
        another in the context, least relevant run first. A run passes one shown before
        it only when clearly more relevant (by ``hold`` of the scores' spread), so a
        question asked again keeps its window as it was.

        A small model copies from what is near the question: with four look-alike
        needles shown in the context's order it often answers with a favourite one.
        Measured (SmolLM2, window 2,048, four look-alike needles in 32k tokens, each of
        the four keys asked of four contexts): 6 of 16 right in the context's order,
        12 of 16 so arranged, as many as the whole 8k context gets."""
        runs: list[list[BlockView]] = []
        for b in sorted(chosen, key=lambda b: b.start):
            if runs and runs[-1][-1].start + runs[-1][-1].n_tokens == b.start:
                runs[-1].append(b)
            else:
                runs.append([b])
        given = {b.id: k for k, b in enumerate(chosen)}
        runs.sort(key=lambda run: min(given[b.id] for b in run))
        middle, margin = self._spread(chosen)

        def score(run: list[BlockView]) -> float:
            return max(middle if b.relevance is None else b.relevance for b in run)

        out: list[list[BlockView]] = []
        for run in runs:
            k = len(out)
            while k and score(out[k - 1]) > score(run) + margin:
                k -= 1
            out.insert(k, run)
        return [b.id for run in out for b in run]

    def _spread(self, views: Sequence[BlockView]) -> tuple[float, float]:
        """The median of the scores (what a block without one ranks as), and ``hold`` of
        their spread (the best one's over the median)."""
        scored = [b.relevance for b in views if b.relevance is not None]
        if not scored:
            return 0.0, 0.0
        middle = statistics.median(scored)
        return middle, self.hold * (max(scored) - middle)


def _pack(blocks: Sequence[object | None]) -> KeySketches:
    """Sketches given one by one (a :class:`KeySketch` or its vectors), packed."""
    have = [_sketch(b) for b in blocks if b is not None]
    given = np.array([b is not None for b in blocks], dtype=bool)
    slots = np.where(given, np.cumsum(given, dtype=np.intp) - 1, -1)
    if not have:
        none = np.zeros((0, 0, 0, 0), dtype=np.float32)
        return KeySketches(np.zeros((0, 0, 0, 0, 0), dtype=np.int8), none, none, slots)
    keys = np.stack([b.keys for b in have], axis=-1)  # [layer, head, vector, dim, block]
    wide = keys.astype(np.float32)
    norms = np.einsum("lhvdn,lhvdn->lhvn", wide, wide)
    return KeySketches(keys, np.stack([b.scale for b in have], axis=-1), norms, slots)


def _key_scores(packed: KeySketches, q: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Every slot's score: over layers, heads and query tokens, the mean of the best
    cosine between a query key ``q[layer, head, token, dim]`` and one of the slot's keys,
    both centred on the mean key of the slots the blocks name.

    Computed a layer at a time from the int8 keys, so what it holds beside the sketches
    is a layer's worth (about 7 KB a block) whatever the context's length. With ``k = s K``
    a key (``K`` its int8 vector, ``s`` its scale), ``c`` the centre and ``q`` a unit query
    key, the cosine of ``k - c`` and ``q`` is ``(s K.q - c.q) / |k - c|``, and
    ``|k - c|^2 = s^2 |K|^2 - 2 s K.c + |c|^2``: one product of ``[q; c]`` with the int8
    vectors gives both, and ``|K|^2`` is packed beside them. Slots lie along the last
    axis, so every step runs along contiguous rows of slots."""
    n_layer, n_head, vectors, dim, n = packed.keys.shape
    n_query, r = q.shape[2], vectors - 1
    # The context's mean key [layer, head, dim]: the mean of its blocks' means.
    weight = np.bincount(packed.slots[packed.slots >= 0], minlength=n).astype(np.float32)
    weight /= weight.sum()
    centre = np.einsum("lhdn,lhn->lhd", packed.keys[:, :, 0], packed.scale[:, :, 0] * weight)
    keys = np.empty((n_head, r, dim, n), dtype=np.float32)
    total = np.zeros(n, dtype=np.float64)
    for layer in range(n_layer):
        np.copyto(keys, packed.keys[layer, :, 1:], "unsafe")
        scale = packed.scale[layer, :, 1:, None, :]  # [head, vector, 1, slot]
        c = centre[layer]  # [head, dim]
        qn = _unit(q[layer] - c[:, None])  # [head, query token, dim]
        both = np.concatenate([qn, c[:, None]], axis=1)[:, None] @ keys
        # [head, vector, query token + 1, slot]: K.q, then K.c
        inverse = packed.norms[layer, :, 1:, None, :] * np.square(scale)
        inverse -= 2.0 * scale * both[:, :, -1:]
        inverse += np.einsum("hd,hd->h", c, c)[:, None, None, None]
        np.reciprocal(np.sqrt(np.maximum(inverse, 1e-12)), out=inverse)
        cosines = both[:, :, :-1]
        cosines *= scale * inverse
        cosines -= np.einsum("hqd,hd->hq", qn, c)[:, None, :, None] * inverse
        total += cosines.max(axis=1).sum(axis=(0, 1))  # the best vector, per head and token
    return np.asarray(total / (n_layer * n_head * n_query), dtype=np.float64)


def _sketch(block: object) -> KeySketch:
    """A block's sketch as int8 keys, whether an adapter gave one or its vectors."""
    return block if isinstance(block, KeySketch) else KeySketch.quantize(np.asarray(block))


def _unit(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.asarray(x / np.maximum(norm, 1e-6), dtype=np.float32)
