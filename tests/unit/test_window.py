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
from kvrt._paging.provenance import FOREIGN, Provenance
from kvrt._paging.segments import Placed
from kvrt._paging.window import Block, HotWindow

BLOCK = 4


def window(*, sinks: int = 4, recent: int = 4, planner: int = 10_000) -> HotWindow:
    return HotWindow(
        fingerprint="model",
        planner_context=planner,
        block_tokens=BLOCK,
        sink_tokens=sinks,
        recent_tokens=recent,
    )


def seg(name: str, n: int, base: int = 0, cls: str = "volatile") -> Placed:
    return Placed(
        kvrt.Segment(name, "x", cache_class=kvrt.CacheClass(cls)), list(range(base, base + n))
    )


def placed(w: HotWindow, segments: Sequence[Placed]) -> list[Block]:
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
        window(planner=32).plan_layout(segments)  # type: ignore[arg-type]  # bad on purpose


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


def places(blocks: Sequence[Block]) -> list[tuple[int, int, tuple[int, str], set[int]]]:
    return [(b.start, b.end, (b.start, b.prefix), b.lone_positions()) for b in blocks]


def test_what_stays_resident_when_a_context_changes() -> None:
    w, record = window(), Provenance()
    layout = placed(w, [seg("a", 8), seg("b", 6, base=100)])
    record.attend(0, 14, [p[:3] for p in places(layout)])  # computed as this layout's blocks
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


def test_how_a_token_was_computed_is_part_of_every_later_blocks_identity() -> None:
    """A reply's tokens computed alone (generated) and the same tokens prefilled are other
    KV, and so is everything after them: other keys from the reply's block on, and
    resident KV of the other lineage is not reused."""
    w, record = window(), Provenance()
    reply = Placed(kvrt.Segment("reply", "x"), list(range(100, 106)), frozenset(range(2, 6)))
    after = seg("user", 4, base=200)
    as_generated = w.keys_for([seg("a", 4), reply, after])
    prefilled = w.keys_for([seg("a", 4), reply._replace(lone=frozenset()), after])
    assert as_generated[0] == prefilled[0]  # before the reply: the same blocks
    assert all(g != p for g, p in zip(as_generated[1:], prefilled[1:], strict=True))
    assert as_generated[1].prefix == prefilled[1].prefix  # the reply's own blocks differ
    assert as_generated[1].tokens != prefilled[1].tokens  # in their tokens' lineage, the
    assert as_generated[3].tokens == prefilled[3].tokens  # one after them in its prefix
    assert as_generated[3].prefix != prefilled[3].prefix

    layout = placed(w, [seg("a", 4), reply, after])
    engine = {p: t for b in layout for p, t in zip(range(b.start, b.end), b.tokens, strict=True)}
    record.attend(0, 14, [p[:3] for p in places(layout)])
    record.lineage(0, 14, range(6, 10))  # the reply generated: computed alone
    assert record.screen(dict(engine), places(layout)) == engine
    record.lineage(4, 10, ())  # the same tokens prefilled
    seen = record.screen(dict(engine), places(layout))
    assert {p for p, t in seen.items() if t == FOREIGN} == set(range(6, 10))


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
    # The chain of prefixes still holds after generating: keys match a fresh layout that
    # places the reply as generated (computed alone), and only such a one.
    reply = Placed(kvrt.Segment("reply", "x"), [1000, 1001], frozenset({0, 1}))
    layout = placed(window(), [seg("prompt", 3), reply])
    assert [b.key("m") for b in w.blocks] == [b.key("m") for b in layout]
    prefilled = placed(window(), [seg("prompt", 3), reply._replace(lone=frozenset())])
    assert [b.key("m") for b in w.blocks][1] != prefilled[1].key("m")


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
    assert [t for b in layout for t in b.tokens] == [t for p in segments for t in p.tokens]
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
