"""Random operations with random cancellation, and many sessions at once, on one model.

After every step: no KV lost (every block that had KV, hot or cold, before the step still
has it), the hot window and the cold store within budget, ``explain()`` consistent, and
the next call succeeds. What is checked is kvrt's bookkeeping, not text: the model is the
zoo's tiny llama (:mod:`kvrt.testing.zoo`), which computes a call in about a millisecond.
"""

from __future__ import annotations

import random

import anyio
import pytest

import kvrt
from kvrt import Config, EngineConfig, MemoryConfig, Residency, SessionConfig
from kvrt._cold import ColdKey
from tests.support.fuzz import RECENT, SMALL, canceller, one_op, random_context
from tests.support.models import tiny, zoo_path

pytestmark = pytest.mark.anyio

HOT = 128


Held = dict[ColdKey, tuple[str, int, tuple[int, ...]]]


def with_kv(s: kvrt.Session) -> Held:
    """The blocks that have KV now (hot in the window, or in the cold store), by the key
    their KV is stored under (a partial-window block's is its own)."""
    a = s._actor
    resident = a.gate.resident()
    held: Held = {}
    for b in a.window.blocks:
        state = a.window.residency(b, resident, a.cold)
        key = a.gate.stored_key(b) if state is Residency.HOT else a.paging.restorable_key(b)
        if state is not Residency.DROPPED and key is not None:
            held[key] = (b.prefix, b.start, tuple(b.tokens))
    return held


def check(s: kvrt.Session, before: Held) -> None:
    a = s._actor
    report = s.explain()
    assert report.consistent, (report.problems, list(RECENT))
    assert report.hot_tokens <= report.hot_budget
    stats = report.cold_store
    assert stats.bytes <= stats.budget_bytes
    now = with_kv(s)
    grown = {(prefix, start): toks for prefix, start, toks in now.values()}
    lost = []
    for key, (prefix, start, toks) in before.items():
        if (
            key in a.cold
            or key in now
            or (key.session_local and (prefix, start, toks) in now.values())
        ):
            continue  # still there (partial-window KV may be computed again, exactly)
        longer = grown.get((prefix, start))
        if longer is not None and longer[: len(toks)] == toks:
            continue  # the last block, grown by generation
        lost.append((start, len(toks)))
    assert not lost, f"blocks (start, tokens) {lost} lost their KV after {list(RECENT)}"


async def fuzz(s: kvrt.Session, rng: random.Random, steps: int) -> int:
    current = random_context(rng)
    await s.ensure_context(current)
    cancelled = 0
    for _ in range(steps):
        before = with_kv(s)
        if rng.random() < 0.4:
            with anyio.CancelScope() as scope:
                s._actor.fault = canceller(s, scope, at=rng.randrange(12))
                await one_op(s, rng, current)
                RECENT.append("(finished before its cancel point)")
            s._actor.fault = None
            cancelled += scope.cancelled_caught
            assert not s.explain().mailbox["in_flight"]  # settled before the caller resumed
            check(s, before)
            # The next call succeeds, whatever the cancelled one left behind.
            before = with_kv(s)
            await s.ensure_context(current)
        else:
            await one_op(s, rng, current)
        check(s, before)
    return cancelled


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the sixteen sessions run trio
async def test_random_cancellation_fuzz_1000_operations(anyio_backend: str) -> None:
    config = Config(session=SessionConfig(**SMALL))
    rng = random.Random(f"fuzz-{anyio_backend}")
    async with (
        kvrt.open_runtime(engine=tiny(), config=config) as rt,
        rt.open_session(hot_tokens=HOT) as s1,
        rt.open_session(hot_tokens=HOT, restore="calibrated") as s2,
    ):
        cancelled = await fuzz(s1, rng, 500) + await fuzz(s2, rng, 500)
        assert s1.explain().counters.cancelled_calls + s2.explain().counters.cancelled_calls > 0
    assert cancelled >= 100  # the fuzz really did cancel a good share of its calls


@pytest.mark.parametrize("anyio_backend", ["trio"])  # the cancellation fuzz runs asyncio
async def test_sixteen_sessions_hundred_operations_each(anyio_backend: str) -> None:
    # A cold store much smaller than 16 sessions' blocks (about 1,000 tokens): victims go.
    budget = 1040 * tiny().facts.kv_bytes_per_token
    config = Config(
        memory=MemoryConfig(cold=budget),
        engine=EngineConfig(model=zoo_path("llama"), threads=1, parallel=2),
        session=SessionConfig(**SMALL, cold_wait=2.0),
    )
    peak = {"engine_calls": 0.0, "cold": 0}

    async def watch(rt: kvrt.Runtime) -> None:
        while True:
            peak["engine_calls"] = max(peak["engine_calls"], rt.engine_turns.busy)
            peak["cold"] = max(peak["cold"], rt.cold_stats().bytes)
            await anyio.sleep(0.005)

    async def worker(rt: kvrt.Runtime, i: int) -> None:
        rng = random.Random(f"worker-{i}-{anyio_backend}")
        async with rt.open_session(hot_tokens=HOT, name=f"s{i}") as s:
            current = random_context(rng)
            await s.ensure_context(current)
            for _ in range(100):
                await one_op(s, rng, current)
                report = s.explain()
                assert report.consistent, report.problems
                assert report.hot_tokens <= report.hot_budget
            done.append(i)

    done: list[int] = []
    with anyio.fail_after(600):  # no deadlock: everything finishes, well within this
        async with kvrt.open_runtime(config=config) as rt:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, rt)
                async with anyio.create_task_group() as workers:
                    for i in range(16):
                        workers.start_soon(worker, rt, i)
                tg.cancel_scope.cancel()
            stats = rt.cold_stats()
    assert sorted(done) == list(range(16))
    assert peak["cold"] <= budget and stats.bytes <= budget
    assert stats.evictions > 0  # the store was under pressure and stayed inside its budget
    assert peak["engine_calls"] == 2  # engine calls ran in parallel across sessions
