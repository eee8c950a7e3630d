"""Relevance-driven paging: the blocks the query needs are the ones kept hot.

A unit test of the lexical scorer with hand-made token bags, and a passkey on the real
model: a five-digit key in filler text, outside a 512-token window's recency, is answered
under ``relevance`` and not under recency alone (``class_lru``, what a context shift
leaves), on keys the full context answers.
"""

from __future__ import annotations

import pytest

import kvrt
from kvrt import CacheClass, Segment, policies
from kvrt.adapters.llama import LlamaEngine
from kvrt.policy import BlockView, Relevance


def view(
    i: int, relevance: float | None, cache_class: CacheClass = CacheClass.VOLATILE
) -> BlockView:
    return BlockView(
        id=i, cache_class=cache_class, start=i * 8, n_tokens=8, last_used=i, relevance=relevance
    )


def test_lexical_relevance_scores_the_block_sharing_rare_query_tokens() -> None:
    policy = policies.get("hot_eviction", "relevance")
    assert isinstance(policy, Relevance)
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


INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there. "
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "What is the pass key? The pass key is"


def haystack(key: str, n_filler: int = 40, depth: float = 0.3) -> str:
    at = int(n_filler * depth)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return INTRO + FILLER * at + needle + FILLER * (n_filler - at)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_passkey_outside_the_window_is_answered_under_relevance(
    engine: LlamaEngine, anyio_backend: str
) -> None:
    answered: dict[str, list[bool]] = {"full": [], "relevance": [], "class_lru": []}
    async with kvrt.open_runtime(engine=engine) as rt:
        for key in ("71432", "58213"):
            context = [Segment("haystack", haystack(key)), Segment("question", QUESTION)]
            for condition, hot, policy in (
                ("full", 2048, "class_lru"),  # computes; the others restore its blocks
                ("relevance", 512, "relevance"),
                ("class_lru", 512, "class_lru"),
            ):
                async with rt.open_session(hot_tokens=hot, hot_eviction=policy) as s:
                    status = await s.ensure_context(context)
                    text = (await s.generate(max_tokens=7)).text
                    answered[condition].append(key in text)
                    if condition != "full":
                        assert status.logical_tokens > 2 * hot - 100  # far past the window
                        report = s.explain()
                        needle = [b for b in report.blocks if b.relevance is not None]
                        if condition == "relevance":
                            best = max(needle, key=lambda b: b.relevance or 0.0)
                            assert best.residency == "hot"  # the needle's block is seen
                            assert best.start > 128  # and it is no sink
    full = answered["full"]
    assert any(full)  # the model answers with the whole context in view
    for i, ok in enumerate(full):
        if ok:
            assert answered["relevance"][i], answered
            assert not answered["class_lru"][i], answered


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
        rt.open_session(hot_tokens=512, hot_eviction="relevance") as s,
    ):
        await s.ensure_context(context)
        await s.generate(max_tokens=6)
        for answer in (" ", " 1", " 12"):  # the answer fed back, a token more each time
            status = await s.ensure_context([*context, Segment("answer", answer)])
            assert status.hot_tokens <= 512 and s.explain().consistent
