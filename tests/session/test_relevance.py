"""Relevance-driven paging: the blocks the query needs are the ones kept hot.

Unit tests of the two scorers (the lexical one with hand-made token bags, the key-vector
one with hand-made key sketches, and its int8 sketches against float cosines); blocks
shown keeping their places on near ties; the keys read out of llama.cpp's KV bytes, which must
not depend on the position they were computed at; and a passkey on the real model: a
five-digit key in filler text, in a context that never fitted a 512-token window (each
condition computes it itself), is answered under ``relevance`` (and ``relevance_lexical``)
and not under recency alone (``class_lru``, what a context shift leaves), on keys the full
context answers; asked in other words than the needle's, under ``relevance`` still.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

import kvrt
from benchmarks import passkey
from benchmarks.passkey import QUESTIONS
from kvrt import CacheClass, Segment, policies
from kvrt._paging.sketches import SketchStore
from kvrt.adapters.llama import LlamaEngine
from kvrt.backend import KeySketch, KeySketching
from kvrt.native_bridge import BridgeError
from kvrt.native_bridge.llama_keys import read_keys, unrotate
from kvrt.native_bridge.rope import ROPE_NEOX, ROPE_NORM, Rope
from kvrt.policies.hot_eviction import KeyRelevance, LexicalRelevance
from kvrt.policy import Arranging, BlockView, KeyScoring, LexicalBlending, Relevance


def view(
    i: int, relevance: float | None, cache_class: CacheClass = CacheClass.VOLATILE
) -> BlockView:
    return BlockView(
        id=i, cache_class=cache_class, start=i * 8, n_tokens=8, last_used=i, relevance=relevance
    )


def test_lexical_relevance_scores_the_block_sharing_rare_query_tokens() -> None:
    policy = policies.get("hot_eviction", "relevance_lexical")
    assert isinstance(policy, LexicalRelevance) and not isinstance(policy, KeyRelevance)
    assert isinstance(policy, Relevance) and not isinstance(policy, KeyScoring)
    common, key, pass_ = 1, 71, 72  # token ids: a filler word, "key", "pass"
    blocks = [
        [common, 2, 3, common, 4, 5, common, 6],
        [common, 2, pass_, key, 9, key, common, 6],  # the needle
        [common, 2, 3, common, 4, 5, common, 6],
        [common, 7, 8, common, 4, 5, common, 6],
    ]
    scores = policy.relevance(blocks, [common, pass_, key, common])
    assert scores.index(max(scores)) == 1
    assert scores[0] == scores[2] and min(scores) >= 0.0
    assert scores[0] < scores[1] / 10  # sharing only the common token counts for little
    assert policy.relevance(blocks, []) == [0.0] * 4
    assert policy.relevance([], [1]) == []

    # Least relevant leave first; the cache class still comes first.
    order = policy.order([view(0, 0.5), view(1, 3.0), view(2, 0.1), view(3, None)])
    assert order == [3, 2, 0, 1]
    pinned = view(4, 0.0, CacheClass.TASK_PINNED)
    assert policy.order([pinned, view(1, 3.0)]) == [1, 4]


def unit(*v: float) -> list[float]:
    a = np.array(v, dtype=np.float32)
    return list(a / np.linalg.norm(a))


def test_key_relevance_scores_the_block_whose_keys_match_the_query() -> None:
    """Sketches are [layer, head, 1 + r, dim]: the mean key, then representative keys."""
    policy = policies.get("hot_eviction", "relevance")
    assert isinstance(policy, KeyRelevance)
    assert isinstance(policy, KeyScoring) and isinstance(policy, Relevance)

    def sketch(*reps: list[float]) -> np.ndarray:
        keys = np.array(reps, dtype=np.float32)  # [r, dim]
        one = np.concatenate([keys.mean(axis=0, keepdims=True), keys])
        return np.stack([one[None], one[None]])  # two layers, one head

    filler = sketch(unit(1, 0, 0, 0), unit(0, 1, 0, 0))
    other = sketch(unit(1, 0.1, 0, 0), unit(0, 1, 0.1, 0))
    needle = sketch(unit(1, 0, 0, 0), unit(0, 0, 1, 0))  # one key points where the query does
    query = np.array([unit(0, 0, 1, 0.2), unit(0.1, 0, 1, 0)], dtype=np.float32)[None, None]
    query = np.concatenate([query, query])  # [layer, head, token, dim]
    scores = policy.key_relevance([filler, needle, None, other], query)
    assert scores[2] is None  # no sketch, no score
    assert scores[1] == max(s for s in scores if s is not None)
    assert scores[1] - max(scores[0] or 0.0, scores[3] or 0.0) > 0.3
    assert policy.key_relevance([None, None], query) == [None, None]

    # Unscored blocks rank in the middle of the scored ones; the cache class comes first.
    order = policy.order([view(0, 0.1), view(1, 0.9), view(2, None), view(3, 0.2), view(4, 0.5)])
    assert order == [0, 3, 2, 4, 1] or order == [0, 3, 4, 2, 1]
    assert policy.order([view(5, -1.0, CacheClass.TASK_PINNED), view(6, 0.9)]) == [6, 5]


def test_the_block_after_a_relevant_one_follows_it_with_the_follow_share() -> None:
    """``relevance:F``: a block right after a relevant one ranks at least F of its
    relevance (its own where higher); a block after a gap, or a knob out of range, not."""
    views = [view(0, 0.1), view(1, 0.9), view(2, 0.2), view(3, 0.3), view(5, 0.4)]
    assert policies.get("hot_eviction", "relevance").order(views) == [0, 2, 3, 5, 1]
    # 2 follows 1 (0.9 x 0.5 = 0.45 > 0.4); 3 follows 2 by its own 0.2 only; 5 after a gap.
    assert policies.get("hot_eviction", "relevance:0.5").order(views) == [0, 3, 5, 2, 1]
    for bad in ("1.5", "near"):
        with pytest.raises(kvrt.ConfigError, match="follow share"):
            policies.get("hot_eviction", f"relevance:{bad}")


def test_blocks_shown_keep_their_places_against_near_ties() -> None:
    """A block the window shows ranks ``hold`` of the scores' spread (best over median)
    above one it leaves out: a near tie keeps the window as it is, a clearly better block
    still comes in; where every block is shown (a window's own eviction) nothing moves."""
    policy = policies.get("hot_eviction", "relevance")
    assert isinstance(policy, KeyRelevance) and policy.hold > 0

    def shown(i: int, relevance: float, on: bool) -> BlockView:
        return msgspec.structs.replace(view(i, relevance), shown=on)

    filler = [shown(i, 0.1, False) for i in range(5)]  # the median, far below the needle
    needle = shown(9, 2.0, True)
    near = [shown(5, 0.150, True), shown(6, 0.155, False)]  # 6 scores a hair higher
    order = policy.order([*filler, *near, needle])
    assert order.index(5) > order.index(6)  # the shown one stays; unshown, 6 would
    assert policy.order([*filler, *(msgspec.structs.replace(b, shown=False) for b in near)])[
        -2:
    ] == [5, 6]
    clearly = [shown(5, 0.15, True), shown(6, 0.8, False)]
    order = policy.order([*filler, *clearly, needle])
    assert order.index(6) > order.index(5)  # clearly more relevant: it comes in
    everyone = [view(0, 0.1), view(1, 0.9), view(3, 0.2), view(4, 0.5)]
    assert policy.order(everyone) == [0, 3, 4, 1]  # all shown: the order of the scores


def test_the_most_relevant_blocks_are_shown_nearest_the_query_runs_kept_whole() -> None:
    """``arrange`` puts the least relevant run first and the most relevant last (nearest
    the query); blocks that follow one another in the context stay together, in order;
    a run passes one given before it only when clearly more relevant."""
    policy = policies.get("hot_eviction", "relevance")
    assert isinstance(policy, KeyRelevance) and isinstance(policy, Arranging)
    # 0, 1: a needle cut by a block edge (its value in 1, scored low); 5: a look-alike
    # needle; 9, 12: filler.
    chosen = [view(0, 1.9), view(1, 0.2), view(5, 1.2), view(9, 0.1), view(12, 0.15)]
    assert policy.arrange(chosen) == [9, 12, 5, 0, 1]
    # Given in another order (a window shown before): near ties keep it, clear
    # differences do not.
    again = [view(12, 0.151), view(9, 0.15), view(0, 1.9), view(1, 0.2), view(5, 1.2)]
    assert policy.arrange(again) == [12, 9, 5, 0, 1]
    asked = [view(0, 1.2), view(1, 0.2), view(5, 1.9), view(9, 0.1), view(12, 0.15)]
    assert policy.arrange(asked)[-1] == 5  # another key asked: its needle comes last


def test_int8_key_sketches_score_as_their_float_vectors() -> None:
    """A :class:`KeySketch` holds each vector to half a step of its own scale, and the
    scores from it (keys never centred, one product with ``[q; c]``) are the plain
    centred cosines of the float vectors, to the third decimal, in the same order."""
    rng = np.random.default_rng(7)
    common = rng.normal(0, 3, (4, 2, 1, 16))  # keys share a large component, as real ones do
    vectors = [(common + rng.normal(0, 1, (4, 2, 9, 16))).astype(np.float32) for _ in range(40)]
    vectors[17][:, :, 3] += 4 * rng.normal(0, 1, (4, 2, 16))  # a distinctive key
    query = (common + rng.normal(0, 1, (4, 2, 6, 16))).astype(np.float32)
    query[:, :, 2] = vectors[17][:, :, 3]  # the query asks for it
    sketches = [KeySketch.quantize(v) for v in vectors]
    for v, s in zip(vectors, sketches, strict=True):
        step = np.abs(v).max(axis=-1, keepdims=True) / 127
        assert np.all(np.abs(np.asarray(s) - v) <= step / 2 + 1e-6)
        assert s.nbytes == v.size + 4 * v[..., 0].size  # a byte a component, a float a vector

    def centred_cosines(block: np.ndarray, centre: np.ndarray) -> float:
        reps = block[:, :, 1:] - centre[:, :, None]
        q = query - centre[:, :, None]
        reps /= np.linalg.norm(reps, axis=-1, keepdims=True)
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        return float(np.einsum("lhvd,lhqd->lhvq", reps, q).max(axis=2).mean())

    centre = np.mean([v[:, :, 0].astype(np.float64) for v in vectors], axis=0)
    expected = [centred_cosines(v.astype(np.float64), centre) for v in vectors]
    got = KeyRelevance().key_relevance(sketches, query)
    assert all(g is not None for g in got)
    assert np.abs(np.array(got, dtype=np.float64) - expected).max() < 2e-3
    assert int(np.argmax(np.array(got, dtype=np.float64))) == 17 == int(np.argmax(expected))
    assert np.array_equal(np.argsort(expected)[-5:], np.argsort(np.array(got, float))[-5:])


def test_packed_sketches_score_as_the_same_sketches_one_by_one() -> None:
    """A long context's store hands its sketches packed: scored where they lie, they score
    as the same sketches handed one by one, whatever else the arena holds (slots of blocks
    the context dropped, reused; blocks left out); the arena grows without losing any, and
    reports every slot it holds; reserved, it is sized once."""
    rng = np.random.default_rng(11)
    shape = (3, 2, 5, 16)
    sketches = {k: KeySketch.quantize(rng.normal(0, 1, shape)) for k in range(150)}
    store = SketchStore()
    for k in range(100):  # past the first arena's 64 slots
        store.put(k, sketches[k])
    store.keep(set(range(40, 100)))  # 40 slots free, then reused
    for k in range(100, 150):
        store.put(k, sketches[k])
    assert len(store) == 110
    per_slot = sketches[0].nbytes + 4 * 3 * 2 * 5  # with |K|^2 per vector
    assert store.nbytes == 144 * per_slot  # 64 slots, grown by half twice
    body = [*range(45, 60), 7, *range(120, 150)]  # 7 was dropped: no sketch
    query = rng.normal(0, 1, (3, 2, 4, 16)).astype(np.float32)
    packed = store.select(body)
    assert len(packed) == len(body) and packed[15] is None
    assert packed.keys.shape[-1] == 110  # the 40 freed slots were reused
    assert np.array_equal(np.asarray(packed[0]), np.asarray(sketches[45]))
    alone = [None if k == 7 else sketches[k] for k in body]
    policy = KeyRelevance()
    got, expected = policy.key_relevance(packed, query), policy.key_relevance(alone, query)
    assert got[15] is None and expected[15] is None
    assert np.allclose(
        [g for g in got if g is not None], [e for e in expected if e is not None], atol=1e-6
    )
    assert got != policy.key_relevance(store.select([*body, 40]), query)[: len(body)]  # centre
    store.keep(set())  # nothing held: the arena is given back
    assert store.nbytes == 0 and len(store) == 0
    store.reserve(100)  # a context of 100 blocks: one arena of 128 slots, never grown
    store.put(0, sketches[0])
    assert store.nbytes == 128 * per_slot
    for k in range(1, 100):
        store.put(k, sketches[k])
    assert store.nbytes == 128 * per_slot
    assert np.array_equal(np.asarray(store.select([99])[0]), np.asarray(sketches[99]))


def test_key_scores_of_look_alike_needles_are_told_apart_by_the_query_s_words() -> None:
    """Four needles whose keys score alike: the one sharing the query's rare words wins once
    the BM25 scores are blended in; without a lexical signal the keys decide as they were;
    blocks without a key score stay unscored."""
    policy = policies.get("hot_eviction", "relevance")
    assert isinstance(policy, KeyRelevance) and isinstance(policy, LexicalBlending)
    keys: list[float | None] = [0.05, 0.52, 0.50, 0.51, 0.50, None]  # filler, four needles
    lexical = [0.1, 2.0, 2.0, 6.5, 2.0, 3.0]  # the third needle names the asked key
    blended = policy.blend(keys, lexical)
    assert blended[5] is None
    scored = [s for s in blended if s is not None]
    assert blended.index(max(scored)) == 3
    assert policy.blend(keys, [0.0] * 6) == keys  # nothing lexical: the keys alone
    tokens = [[1, 2, 3, 4], [5, 6, 70, 71], [5, 6, 72, 73], [5, 6, 74, 75]]
    lex = policy.relevance(tokens, [5, 6, 74, 75])  # the asked key's tokens, 74 and 75
    assert lex.index(max(lex)) == 3 and lex[0] == 0.0


def test_keys_read_from_kv_bytes_do_not_depend_on_their_position(engine: LlamaEngine) -> None:
    """The same tokens computed alone at position 0 (the query's probe) and at position 600
    (in the window) give the same keys once RoPE is undone; the cold bytes give the same
    sketch as the hot range; undoing the wrong rotation does not match."""
    tokens = engine.tokenize("The pass key is 71432. Remember it.", add_special=False)
    ctx = engine.open_context(1024)
    try:
        assert isinstance(ctx, KeySketching)
        ctx.prefill(tokens, start=600)
        query = np.asarray(ctx.query_sketch(tokens))
        facts = engine.facts
        assert query.shape == (facts.n_layers, facts.n_head_kv, len(tokens), facts.head_dim)
        block = ctx.export(600, 600 + len(tokens))
        rows = read_keys(block.data, n_layer=facts.n_layers, n_embd_k=facts.n_head_kv * 64)
        assert list(rows.positions) == list(range(600, 600 + len(tokens)))
        scale = float(np.abs(query).max())
        for rope_type, close in ((ROPE_NORM, True), (ROPE_NEOX, False)):
            rope = Rope(n_rot=64, rope_type=rope_type, base=1e5)
            keys = unrotate(rows.keys, rows.positions, rope, head_dim=64)
            assert bool(np.abs(keys - query).max() < 0.03 * scale) is close
        ctx.query_sketch(tokens[:5])  # the probe then computes only the rest
        grown = np.asarray(ctx.query_sketch(tokens))
        assert np.abs(grown - query).max() < 0.01 * scale
        (hot,) = ctx.key_sketches([(600, 600 + len(tokens))])
        assert np.abs(np.asarray(hot)[:, :, 0] - query.mean(axis=2)).max() < 0.01 * scale
        assert np.array_equal(np.asarray(ctx.cold_key_sketch(block)), np.asarray(hot))
        with pytest.raises(BridgeError):
            read_keys(block.data[:-10], n_layer=facts.n_layers, n_embd_k=192)
        with pytest.raises(BridgeError):
            read_keys(block.data, n_layer=facts.n_layers + 1, n_embd_k=192)
    finally:
        ctx.close()


QUESTION = QUESTIONS["passkey"]
PARAPHRASE = QUESTIONS["paraphrase"]


def haystack(key: str, n_filler: int = 40, depth: float = 0.3) -> str:
    return passkey.haystack(key, n_filler, depth)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_passkey_in_a_context_that_never_fitted_is_answered_under_relevance(
    engine: LlamaEngine, anyio_backend: str
) -> None:
    """Each condition in a runtime of its own, with no disk tier: a windowed session
    computes the whole context itself under its window (it never fitted), so nothing it
    restores was computed with the whole context in view; then it is asked in the
    needle's words and in others."""
    conditions = (
        ("full", 2048, "class_lru"),
        ("relevance", 512, "relevance"),
        ("relevance_lexical", 512, "relevance_lexical"),
        ("class_lru", 512, "class_lru"),
    )
    alone = kvrt.load_config(flags={"disk.budget": "0"})
    answered: dict[tuple[str, str], list[bool]] = {}
    for key in ("71432", "58213"):
        body = Segment("haystack", haystack(key))
        for condition, hot, policy in conditions:
            async with (
                kvrt.open_runtime(engine=engine, config=alone) as rt,
                rt.open_session(hot_tokens=hot, hot_eviction=policy) as s,
            ):
                for task, question in (("passkey", QUESTION), ("paraphrase", PARAPHRASE)):
                    status = await s.ensure_context([body, Segment("question", question)])
                    if task == "passkey":  # the first call computed every token itself
                        assert status.prefilled_tokens >= status.logical_tokens
                    text = (await s.generate(max_tokens=7)).text
                    answered.setdefault((task, condition), []).append(key in text)
                    if condition == "full":
                        continue
                    assert status.logical_tokens > 2 * hot - 100  # far past the window
                    report = s.explain()
                    assert any(b.partial_window for b in report.blocks)  # computed windowed
                    if condition == "relevance":
                        hay = [b for b in report.blocks if b.segment == "haystack"]
                        assert all(b.relevance is not None for b in hay)  # cold ones too
                        free = [b for b in hay if not b.protected]  # not sinks, not recent
                        best = max(free, key=lambda b: b.relevance or 0.0)
                        assert best.residency == "hot"  # the best-scored block is seen
    print(answered)
    for task in ("passkey", "paraphrase"):
        full = answered[task, "full"]
        assert any(full), task  # the model answers with the whole context in view
        for i, ok in enumerate(full):
            if ok:
                assert answered[task, "relevance"][i], (task, answered)
                assert not answered[task, "class_lru"][i], (task, answered)
                if task == "passkey":  # it shares the needle's words
                    assert answered[task, "relevance_lexical"][i], answered


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_planned_block_comes_back_past_an_unplanned_neighbour(
    engine: LlamaEngine, anyio_backend: str
) -> None:
    """Relevance plans a block whose neighbour is hot but unplanned, with the window full of
    sinks and recent tokens: the neighbour makes room (it used to be kept, and the call
    failed with HotWindowFullError)."""
    context = [Segment("haystack", haystack("12345", 38, 0.9)), Segment("question", QUESTION)]
    async with (
        kvrt.open_runtime(engine=engine) as rt,
        rt.open_session(hot_tokens=512, hot_eviction="relevance_lexical") as s,
    ):
        await s.ensure_context(context)
        await s.generate(max_tokens=6)
        for answer in (" ", " 1", " 12"):  # the answer fed back, a token more each time
            status = await s.ensure_context([*context, Segment("answer", answer)])
            assert status.hot_tokens <= 512 and s.explain().consistent
