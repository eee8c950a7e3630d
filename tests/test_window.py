"""The hot window's bookkeeping without a model: how a context becomes blocks, which blocks a
plan keeps hot, what stays resident when a context changes. Pure and synchronous, so these
run in milliseconds: table-driven cases, then random contexts, budgets and policies
against a small reference model of the rules (hypothesis)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrt
from kvrt import policies
from kvrt._cold.entry import token_digest
from kvrt._session.layout import Block, HotWindow
from kvrt._session.provenance import FOREIGN, Provenance

BLOCK = 4


def window(*, sinks: int = 4, recent: int = 4, planner: int = 10_000) -> HotWindow:
    return HotWindow(
        fingerprint="model",
        planner_context=planner,
        block_tokens=BLOCK,
        sink_tokens=sinks,
        recent_tokens=recent,
    )


def seg(name: str, n: int, base: int = 0, cls: str = "volatile") -> tuple[kvrt.Segment, list[int]]:
    return kvrt.Segment(name, "x", cache_class=kvrt.CacheClass(cls)), list(range(base, base + n))


def placed(w: HotWindow, segments: Sequence[tuple[kvrt.Segment, list[int]]]) -> list[Block]:
    layout, _ = w.plan_layout(segments)
    w.adopt(layout)
    return layout


def test_a_context_becomes_blocks_of_its_segments_chained_by_prefix() -> None:
    w = window()
    layout = placed(w, [seg("a", 6), seg("b", 3, base=100)])
    assert [(b.segment, b.start, b.n_tokens, b.index) for b in layout] == [
        ("a", 0, 4, 0),
        ("a", 4, 2, 1),
        ("b", 6, 3, 0),
    ]
    prefix = token_digest(())
    for b in layout:  # each block's key names every token before it
        assert b.prefix == prefix
        prefix = token_digest(b.tokens, prefix.encode())
    assert w.length == 9
    assert [k.start for k in w.keys_for([seg("a", 6), seg("b", 3, base=100)])] == [0, 4, 6]


def test_placing_the_same_context_again_reuses_its_blocks_and_a_change_ends_reuse() -> None:
    w = window()
    first = placed(w, [seg("a", 8), seg("b", 4, base=100), seg("c", 4, base=200)])
    again, dropped = w.plan_layout([seg("a", 8), seg("b", 4, base=100), seg("c", 4, base=200)])
    assert [b.id for b in again] == [b.id for b in first] and dropped == []
    # b changes: a's blocks stay, b's and everything after are new (their prefix changed).
    changed, dropped = w.plan_layout([seg("a", 8), seg("b", 4, base=300), seg("c", 4, base=200)])
    assert [b.id for b in changed[:2]] == [b.id for b in first[:2]]
    assert not {b.id for b in changed[2:]} & {b.id for b in first}
    assert {b.id for b in dropped} == {b.id for b in first[2:]}


@pytest.mark.parametrize(
    ("problem", "segments", "error"),
    [
        ("a name twice", [seg("a", 2), seg("a", 2)], kvrt.InvalidContextError),
        ("past the planner context", [seg("a", 40)], kvrt.ContextTooLargeError),
    ],
)
def test_a_context_the_window_cannot_take_is_refused(
    problem: str, segments: list[tuple[kvrt.Segment, list[int]]], error: type[Exception]
) -> None:
    with pytest.raises(error):
        window(planner=32).plan_layout(segments)


def test_the_plan_keeps_sinks_and_recent_and_evicts_in_policy_order() -> None:
    w = window(sinks=4, recent=4)
    layout = placed(
        w,
        [
            seg("system", 4, cls="task_pinned"),
            seg("file", 8, base=100),
            seg("map", 4, base=200, cls="repo_map"),
            seg("user", 4, base=300),
        ],
    )
    order = policies.get("hot_eviction", "class_lru").order
    planned = w.plan_hot(order, budget=12)
    ids = {b.segment: [x.id for x in layout if x.segment == b.segment] for b in layout}
    # 20 tokens, 12 fit: the file (volatile) goes first, the map stays.
    assert planned == {*ids["system"], *ids["map"], *ids["user"]}
    assert w.plan_hot(order, budget=1) == {*ids["system"], *ids["user"]}  # never less
    assert w.plan_hot(order, budget=100) == {b.id for b in layout}


def places(blocks: Sequence[Block]) -> list[tuple[int, int, tuple[int, str]]]:
    return [(b.start, b.end, (b.start, b.prefix)) for b in blocks]


def test_what_stays_resident_when_a_context_changes() -> None:
    w, record = window(), Provenance()
    layout = placed(w, [seg("a", 8), seg("b", 6, base=100)])
    record.attend(0, 14, places(layout))  # computed as this layout's blocks
    engine = {p: t for b in layout for p, t in zip(range(b.start, b.end), b.tokens, strict=True)}

    # b grew: its first block is whole, its second block's leading tokens stay at the tail.
    grown, _ = w.plan_layout([seg("a", 8), seg("b", 7, base=100)])
    seen = record.screen(dict(engine), places(grown))
    assert seen == engine and w.kept_positions(grown, seen) == set(range(14))

    # a's second half replaced by x of the same length: b's tokens are resident at the same
    # positions, but their KV attended to a's tokens, not x's. By tokens alone they would
    # be kept; the record of where they were computed says otherwise.
    w.adopt(grown)
    changed, _ = w.plan_layout([seg("a", 4), seg("x", 4, base=500), seg("b", 6, base=100)])
    assert w.kept_positions(changed, engine) == {*range(4), *range(8, 14)}
    seen = record.screen(dict(engine), places(changed))
    assert {p for p, t in seen.items() if t == FOREIGN} == set(range(8, 14))
    assert w.kept_positions(changed, seen) == set(range(4))
    w.adopt(changed)
    assert w.strays(seen) == [(4, 14)]  # tidied away before the context is placed


def test_generated_tokens_join_the_last_block_until_it_is_full() -> None:
    w = window()
    placed(w, [seg("prompt", 3)])
    for t in range(6):
        w.append_token(1000 + t, "reply", kvrt.CacheClass.VOLATILE)
    assert [(b.segment, b.start, b.n_tokens) for b in w.blocks] == [
        ("prompt", 0, 3),
        ("reply", 3, 4),
        ("reply", 7, 2),
    ]
    assert w.token_at(8) == 1005 and w.token_at(9) is None
    w.truncate(5)
    assert [(b.segment, b.n_tokens) for b in w.blocks] == [("prompt", 3), ("reply", 2)]
    # The chain of prefixes still holds after generating: keys match a fresh layout.
    fresh = window()
    layout = placed(fresh, [seg("prompt", 3), (kvrt.Segment("reply", "x"), [1000, 1001])])
    assert [b.key("m") for b in w.blocks] == [b.key("m") for b in layout]


# -- random contexts against a reference model of the rules --

sizes = st.lists(st.integers(min_value=1, max_value=13), min_size=1, max_size=8)
classes = st.sampled_from(["task_pinned", "repo_map", "volatile"])


@settings(max_examples=300, deadline=None)
@given(
    lengths=sizes,
    kinds=st.lists(classes, min_size=8, max_size=8),
    budget=st.integers(min_value=0, max_value=120),
    sinks=st.integers(min_value=0, max_value=8),
    recent=st.integers(min_value=0, max_value=8),
    policy=st.sampled_from(["class_lru", "score_lru"]),
)
def test_any_plan_fits_its_budget_keeps_what_must_stay_and_evicts_only_what_it_must(
    lengths: list[int],
    kinds: list[str],
    budget: int,
    sinks: int,
    recent: int,
    policy: str,
) -> None:
    w = window(sinks=sinks, recent=recent)
    segments = [seg(f"s{i}", n, base=100 * i, cls=kinds[i]) for i, n in enumerate(lengths)]
    layout = placed(w, segments)
    # Blocks partition the context in order, none larger than a block.
    assert [t for b in layout for t in b.tokens] == [t for _, toks in segments for t in toks]
    assert all(0 < b.n_tokens <= BLOCK for b in layout)
    assert all(a.end == b.start for a, b in itertools.pairwise(layout))
    length = w.length
    must = {b.id for b in layout if b.start < sinks or b.end > length - recent}
    assert w.protected() == must
    order = policies.get("hot_eviction", policy).order
    planned = w.plan_hot(order, budget)
    size = {b.id: b.n_tokens for b in layout}
    kept = sum(size[i] for i in planned)
    assert must <= planned
    assert kept <= max(budget, sum(size[i] for i in must))  # within budget unless it cannot be
    # Evicted blocks come first in the policy's order among those that may go, and no more
    # of them than the budget needs: putting back the last one would break it.
    ranked = [b.id for b in w.eviction_order([b for b in layout if b.id not in must], order)]
    gone = [i for i in ranked if i not in planned]
    assert gone == ranked[: len(gone)]
    if gone:
        assert kept + size[gone[-1]] > budget
