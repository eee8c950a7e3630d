"""The placement planner without a model: table-driven cases of the step it picks, then
random contexts, budgets, eviction orders and a changing world (a store that lets blocks
go, a cold store that refuses blocks, other sessions computing the same blocks,
approximate hits that fail) run against a small reference model of the window, checking
what every placement must keep: the budget, computing only at the window's tail, every
block without KV computed, the plan's blocks hot at the end. Milliseconds each."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt._paging.gate import Tally, Written
from kvrt._paging.planner import (
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
from kvrt._types import Residency

H, C, D = Residency.HOT, Residency.COLD, Residency.DROPPED


def scene(
    states: str,
    *,
    sizes: tuple[int, ...] | None = None,
    planned: str | None = None,
    protected: tuple[int, ...] = (),
    budget: int = 100,
    approximate: tuple[int, ...] = (),
    elsewhere: tuple[int, ...] = (),
    resumes: dict[int, int] | None = None,
) -> Scene:
    """A scene from a string of states (``h`` hot, ``c`` cold, ``d`` dropped), blocks of
    4 tokens by default; ``planned`` marks the planned blocks with ``p`` (all by default)."""
    kinds = {"h": H, "c": C, "d": D}
    sizes = sizes or (4,) * len(states)
    starts = tuple(sum(sizes[:i]) for i in range(len(sizes)))
    marks = planned or "p" * len(states)
    resumes = resumes or {}
    return Scene(
        sizes=sizes,
        starts=starts,
        states=tuple(kinds[s] for s in states),
        resumes=tuple(resumes.get(i, sizes[i] if s == "h" else 0) for i, s in enumerate(states)),
        planned=frozenset(i for i, m in enumerate(marks) if m == "p"),
        protected=frozenset(protected),
        approximate=frozenset(approximate),
        elsewhere=frozenset(elsewhere),
        budget=budget,
        resident=sum(n for n, s in zip(sizes, states, strict=True) if s == "h"),
    )


COMPUTING = Cursor(computing=True)
NONE: frozenset[int] = frozenset()

CASES: list[tuple[str, Scene, Cursor, Step | None]] = [
    ("a context all hot is in place", scene("hhh"), Cursor(), None),
    (
        "a fresh context begins computing at its first block",
        scene("ddd"),
        Cursor(),
        Begin(0, clear_from=0, restore_before=False, leading=True, keep=NONE),
    ),
    (
        "once computing, adjacent blocks without KV go in one call",
        scene("ddd"),
        COMPUTING,
        Compute(0, (0, 1, 2), NONE),
    ),
    (
        "the run stops where the free room ends",
        scene("hddd", budget=12),
        Cursor(index=1, computing=True),
        Compute(1, (1, 2), frozenset({0})),
    ),
    (
        "a full window computes one block at a time, not a run pushing out all before it",
        scene("hhhddd", budget=16),
        Cursor(index=3, computing=True),
        Compute(3, (3,), frozenset({2})),
    ),
    (
        "a run takes only what the free room holds beside everything resident",
        scene("hhdddd", budget=20),
        Cursor(index=2, computing=True),
        Compute(2, (2, 3, 4), frozenset({1})),
    ),
    (
        "a run always holds its first block, room or not",
        scene("hdd", budget=4),
        Cursor(index=1, computing=True),
        Compute(1, (1,), frozenset({0})),
    ),
    (
        "computing resumes after a block's leading tokens at the tail",
        scene("hd", resumes={1: 3}),
        Cursor(),
        Begin(1, clear_from=7, restore_before=False, leading=False, keep=frozenset({0})),
    ),
    (
        "computing after a cold block the plan lets go brings it back first",
        scene("hcd", planned="p-p"),
        Cursor(),
        Begin(2, clear_from=8, restore_before=True, leading=True, keep=frozenset({1})),
    ),
    (
        "adjacent planned cold blocks come back in one run",
        scene("hcch"),
        Cursor(),
        RestoreRun(1, (1, 2), frozenset({0})),
    ),
    (
        "a cold block the plan lets go stays cold",
        scene("hch", planned="p-p"),
        Cursor(),
        None,
    ),
    (
        "a cold block the next computation follows comes back, required",
        scene("hcd", planned="p-p"),
        Cursor(index=1, computing=True),
        RestoreRun(1, (1,), frozenset({0}), required=True),
    ),
    (
        "a planned run ends at the first block the plan lets go",
        scene("ccch", planned="pp-p"),
        Cursor(),
        RestoreRun(0, (0, 1), NONE),
    ),
    (
        "the block before a run stays only when the plan keeps it",
        scene("hch", planned="-pp"),
        Cursor(index=1),
        RestoreRun(1, (1,), NONE),
    ),
    (
        "a block another session is computing is waited for",
        scene("hdd", elsewhere=(1,)),
        Cursor(index=1, computing=True),
        WaitFor(1),
    ),
    (
        "an approximate candidate is tried first, the run after it computed if it fails",
        scene("hdd", approximate=(1,)),
        Cursor(index=1, computing=True),
        Compute(1, (1, 2), frozenset({0}), approximate=True),
    ),
    (
        "a run stops before an approximate candidate",
        scene("hddd", approximate=(3,)),
        Cursor(index=1, computing=True),
        Compute(1, (1, 2), frozenset({0})),
    ),
    (
        "a cold block before is brought back first, its room counted",
        scene("cdd", budget=8),
        Cursor(index=1, computing=True),
        Compute(1, (1,), frozenset({0}), restore_before=True),
    ),
    (
        "a block before that lost its KV meanwhile is computed again first",
        scene("hdd"),
        Cursor(index=2, computing=True),
        Compute(1, (1, 2), frozenset({0})),
    ),
    (
        "a planned block pushed out comes back once every block is placed",
        scene("hchh", planned="pp-p"),
        Cursor(index=4, computing=True),
        RestoreRun(1, (1,), frozenset({0, 1, 3}), converging=True),
    ),
]


@pytest.mark.parametrize(
    ("scene_", "cursor", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_planner_picks_the_step(scene_: Scene, cursor: Cursor, expected: Step | None) -> None:
    assert plan(scene_, cursor) == expected


def test_outcomes_move_the_cursor() -> None:
    restore = RestoreRun(2, (2, 3, 4), NONE)
    assert advance(Cursor(), restore, 3) == Cursor(index=5)
    assert advance(Cursor(), restore, 1) == Cursor(index=3)  # the rest come back later
    assert advance(Cursor(), restore, 0) == Cursor(index=2)  # the store let go: look again
    assert advance(Cursor(), restore, None) == Cursor(index=5)  # no room: they stay cold
    begin = Begin(1, clear_from=4, restore_before=False, leading=True, keep=NONE)
    assert advance(Cursor(index=3), begin, 0) == Cursor(index=1, computing=True)
    assert advance(COMPUTING, WaitFor(2), 0) == Cursor(index=2, computing=True)
    compute = Compute(1, (1, 2), NONE, approximate=True)
    assert advance(COMPUTING, compute, 1) == Cursor(index=2, computing=True)  # a hit
    assert advance(COMPUTING, compute, 2) == Cursor(index=3, computing=True)
    back = RestoreRun(1, (1,), NONE, converging=True)
    assert advance(COMPUTING, back, 1) == Cursor(index=2, converging=True)
    done = advance(COMPUTING, back, None)
    assert plan(scene("hchc", planned="pppp"), done) is None


# -- a reference model of the window, run by the planner --


class NoRoom(Exception):
    pass


@dataclass
class World:
    """A window of blocks as the executor sees it, and what changes under it."""

    sizes: list[int]
    states: list[Residency]
    budget: int
    protected: frozenset[int]
    order: list[int]
    """The eviction policy's order (first evicted first)."""
    refused: frozenset[int]
    """Blocks the cold store refuses: evicting them keeps their tokens only."""
    lost: set[int]
    """Cold blocks the store lets go before they are restored."""
    elsewhere: set[int]
    """Dropped blocks another session is computing."""
    finished: frozenset[int]
    """Of those, the ones whose copy lands in the store."""
    approximate: frozenset[int]
    hits: frozenset[int]
    """Approximate candidates whose hit succeeds."""
    computed: list[int] = field(default_factory=list)
    dropped_once: set[int] = field(default_factory=set)

    @property
    def starts(self) -> list[int]:
        return [sum(self.sizes[:i]) for i in range(len(self.sizes))]

    @property
    def resident(self) -> int:
        return sum(n for n, s in zip(self.sizes, self.states, strict=True) if s is H)

    def planned(self) -> frozenset[int]:
        total, planned = sum(self.sizes), set(range(len(self.sizes)))
        for i in self.order:
            if total <= self.budget:
                break
            if i not in self.protected:
                planned.discard(i)
                total -= self.sizes[i]
        return frozenset(planned)

    def scene(self, planned: frozenset[int]) -> Scene:
        return Scene(
            sizes=tuple(self.sizes),
            starts=tuple(self.starts),
            states=tuple(self.states),
            resumes=tuple(n if s is H else 0 for n, s in zip(self.sizes, self.states, strict=True)),
            planned=planned,
            protected=self.protected,
            approximate=frozenset(i for i in self.approximate if self.states[i] is D),
            elsewhere=frozenset(i for i in self.elsewhere if self.states[i] is D),
            budget=self.budget,
            resident=self.resident,
        )

    def room(self, keep: set[int]) -> int:
        shielded = self.protected | keep
        evictable = sum(
            n for i, n in enumerate(self.sizes) if i not in shielded and self.states[i] is H
        )
        return self.budget - (self.resident - evictable)

    def evict(self, i: int) -> None:
        self.states[i] = D if i in self.refused else C
        if i in self.refused:
            self.dropped_once.add(i)

    def make_room(self, need: int, keep: set[int]) -> None:
        while self.budget - self.resident < need:
            candidates = [
                i for i in self.order if i not in self.protected | keep and self.states[i] is H
            ]
            if not candidates:
                raise NoRoom
            self.evict(candidates[0])

    def restore_run(self, blocks: tuple[int, ...], keep: set[int]) -> int:
        run = []
        for i in blocks:
            if i in self.lost:  # the store let it go meanwhile
                self.lost.discard(i)
                self.states[i] = D
                self.dropped_once.add(i)
                break
            run.append(i)
        if not run:
            return 0
        room = self.room(keep)
        while len(run) > 1 and sum(self.sizes[i] for i in run) > room:
            run.pop()
        self.make_room(sum(self.sizes[i] for i in run), keep | set(run))
        for i in run:
            self.states[i] = H
        return len(run)

    def restore_one(self, i: int) -> int:
        return self.restore_run((i,), set()) if self.states[i] is C else 0

    def compute(self, blocks: tuple[int, ...], keep: set[int]) -> None:
        first = blocks[0]
        assert all(self.states[i] is D for i in blocks), "computes only blocks without KV"
        assert first == 0 or self.states[first - 1] is H, "computes only after a hot block"
        later = [i for i in range(first + 1, len(self.sizes)) if self.states[i] is H]
        assert not later, "computes only at the window's tail"
        self.make_room(sum(self.sizes[i] for i in blocks), keep | set(blocks))
        for i in blocks:
            self.states[i] = H
        self.computed += blocks

    def run(self, step: Step) -> int | None:
        """The executor's contract, on the model."""
        match step:
            case RestoreRun(blocks=blocks, keep=keep, required=required):
                try:
                    return self.restore_run(blocks, set(keep))
                except NoRoom:
                    if required:
                        raise
                    return None
            case Begin(index=j, clear_from=clear_from):
                for i, start in enumerate(self.starts):
                    if start >= clear_from and self.states[i] is H:
                        self.evict(i)
                if step.restore_before:
                    self.restore_one(j - 1)
                return 0
            case WaitFor(index=i):
                self.elsewhere.discard(i)
                if i in self.finished:
                    self.states[i] = C
                return 0
            case Compute(index=i, blocks=blocks, keep=keep):
                if step.restore_before and not self.restore_one(i - 1):
                    return 0
                if step.approximate and i in self.hits:
                    self.make_room(self.sizes[i], set(keep) | {i})
                    self.states[i] = H
                    return 1
                self.compute(blocks, set(keep))
                return len(blocks)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    n = draw(st.integers(1, 10))
    sizes = draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    states = draw(st.lists(st.sampled_from([H, C, D]), min_size=n, max_size=n))
    index = st.sampled_from(range(n))
    protected = {0, n - 1} | draw(st.sets(index, max_size=2))
    # The session refuses, before anything moves, a context whose protected blocks do not
    # fit (NotVisibleError): the model starts where placing one begins.
    floor = sum(sizes[i] for i in protected) + 2 * max(sizes)
    budget = draw(st.integers(floor, max(floor, sum(sizes))))
    order = draw(st.permutations(range(n)))
    world = World(
        sizes=sizes,
        states=states,
        budget=budget,
        protected=frozenset(protected),
        order=list(order),
        refused=frozenset(draw(st.sets(index))),
        lost=draw(st.sets(index)),
        elsewhere=draw(st.sets(index)),
        finished=frozenset(draw(st.sets(index))),
        approximate=frozenset(draw(st.sets(index))),
        hits=frozenset(draw(st.sets(index))),
    )
    for i in order:  # what the engine holds fits its budget
        if world.resident <= budget:
            break
        if states[i] is H:
            states[i] = C
    return world


def test_the_query_is_placed_after_what_comes_before_it_when_the_context_overflows() -> None:
    """A context larger than the window, with blocks to compute before its last segment
    and in it, is placed in two steps (the blocks before the query first); otherwise in
    one go."""
    segs = ["body", "body", "body", "q"]
    assert query_first(segs, [128, 128, 128, 16], [D, D, D, D], 256) == 3
    assert query_first(segs, [128, 128, 128, 16], [H, C, D, D], 256) == 3
    assert query_first(segs, [128, 128, 128, 16], [H, C, C, D], 256) == 0  # nothing before
    assert query_first(segs, [128, 128, 128, 16], [D, D, D, H], 256) == 0  # query in place
    assert query_first(segs, [128, 128, 128, 16], [D, D, D, D], 400) == 0  # it fits
    assert query_first(["q", "q"], [200, 200], [D, D], 256) == 0  # only a query
    assert query_first([], [], [], 256) == 0
    two = ["body", "q", "q"]  # the whole last segment waits
    assert query_first(two, [300, 8, 8], [D, D, D], 256) == 1


@settings(max_examples=400, deadline=None)
@given(worlds())
def test_every_placement_keeps_the_rules(world: World) -> None:
    place(world)


def test_a_block_before_that_the_store_let_go_is_computed_not_skipped() -> None:
    """Computing begins after a cold block the plan lets go; restoring it finds the store
    let it go meanwhile: it is computed first, never computed across the gap."""
    world = World(
        sizes=[4, 4, 4, 4],
        states=[H, C, D, H],
        budget=12,
        protected=frozenset({0, 3}),
        order=[1, 2, 0, 3],
        refused=frozenset(),
        lost={1},
        elsewhere=set(),
        finished=frozenset(),
        approximate=frozenset(),
        hits=frozenset(),
    )
    assert world.planned() == {0, 2, 3}
    place(world)
    assert world.computed == [1, 2]


def place(world: World) -> None:
    """Place the world's context as the session does, checking the rules on the way."""
    planned = world.planned()
    was_dropped = {i for i, s in enumerate(world.states) if s is D}
    cursor, steps = Cursor(), 0
    while (step := plan(world.scene(planned), cursor)) is not None:
        cursor = advance(cursor, step, world.run(step))
        steps += 1
        assert steps <= 8 * len(world.sizes) + 8, "placement must end"
        assert world.resident <= world.budget
    # Every block that had no KV was computed (or had its copy from elsewhere), unless the
    # store let it go or refused it on the way; nothing is left without KV otherwise.
    dropped_now = {i for i, s in enumerate(world.states) if s is D}
    assert dropped_now <= world.dropped_once
    assert was_dropped - world.dropped_once <= set(world.computed) | world.finished | {
        i for i in world.approximate if i in world.hits
    }
    # The plan's blocks end hot, unless their KV was lost or refused on the way.
    assert {i for i in planned if world.states[i] is not H} <= world.dropped_once
    # Every block is computed at most once in a placement.
    assert len(world.computed) == len(set(world.computed))


def test_a_command_adds_up_the_tallies_its_moves_return() -> None:
    """Counts add up; where two moves wrote a position, the later one says where its KV
    came from (a block restored, then computed again, was computed)."""
    tally = Tally(reused=3)
    restored = Tally(restored=4, evicted=2)
    restored.wrote([Written(0, 4, None, "restored")])
    computed = Tally(prefilled=2)
    computed.wrote([Written(2, 6, None, "prefilled")])
    tally += restored
    tally += computed
    assert (tally.reused, tally.restored, tally.prefilled, tally.evicted) == (3, 4, 2, 2)
    assert tally.sources == {0: "restored", 1: "restored"} | dict.fromkeys(range(2, 6), "prefilled")
    assert restored.sources == dict.fromkeys(range(4), "restored")  # the parts stay as they were
