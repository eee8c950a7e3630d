"""Runtime-driven retrieval: exact hits, approximate hits under policy, calibrated choices."""

from __future__ import annotations

import numpy as np
import pytest

import kvrt
from kvrt import Residency

from ._agent import FILE_A, FILE_B, REPO_MAP, SYSTEM, greedy

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["llama", "openvino"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def ctx(*files: tuple[str, str], question: str) -> list[kvrt.Segment]:
    return [
        kvrt.Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
        kvrt.Segment("repo_map", REPO_MAP, cache_class=kvrt.CacheClass.REPO_MAP),
        *(kvrt.Segment(name, text) for name, text in files),
        kvrt.Segment("user", question),
    ]


def blocks_of(report: kvrt.SessionReport, name: str) -> list[kvrt.BlockReport]:
    return [b for b in report.blocks if b.segment == name]


ORIGINAL = ctx(("file:a.py", FILE_A), question="What does add_3 return?")
MOVED = ctx(("file:b.py", FILE_B), ("file:a.py", FILE_A), question="What does add_3 return?")


async def test_approximate_hit_refused_by_default_and_labelled_when_allowed(backend: str) -> None:
    async with kvrt.open_runtime(backend) as rt:
        n_file = len(rt.engine.tokenize(FILE_A, add_special=False))
        async with rt.open_session(hot_tokens=1024) as never:
            await never.ensure_context(ORIGINAL)
            expected = await greedy(never, 16)

        # Default policy: a.py after another file is a different context; it is computed.
        async with rt.open_session(hot_tokens=1024) as s:
            await s.ensure_context(ORIGINAL)
            await s.evict("file:a.py")
            status = await s.ensure_context(MOVED)
            assert status.approximate_tokens == 0
            assert status.approximate_context_tokens == 0
            report = s.explain()
            assert {b.choice for b in blocks_of(report, "file:a.py")} == {"prefilled"}
            assert not any(b.approximate for b in report.blocks)
            assert report.cold_store.approximate_hits == 0

        # Allowed: restored from the cold copy with keys re-rotated, and labelled so.
        async with rt.open_session(hot_tokens=1024, approximate="allow") as s:
            await s.ensure_context(ORIGINAL)
            await s.evict("file:a.py")
            puts = s.explain().cold_store.puts
            status = await s.ensure_context(MOVED)
            assert status.approximate_tokens == n_file
            assert status.restored_tokens == 0  # nothing here was an exact hit
            n_after = len(rt.engine.tokenize("What does add_3 return?", add_special=False))
            assert status.approximate_context_tokens == n_file + n_after
            report = s.explain()
            moved = blocks_of(report, "file:a.py")
            assert all(b.approximate and b.residency is Residency.HOT for b in moved)
            assert all(
                b.choice is not None and b.choice.startswith("restored approximately")
                for b in moved
            )
            assert "re-rotated by +" in (moved[0].choice or "")
            assert all(b.approximate for b in blocks_of(report, "user"))  # computed after it
            assert not any(b.approximate for b in blocks_of(report, "file:b.py"))
            assert report.approximate_tokens == status.approximate_context_tokens
            assert report.cold_store.approximate_hits >= len(moved)

            # Approximate KV never enters the cold store.
            await s.evict("file:a.py")
            report = s.explain()
            assert report.cold_store.puts == puts
            assert {b.choice for b in blocks_of(report, "file:a.py")} == {
                "evicted, tokens only (approximate KV is never stored)"
            }

            # Back to the original context: the exact cold copy comes back, nothing tainted.
            again = await s.ensure_context(ORIGINAL)
            assert again.restored_tokens == n_file + n_after  # the old question went cold too
            assert again.prefilled_tokens == 0
            assert again.approximate_tokens == again.approximate_context_tokens == 0
            assert not any(b.approximate for b in s.explain().blocks)
            assert await greedy(s, 16) == expected


async def test_approximate_restore_is_close_to_recompute(backend: str) -> None:
    """The label is honest: an approximate restore is near, not equal to, recomputing
    (the next token's argmax may differ)."""
    async with kvrt.open_runtime(backend) as rt:
        async with rt.open_session(hot_tokens=1024) as exact:
            await exact.ensure_context(MOVED)
            want = await exact._actor._engine("logits", exact._actor.ctx.logits)
        async with rt.open_session(hot_tokens=1024, approximate="allow") as s:
            await s.ensure_context(ORIGINAL)
            await s.evict("file:a.py")
            status = await s.ensure_context(MOVED)
            assert status.approximate_tokens > 0
            got = await s._actor._engine("logits", s._actor.ctx.logits)
        delta = float(np.max(np.abs(got - want)))
        corr = float(np.corrcoef(got, want)[0, 1])
        print(
            f"{backend}: approximate vs recompute max |Δlogit| {delta:.3f}, correlation {corr:.4f}"
        )
        assert delta > 0.0  # not exact, as labelled
        assert corr > 0.95  # but close: the same tokens' KV, attended to another prefix
