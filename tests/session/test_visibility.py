"""What the model saw: per-segment visibility in ``explain()``, and ``require_visible``.

The model attends only to the hot window. ``explain().segments`` says, per segment, how
much is hot; ``ensure_context(..., require_visible=[...])`` keeps named segments hot or
refuses, before anything moves, when they cannot all be. (On the zoo's tiny llama: the
accounting needs no real text.)
"""

from __future__ import annotations

import pytest

import kvrt
from kvrt import Segment
from tests.support.models import tiny
from tests.support.text import STORY

pytestmark = pytest.mark.anyio


def context() -> list[Segment]:
    return [
        Segment(
            "system",
            "You answer questions about the notes.",
            cache_class=kvrt.CacheClass.TASK_PINNED,
        ),
        Segment("notes:a", "Note A. " + STORY * 4),
        Segment("notes:b", "Note B. " + STORY * 4),
        Segment("notes:c", "Note C. " + STORY * 4),
        Segment("q", "Which note mentions the storm first?"),
    ]


def seen(session: kvrt.Session) -> dict[str, str]:
    return {s.name: s.seen for s in session.explain().segments}


async def test_segments_say_what_is_hot_and_required_ones_stay_hot() -> None:
    async with kvrt.open_runtime(engine=tiny()) as rt, rt.open_session(hot_tokens=512) as s:
        status = await s.ensure_context(context())
        report = s.explain()
        assert status.logical_tokens > 512  # more than the window: something is not seen
        lines = {x.name: x for x in report.segments}
        assert [x.name for x in report.segments] == [seg.name for seg in context()]
        for line in report.segments:
            assert line.hot_tokens + line.cold_tokens + line.dropped_tokens == line.n_tokens
            assert not line.required
        assert sum(x.hot_tokens for x in report.segments) == status.visible_tokens
        assert {n for n, x in lines.items() if x.seen != "hot"} == set(status.invisible_segments)
        assert lines["notes:a"].seen != "hot"  # the oldest volatile note went first

        status = await s.ensure_context(context(), require_visible=["system", "notes:a"])
        report = s.explain()
        lines = {x.name: x for x in report.segments}
        assert lines["notes:a"].seen == "hot" and lines["notes:a"].required
        assert lines["system"].seen == "hot" and lines["system"].required
        assert "notes:a" not in status.invisible_segments
        # The context is larger than the window: what was computed while notes were out of
        # it saw a partial window, and the status says so.
        assert not status.exact and status.partial_window_tokens > 0
        assert report.partial_window_tokens == status.partial_window_tokens
        assert report.consistent
        done = await s.generate(max_tokens=8)  # generation keeps them hot too
        assert seen(s)["notes:a"] == "hot"
        assert "notes:a" not in done.invisible_segments

        # Asked again without the guard, the policy is free to choose again.
        await s.ensure_context(context())
        assert not any(x.required for x in s.explain().segments)


async def test_an_impossible_requirement_is_refused_before_anything_moves() -> None:
    async with kvrt.open_runtime(engine=tiny()) as rt, rt.open_session(hot_tokens=512) as s:
        await s.ensure_context(context()[:2] + context()[-1:])
        before = s.explain()
        with pytest.raises(kvrt.NotVisibleError, match="more than the hot window's 512"):
            await s.ensure_context(context(), require_visible=["notes:a", "notes:b", "notes:c"])
        after = s.explain()
        assert after.blocks == before.blocks and after.consistent  # nothing moved
        with pytest.raises(kvrt.InvalidContextError, match="'notes:z', which is not a segment"):
            await s.ensure_context(context(), require_visible=["notes:z"])
        with pytest.raises(kvrt.ArgumentTypeError, match="list of segment names"):
            await s.ensure_context(context(), require_visible="notes:a")
        assert s.explain().blocks == before.blocks
