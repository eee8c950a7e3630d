"""Cold admission and restore-vs-recompute policies, chosen per session, on the real engine
(llama.cpp running the zoo's tiny llama: the policies' paths need no real text)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

import kvrt
import kvrt.policy
from kvrt import Config, Residency
from tests.support.models import FILE_A, FILE_B, NO_DISK, SYSTEM, greedy, tiny

pytestmark = pytest.mark.anyio

NOTE = "Note: prefer small functions."  # a few tokens: a small volatile segment


def context(question: str) -> list[kvrt.Segment]:
    return [
        kvrt.Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
        kvrt.Segment("note", NOTE),
        kvrt.Segment("file:a.py", FILE_A),
        kvrt.Segment("user", question),
    ]


def by_segment(report: kvrt.SessionReport, name: str) -> list[kvrt.BlockReport]:
    return [b for b in report.blocks if b.segment == name]


async def test_small_volatile_blocks_keep_tokens_only() -> None:
    ctx = context("What does add_2 return?")
    async with (
        kvrt.open_runtime(engine=tiny()) as rt,
        rt.open_session(hot_tokens=1024, cold_admission="skip_small_volatile") as s,
    ):
        await s.ensure_context(ctx)
        await s.evict("note")
        await s.evict("file:a.py")
        report = s.explain()
        assert {b.residency for b in by_segment(report, "note")} == {Residency.DROPPED}
        assert {b.choice for b in by_segment(report, "note")} == {
            "evicted, tokens only (cold admission policy)"
        }
        big = [b for b in by_segment(report, "file:a.py") if b.n_tokens >= 32]
        assert big and {b.residency for b in big} == {Residency.COLD}
        status = await s.ensure_context(ctx)
        n_note = len(rt.engine.tokenize(NOTE, add_special=False))
        assert status.prefilled_tokens >= n_note  # the note is computed again
        assert status.restored_tokens > 0
        assert s.explain().consistent


async def test_restore_policy_can_choose_to_recompute(anyio_backend: str) -> None:
    ctx = context("What does add_4 return?")
    async with kvrt.open_runtime(engine=tiny()) as rt:
        async with rt.open_session(hot_tokens=1024) as never:
            await never.ensure_context(ctx)
            expected = await greedy(never, 12)
        async with rt.open_session(hot_tokens=1024, restore="size_threshold") as s:
            await s.ensure_context(ctx)
            await s.evict("note")
            n_note = len(rt.engine.tokenize(NOTE, add_special=False))
            assert n_note < policies_min_tokens()
            status = await s.ensure_context(ctx)
            report = s.explain()
            assert {b.choice for b in by_segment(report, "note")} == {"recomputed (restore policy)"}
            assert status.prefilled_tokens >= n_note
            # Recomputing after the same prefix gives the same KV: the same continuation.
            assert await greedy(s, 12) == expected


def policies_min_tokens() -> int:
    from kvrt import policies

    return int(policies.get("restore", "size_threshold").min_tokens)


async def test_explain_shows_each_blocks_last_choice() -> None:
    ctx = context("Which function adds 7?")
    async with kvrt.open_runtime(engine=tiny()) as rt, rt.open_session(hot_tokens=1024) as s:
        await s.ensure_context(ctx)
        assert {b.choice for b in s.explain().blocks} == {"prefilled"}
        await s.evict("file:a.py")
        assert {b.choice for b in by_segment(s.explain(), "file:a.py")} == {"evicted to cold"}
        await s.ensure_context(ctx)
        assert {b.choice for b in by_segment(s.explain(), "file:a.py")} == {"restored from cold"}


async def test_unknown_policy_names() -> None:
    async with kvrt.open_runtime(engine=tiny()) as rt:
        with pytest.raises(
            kvrt.ConfigError,
            match=r"no restore policy named 'sometimes' \(known: always, calibrated, never, size_threshold\)",
        ):
            async with rt.open_session(hot_tokens=512, restore="sometimes"):
                pass


async def test_score_lru_evicts_the_lowest_score_first(anyio_backend: str) -> None:
    def ctx(score_a: float, score_b: float) -> list[kvrt.Segment]:
        return [
            kvrt.Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
            kvrt.Segment("file:a.py", FILE_A, score=score_a),
            kvrt.Segment("file:b.py", FILE_B, score=score_b),
            kvrt.Segment("user", "Which file defines mul_3?"),
        ]

    def evicted(report: kvrt.SessionReport) -> set[str]:
        return {b.segment for b in report.blocks if b.residency is not Residency.HOT}

    async with kvrt.open_runtime(engine=tiny()) as rt:
        async with rt.open_session(hot_tokens=512) as by_age:
            await by_age.ensure_context(ctx(5.0, 1.0))
            assert evicted(by_age.explain()) == {"file:a.py"}  # equal class and age: earliest
        async with rt.open_session(hot_tokens=512, hot_eviction="score_lru") as by_score:
            await by_score.ensure_context(ctx(5.0, 1.0))
            assert evicted(by_score.explain()) == {"file:b.py"}  # the lower score goes first
            await by_score.ensure_context(ctx(1.0, 5.0))  # the caller's scores changed
            assert evicted(by_score.explain()) == {"file:a.py"}


class NewestFirst:
    """A user's own hot-eviction policy: the most recently used block leaves first."""

    instances = 0

    def __init__(self) -> None:
        NewestFirst.instances += 1
        self.calls = 0

    def order(self, candidates: Sequence[kvrt.policy.BlockView]) -> list[int]:
        self.calls += 1
        return [b.id for b in sorted(candidates, key=lambda b: (-b.last_used, -b.start))]


class NotAPolicy:
    pass


@pytest.fixture
def own_policies() -> Iterator[None]:
    kvrt.policy.register("hot_eviction", "newest_first", NewestFirst)
    kvrt.policy.register("restore", "not_a_policy", NotAPolicy)
    yield
    kvrt.policy.unregister("hot_eviction", "newest_first")
    kvrt.policy.unregister("restore", "not_a_policy")


async def test_a_policy_of_ones_own_plugs_in_by_name(
    anyio_backend: str, own_policies: None
) -> None:
    ctx = context("Which function adds 7?")
    assert "newest_first" in kvrt.policy.names("hot_eviction")
    assert isinstance(NewestFirst(), kvrt.policy.HotEviction)
    by_config = Config(policies=kvrt.PolicyConfig(hot_eviction="newest_first"))
    async with kvrt.open_runtime(engine=tiny(), config=by_config) as rt:
        mine = rt.policy("hot_eviction")
        assert isinstance(mine, NewestFirst)
        async with rt.open_session(hot_tokens=512) as s:
            await s.ensure_context(ctx)
            assert mine.calls > 0
            assert s.explain().consistent
    async with kvrt.open_runtime(engine=tiny()) as rt:
        async with rt.open_session(hot_tokens=512, hot_eviction="newest_first") as s:
            await s.ensure_context(ctx)
            assert rt.policy("hot_eviction", "newest_first").calls > 0
        with pytest.raises(
            kvrt.ConfigError,
            match=r"the restore policy 'not_a_policy' does not implement kvrt\.policy\.Restore",
        ):
            async with rt.open_session(hot_tokens=512, restore="not_a_policy"):
                pass
    with pytest.raises(kvrt.ConfigError, match="already registered"):
        kvrt.policy.register("hot_eviction", "newest_first", NewestFirst)
    with pytest.raises(kvrt.ConfigError, match="unknown policy kind 'hot'"):
        kvrt.policy.register("hot", "x", NewestFirst)


@pytest.mark.parametrize(
    ("through", "written"), [("stable", {"system"}), ("none", set()), ("all", None)]
)
async def test_the_write_through_policy_picks_what_is_copied_once_computed(
    through: str, written: set[str] | None
) -> None:
    """Blocks leave nothing in the cold store until evicted, except those the policy
    writes through: by default the system prompt (task_pinned), also files with ``all``."""
    ctx = [
        kvrt.Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
        kvrt.Segment("file:a.py", FILE_A[:200]),
        kvrt.Segment("user", "What does add_2 return?"),
    ]
    async with (
        kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024, write_through=through) as s,
    ):
        await s.ensure_context(ctx)
        blocks = s.explain().blocks
        picked = [b for b in blocks if written is None or b.segment in written]
        assert rt.cold_stats().entries == len(picked)  # copies of hot blocks, nothing else


@pytest.mark.parametrize(
    ("chosen", "system_class"), [(None, "task_pinned"), ("volatile", "volatile")]
)
async def test_the_message_class_policy_classes_chat_messages_by_role(
    chosen: str | None, system_class: str
) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    async with (
        kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt,
        rt.open_session(message_class=chosen) as s,
    ):
        await s.chat(messages, max_tokens=1)
        classes = {b.segment: b.cache_class for b in s.explain().blocks}
        assert classes["0:system"] == system_class
        assert classes["1:user"] == "volatile"
