"""kvrt inside a trio test suite (pytest-trio), with trio's own nurseries and timeouts."""

from __future__ import annotations

import pytest
import trio

import kvrt
from tests.support.models import FILE_A, FILE_B, context, greedy

pytestmark = pytest.mark.model


@pytest.mark.trio
async def test_concurrent_sessions_in_a_nursery() -> None:
    answers: dict[str, list[int]] = {}
    async with kvrt.open_runtime() as rt:

        async def agent(name: str, question: str) -> None:
            async with rt.open_session(hot_tokens=512, name=name) as session:
                files = (("file:a.py", FILE_A), ("file:b.py", FILE_B))
                status = await session.ensure_context(context(*files, question=question))
                assert status.logical_tokens > 512 >= status.hot_tokens
                answers[name] = await greedy(session, 12)
                assert session.explain().consistent

        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent, "adder", "What does add_2 do?")
            nursery.start_soon(agent, "multiplier", "What does mul_2 do?")
        assert rt.cold_stats().puts > 0  # both windows overflowed into the shared store
    assert set(answers) == {"adder", "multiplier"}
    assert all(len(tokens) == 12 for tokens in answers.values())


@pytest.mark.trio
async def test_trio_cancellation_leaves_session_usable() -> None:
    async with kvrt.open_runtime() as rt, rt.open_session(hot_tokens=512) as session:
        await session.ensure_context(context(question="Count to one hundred."))
        seen = 0
        with trio.CancelScope() as scope:
            async for _piece in session.generate(400, stop_at_end=False):
                seen += 1
                if seen == 5:
                    scope.cancel()  # as a deadline would, mid-stream
        assert scope.cancelled_caught
        report = session.explain()
        assert report.consistent, report.problems
        assert report.counters.generated_tokens >= 5
        more = await greedy(session, 4)
        assert len(more) == 4


@pytest.mark.trio
async def test_deadline_mid_prefill_returns_a_settled_session() -> None:
    files = (("file:a.py", FILE_A), ("file:b.py", FILE_B))
    async with kvrt.open_runtime() as rt, rt.open_session(hot_tokens=512) as session:
        with trio.move_on_after(0.3) as scope:  # far less than the prefill takes
            await session.ensure_context(context(*files, question="Compare them."))
        assert scope.cancelled_caught
        report = session.explain()  # right away: the cancelled call has been settled
        assert report.mailbox["in_flight"] == 0
        assert report.consistent, report.problems
        assert report.counters.cancelled_calls == 1
        status = await session.ensure_context(context(*files, question="Compare them."))
        assert status.logical_tokens > 512
