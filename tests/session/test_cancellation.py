"""Cancellation at every await point of ensure_context and generate loses nothing.

A fault hook in the session's actor is called, with a label, before each await point of a
command. An uninterrupted run lists the points it passes; the test then cancels a fresh
call at the first and at the last pass of every distinct point, checks the session is
consistent, and that the next call succeeds. The model is the zoo's tiny llama: what is
checked is kvrt's own bookkeeping around its await points.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import pytest

import kvrt
from kvrt import Config, DiskConfig, Residency, SessionConfig
from tests.support.models import FILE_A, FILE_B, SYSTEM, context, greedy, tiny


def short(*files: tuple[str, str], question: str) -> list[kvrt.Segment]:
    return [
        kvrt.Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
        *(kvrt.Segment(name, text) for name, text in files),
        kvrt.Segment("user", question),
    ]


pytestmark = pytest.mark.anyio

# Small blocks keep each step cheap while exercising every kind of await point.
SMALL = Config(session=SessionConfig(block_tokens=16, sink_tokens=4, recent_tokens=16))
HOT = 128


_RUNS = itertools.count()


def fresh() -> Config:
    """SMALL with a disk tier in a folder no runtime has used (inside the test's cache)."""
    folder = Path(os.environ["KVRT_CACHE_DIR"]) / f"run-{next(_RUNS)}"
    return msgspec.structs.replace(SMALL, disk=DiskConfig(path=str(folder), budget=2**30))


def _labels(session: kvrt.Session) -> list[str]:
    seen: list[str] = []
    session._actor.fault = seen.append
    return seen


def _cancel_at(session: kvrt.Session, k: int, scope: anyio.CancelScope) -> list[str]:
    seen: list[str] = []

    def hook(label: str) -> None:
        seen.append(label)
        if len(seen) == k + 1:
            scope.cancel()
            current = session._actor.current
            assert current is not None
            current.abandon()

    session._actor.fault = hook
    return seen


def _check(session: kvrt.Session) -> None:
    report = session.explain()
    assert report.consistent, report.problems
    assert report.hot_tokens <= report.hot_budget
    hot = {b.start for b in report.blocks if b.residency is Residency.HOT}
    assert report.hot_tokens == sum(b.n_tokens for b in report.blocks if b.start in hot)


def _first_and_last(points: list[str]) -> list[int]:
    picks: set[int] = set()
    for label in set(points):
        where = [i for i, p in enumerate(points) if p == label]
        picks.update((where[0], where[-1]))
    return sorted(picks)


async def _sweep(
    step: Callable[[kvrt.Session], Awaitable[object]],
    prepare: Callable[[kvrt.Session], Awaitable[object]],
    lost_nothing: Callable[[kvrt.Session], Awaitable[None]],
) -> set[str]:
    # A fresh runtime each time, with a disk tier of its own: a cold store shared with an
    # earlier run would already hold the blocks, hiding a block lost between its eviction
    # and its commit.
    async with (
        kvrt.open_runtime(engine=tiny(), config=fresh()) as rt,
        rt.open_session(hot_tokens=HOT) as probe,
    ):
        await prepare(probe)
        points = _labels(probe)
        await step(probe)
    for k in _first_and_last(points):
        async with (
            kvrt.open_runtime(engine=tiny(), config=fresh()) as rt,
            rt.open_session(hot_tokens=HOT) as s,
        ):
            await prepare(s)
            with anyio.CancelScope() as scope:
                _cancel_at(s, k, scope)
                await step(s)
            s._actor.fault = None
            _check(s)
            await lost_nothing(s)
            await step(s)  # the next call succeeds
            _check(s)
    return set(points)


async def test_cancel_ensure_context_at_every_await_point() -> None:
    # The first context fits the window, so its last token's logits are exact and kept
    # when the step evicts it (a context computed under a partial window keeps none).
    before = short(
        ("file:a.py", FILE_A[:100]), ("file:b.py", FILE_B[:100]), question="Explain add_1."
    )

    async def prepare(s: kvrt.Session) -> None:
        await s.ensure_context(before)
        await s.evict("file:a.py")

    async def lost_nothing(s: kvrt.Session) -> None:
        # Every block the earlier context had KV for comes back without compute (the last
        # token alone is recomputed, to have logits to continue from).
        status = await s.ensure_context(before)
        assert status.prefilled_tokens <= 1, status

    async def step(s: kvrt.Session) -> None:
        await s.ensure_context(
            short(
                ("file:a.py", FILE_A[:200]),
                ("file:c.py", FILE_B[200:400]),
                question="Compare them.",
            )
        )

    assert await _sweep(step, prepare, lost_nothing) == {
        "admit",
        "export",
        "cold put",
        "evict",
        "prefill",
        "logits",
    }


async def test_cancel_generate_at_every_await_point() -> None:
    async def prepare(s: kvrt.Session) -> None:
        await s.ensure_context(short(("file:a.py", FILE_A[:240]), question="List the functions."))

    async def step(s: kvrt.Session) -> None:
        await greedy(s, 24)

    async def lost_nothing(s: kvrt.Session) -> None:
        # Context and generated tokens alike: every block still has its KV, hot or cold.
        assert s.explain().residency_tokens["dropped"] == 0, s.explain().blocks

    assert await _sweep(step, prepare, lost_nothing) >= {
        "logits",
        "step",
        "stream",
        "export",
        "cold put",
        "evict",
    }


async def test_cancelled_caller_while_queued_does_not_run() -> None:
    async with (
        kvrt.open_runtime(engine=tiny(), config=SMALL) as rt,
        rt.open_session(hot_tokens=HOT) as s,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.ensure_context, context(question="First?"))
            await anyio.lowlevel.checkpoint()
            with anyio.move_on_after(0.01):
                await s.ensure_context(context(("file:a.py", FILE_A), question="Second?"))
        _check(s)
        assert s.explain().counters.ensure_calls >= 1
        status = await s.ensure_context(context(question="Third?"))
        assert status.logical_tokens > 0


async def test_generate_after_a_cancelled_placement_says_to_send_the_context_again() -> None:
    """A placement cancelled midway leaves the layout asked for but not the engine's
    window: generating from it is refused with a clear error (never a confusing position
    error), and the next context call places it."""
    small = short(("file:a.py", FILE_A[:200]), question="Explain add_1.")
    big = short(("file:a.py", FILE_A[:600]), ("file:b.py", FILE_B[:600]), question="Compare.")
    async with (
        kvrt.open_runtime(engine=tiny(), config=fresh()) as rt,
        rt.open_session(hot_tokens=HOT) as s,
    ):
        await s.ensure_context(small)
        seen: list[str] = []
        with anyio.CancelScope() as scope:

            def hook(label: str) -> None:
                seen.append(label)
                if seen.count("prefill") == 2:  # midway: blocks placed, others not yet
                    scope.cancel()

            s._actor.fault = hook
            await s.ensure_context(big)
        s._actor.fault = None
        assert scope.cancelled_caught
        _check(s)
        for _ in range(2):  # the same answer every time, never a position error
            with pytest.raises(kvrt.ContextNotPlacedError, match="send the context again"):
                await s.generate(max_tokens=4)
        status = await s.ensure_context(big)
        assert status.logical_tokens > HOT
        assert len((await s.generate(max_tokens=4, stop_at_end=False)).tokens) == 4
        _check(s)


async def test_admitting_a_block_with_no_kv_left_is_its_own_error() -> None:
    async with (
        kvrt.open_runtime(engine=tiny(), config=fresh()) as rt,
        rt.open_session(hot_tokens=HOT, cold_admission="skip_small_volatile") as s,
    ):
        await s.ensure_context(short(("note", "Keep it short."), question="Why?"))
        await s.evict("note")  # small and volatile: kept as tokens only
        for _ in range(2):
            with pytest.raises(kvrt.NotInColdStoreError, match="no KV bytes left"):
                await s.admit("note")
        assert s.explain().consistent
