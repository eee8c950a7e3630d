"""Contexts past the model's trained one (``long_context=True``), on the zoo's tiny llama
trained on 256 tokens, so "past it" is cheap: eight, sixteen times over in a second.

What is checked is the mechanism, never what the random-weight model answers: no position
the engine sees reaches the trained context; the window shown holds the sinks, the tail
and the block the query's rare words point at (nearest the query), computed afresh in it unless the session's
approximate-hit policy lets copies come back; every token shown away from where it was
computed is labelled approximate and the status never says exact; a follow-up computes
only what is new, and after a reply keeps the window it showed; copies spill to the disk tier within the RAM budget and come back from
it; a context past every budget, or a model that cannot shift positions, is refused
naming why; and a context that fits is placed bit for bit as without the setting.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import kvrt
from kvrt import Residency, Segment
from kvrt.policies.hot_eviction import KeyRelevance
from kvrt.policy import BlockView
from tests.support.fuzz import canceller
from tests.support.models import next_logits, zoo_path
from tests.support.text import record_tokenized

pytestmark = [pytest.mark.anyio, pytest.mark.model]

TRAINED = 256
SESSION = kvrt.SessionConfig(block_tokens=32, sink_tokens=4, recent_tokens=32)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. "
NEEDLE = "The violet walrus keeps quartz marbles in Helsinki. "
QUESTION = "Where does the violet walrus keep quartz marbles?"

_ENGINES: dict[str, kvrt.backend.Engine] = {}


def short_model(backend: str = "llama") -> kvrt.backend.Engine:
    """The zoo's llama trained on ``TRAINED`` tokens, loaded once."""
    if backend not in _ENGINES:
        flags = {"model": zoo_path("llama", context=TRAINED)}
        _ENGINES[backend] = kvrt.load_engine(backend, config=kvrt.load_config(flags=flags))
    return _ENGINES[backend]


@pytest.fixture(scope="module", autouse=True)
def _close_engines() -> object:
    yield
    while _ENGINES:
        _ENGINES.popitem()[1].close()


def config(**changes: object) -> kvrt.Config:
    disk = changes.pop("disk", kvrt.DiskConfig(budget=0))
    memory = changes.pop("memory", kvrt.MemoryConfig())
    return kvrt.Config(session=SESSION, disk=disk, memory=memory)  # type: ignore[arg-type]


@asynccontextmanager
async def long_session(
    cfg: kvrt.Config, approximate: str | None = None
) -> AsyncIterator[tuple[kvrt.Runtime, kvrt.Session]]:
    async with (
        kvrt.open_runtime(engine=short_model(), config=cfg) as rt,
        rt.open_session(hot_tokens=TRAINED, long_context=True, approximate=approximate) as session,
    ):
        yield rt, session


def haystack(fillers: int, needle_at: int | None = None) -> list[Segment]:
    """A document of ``fillers`` filler sentences (the needle after ``needle_at`` of
    them, as a segment of its own), then the question."""
    segments = [Segment("intro", "Read this and remember what matters. ")]
    if needle_at is None:
        segments.append(Segment("doc", FILLER * fillers))
    else:
        segments += [
            Segment("before", FILLER * needle_at),
            Segment("needle", NEEDLE),
            Segment("after", FILLER * (fillers - needle_at)),
        ]
    return [*segments, Segment("q", QUESTION)]


def shown_positions(session: kvrt.Session) -> int:
    """The end of the last position the session's window holds."""
    report = session.explain()
    return max(b.start + b.n_tokens for b in report.blocks if b.residency is Residency.HOT)


@pytest.mark.parametrize("backend", ["llama", "openvino"])
async def test_a_context_past_the_trained_one_is_shown_at_window_positions(
    backend: str,
) -> None:
    engine = short_model(backend)
    async with kvrt.open_runtime(engine=engine, config=config()) as rt:
        assert rt.model_info.model.trained_context == TRAINED
        async with rt.open_session(hot_tokens=TRAINED) as plain:
            with pytest.raises(kvrt.ContextTooLargeError, match="planner context"):
                await plain.ensure_context(haystack(100))
        long = rt.open_session(hot_tokens=TRAINED, long_context=True, approximate="allow")
        async with long as session:
            status = await session.ensure_context(haystack(120, needle_at=30))
            assert status.long is not None
            assert status.logical_tokens > 8 * TRAINED
            assert status.long.shown_tokens <= TRAINED
            assert status.long.computed_tokens >= status.logical_tokens
            assert status.long.windows > 8
            assert shown_positions(session) <= TRAINED
            # Shown away from where they were computed: approximate, and so is what follows.
            assert not status.exact
            assert status.approximate_tokens > 0
            assert status.approximate_context_tokens > 0
            assert "before" in status.invisible_segments
            assert "needle" not in status.invisible_segments  # its rare words are the query's
            hot = {b.segment for b in session.explain().blocks if b.residency is Residency.HOT}
            assert "needle" in hot and "q" in hot and "intro" in hot  # sinks, needle, tail
            # The most relevant block nearest the query: between the needle and the
            # question, only what follows it in the document (kept with it) and the tail
            # (the document's last blocks).
            order = [
                b.segment
                for b in sorted(session.explain().blocks, key=lambda b: b.start)
                if b.residency is Residency.HOT
            ]
            after = order[order.index("needle") + 1 : order.index("q")]
            run = 0
            while run < len(after) and after[run] == f"after#{run}":
                run += 1
            tail = after[run:]
            last = max(int(n.removeprefix("after#")) for n in hot if n.startswith("after#"))
            assert tail == [f"after#{k}" for k in range(last - len(tail) + 1, last + 1)]
            assert any(name.startswith("after#") for name in order[: order.index("needle")])
            # Generation continues at window positions too.
            reply = await session.generate(max_tokens=8, temperature=0)
            assert reply.usage.completion_tokens > 0
            assert shown_positions(session) <= TRAINED


async def test_the_window_shown_is_computed_afresh_unless_copies_are_allowed() -> None:
    """The blocks shown for the question come back as the session's approximate-hit
    policy says: ``never`` computes them afresh in the window, so nothing shown is
    approximate KV (the context is still a window of it: never exact); ``allow`` (a long
    session's default) restores their copies with keys turned, labelled approximate."""
    context = haystack(120, needle_at=30)
    async with long_session(config(), approximate="never") as (_, session):
        status = await session.ensure_context(context)
        assert status.long is not None and not status.exact
        assert status.approximate_context_tokens == 0  # (ingest windows restore copies)
        assert status.long.computed_tokens > status.logical_tokens  # ingest, then the window
        assert session.progress is None
        hot = [b for b in session.explain().blocks if b.residency is Residency.HOT]
        assert {b.segment for b in hot} >= {"intro", "needle", "q"}
        assert not any("approximately" in (b.choice or "") for b in hot)
    async with long_session(config()) as (_, session):
        allowed = await session.ensure_context(context)
        assert allowed.long is not None and not allowed.exact
        assert allowed.approximate_context_tokens > 0
        # Each block once, but those shorter than the policy's least (16 tokens).
        assert allowed.logical_tokens <= allowed.long.computed_tokens
        assert allowed.long.computed_tokens < status.long.computed_tokens
        assert allowed.long.shown_tokens == status.long.shown_tokens


async def test_an_arrangement_that_loses_a_block_is_refused_naming_the_policy() -> None:
    """A policy's ``arrange`` must give back every block it was given, once: one that
    drops a block is refused, never a window with a block silently missing."""

    class Dropping(KeyRelevance):
        def arrange(self, chosen: Sequence[BlockView]) -> list[int]:
            return super().arrange(chosen)[1:]

    kvrt.policy.register("hot_eviction", "dropping", Dropping)
    try:
        async with (
            kvrt.open_runtime(engine=short_model(), config=config()) as rt,
            rt.open_session(hot_tokens=TRAINED, long_context=True, hot_eviction="dropping") as s,
        ):
            with pytest.raises(kvrt.InvalidArgumentError, match=r"Dropping\.arrange"):
                await s.ensure_context(haystack(100, needle_at=60))
    finally:
        kvrt.policy.unregister("hot_eviction", "dropping")


async def test_a_follow_up_computes_only_what_is_new() -> None:
    async with long_session(config()) as (rt, session):
        first = await session.ensure_context(haystack(100, needle_at=60))
        assert first.long is not None
        more = [*haystack(100, needle_at=60), Segment("q2", " And who keeps them?")]
        second = await session.ensure_context(more)
        assert second.long is not None
        asked = len(rt.engine.tokenize(" And who keeps them?", add_special=False))
        assert second.long.computed_tokens == asked
        assert second.logical_tokens == first.logical_tokens + asked
        assert second.long.windows == 1
        assert "needle" not in second.invisible_segments


async def test_a_question_s_own_blocks_are_sketched_for_a_later_one_from_their_copies() -> None:
    """The blocks a question's window computes are not sketched on the way to its first
    token: the next context sketches them from their copies in RAM, before it computes
    anything new, and scores them as any other block."""
    async with long_session(config()) as (_, session):
        context = haystack(100, needle_at=60)
        await session.ensure_context(context)
        long = session._actor.contexts
        deferred = {k for k in long.copies if k not in long.sketches}
        assert deferred  # the question's own blocks
        more = [*context, Segment("more", FILLER * 40), Segment("q2", QUESTION)]
        await session.ensure_context(more)
        assert deferred <= set(long.copies)  # still in the context, now before the tail
        assert all(k in long.sketches for k in deferred)


async def test_a_follow_up_after_a_reply_keeps_the_window_and_the_document_s_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The question asked again after the answer: the blocks shown stay (the hold on
    near ties), so the reply's KV stays and only the new question is computed; and the
    document, sent again as it was, is not tokenized again."""
    async with long_session(config()) as (rt, session):
        context = haystack(100, needle_at=60)
        await session.ensure_context(context)
        shown = {b.segment for b in session.explain().blocks if b.residency is Residency.HOT}
        reply = await session.generate(max_tokens=8, temperature=0)
        again = len(rt.engine.tokenize("\n" + QUESTION, add_special=False))
        texts = record_tokenized(monkeypatch, rt.engine)
        asked = [*context, Segment("a", reply.text), Segment("q2", "\n" + QUESTION)]
        status = await session.ensure_context(asked)
        assert status.prefilled_tokens == again  # the reply's KV stayed where it was made
        assert status.approximate_tokens == 0  # nothing was laid out anew
        now = {b.segment for b in session.explain().blocks if b.residency is Residency.HOT}
        assert shown <= now
        assert not any(FILLER in t for t in texts)  # the document's tokens were kept


async def test_a_reply_shown_again_is_computed_in_one_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reply sent back after a window laid out anew is approximate KV whatever the cut:
    computed in one batch with what follows, not a token at a time as it was generated,
    and it still matches the blocks that hold it (the next turn computes only its own)."""
    async with long_session(config(), approximate="allow") as (rt, session):
        context = haystack(100, needle_at=60)
        await session.ensure_context(context)
        reply = await session.generate(max_tokens=8, temperature=0)
        steps = 0
        step = session._actor.ctx.step

        def counting(*args: object, **kwargs: object) -> object:
            nonlocal steps
            steps += 1
            return step(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(session._actor.ctx, "step", counting)
        asked = [*context, Segment("a", reply.text), Segment("q2", "\nWhere is the walrus?")]
        status = await session.ensure_context(asked)
        assert status.approximate_tokens > 0  # the window before the reply was laid anew
        assert status.prefilled_tokens >= reply.usage.completion_tokens  # so it was computed
        assert steps == 0  # in one batch
        more = [*asked[:-1], Segment("q2", "\nWhere is the walrus? Say")]
        again = await session.ensure_context(more)
        asked_again = len(rt.engine.tokenize(more[-1].text, add_special=False))
        assert again.prefilled_tokens <= asked_again  # the reply's blocks still match


async def test_a_context_that_fits_is_placed_as_without_the_setting() -> None:
    """The default stays exact: below the planner context nothing changes, to the bit."""
    context = haystack(8, needle_at=3)
    async with kvrt.open_runtime(engine=short_model(), config=config()) as rt:
        logits = []
        for long in (False, True):
            async with rt.open_session(hot_tokens=TRAINED, long_context=long) as session:
                status = await session.ensure_context(context)
                assert status.long is None and status.exact
                logits.append(await next_logits(session))
        assert np.array_equal(logits[0], logits[1])


async def test_contexts_below_the_trained_one_follow_the_session_s_own_policy() -> None:
    """Below the trained context a long session places as a plain one with its
    hot-eviction policy (``relevance``), to the bit, turn after turn: segments that move
    are computed again, not restored with turned keys (the window of a long context alone
    lets copies come back), and a context larger than the hot window is computed as
    without the setting."""
    apples, boats = Segment("a", "Notes on apples. " * 6), Segment("b", "Notes on boats. " * 6)
    turns = [
        (TRAINED, [apples, boats, Segment("q", QUESTION)]),
        (TRAINED, [boats, apples, Segment("q", QUESTION)]),  # both files moved
        (128, haystack(10, needle_at=3)),  # past the hot window, within the trained context
        (128, [*haystack(10, needle_at=3)[:-1], Segment("q", "Who keeps the marbles?")]),
    ]
    seen: dict[bool, list[tuple[object, ...]]] = {}
    for long in (False, True):
        async with kvrt.open_runtime(engine=short_model(), config=config()) as rt:
            for hot in (TRAINED, 128):
                opened = rt.open_session(
                    hot_tokens=hot, long_context=long, hot_eviction="relevance"
                )
                async with opened as session:
                    for want, context in turns:
                        if want != hot:
                            continue
                        status = await session.ensure_context(context)
                        assert status.long is None
                        counts = (status.prefilled_tokens, status.restored_tokens)
                        logits = await next_logits(session)
                        seen.setdefault(long, []).append(
                            (*counts, status.approximate_tokens, status.exact, logits.tobytes())
                        )
    assert seen[True] == seen[False]
    assert seen[False][1][2] == 0  # the moved files were not restored approximately


async def test_copies_spill_to_disk_within_the_ram_budget(tmp_path: Path) -> None:
    """A context whose KV is many times the RAM budget lives on the disk tier; a block
    asked for later comes back from there."""
    budget = 256 << 10
    cfg = config(
        disk=kvrt.DiskConfig(path=str(tmp_path), budget=64 << 20),
        memory=kvrt.MemoryConfig(cold=budget),
    )
    async with long_session(cfg) as (rt, session):
        status = await session.ensure_context(haystack(200, needle_at=20))
        assert status.dropped_tokens == 0
        stats = rt.cold_stats()
        assert stats.bytes <= budget and stats.disk is not None
        assert stats.disk.bytes > 2 * budget
        # The needle, computed early and pushed out of RAM since, comes back for a
        # question that points at it.
        status = await session.ensure_context(
            [*haystack(200, needle_at=20), Segment("q2", " Violet walrus quartz?")]
        )
        assert "needle" not in status.invisible_segments
        stats = rt.cold_stats()
        assert stats.disk is not None and stats.disk.hits > 0


async def test_a_context_past_every_budget_is_refused_naming_it() -> None:
    cfg = config(memory=kvrt.MemoryConfig(cold=1 << 20))
    async with long_session(cfg) as (_, session):
        with pytest.raises(kvrt.ContextTooLargeError, match=r"memory\.cold"):
            await session.ensure_context(haystack(400))
        status = await session.ensure_context(haystack(8))  # still usable
        assert status.exact


async def test_a_model_that_cannot_skip_its_state_refuses_long_context() -> None:
    flags = {"model": zoo_path("mamba2")}
    engine = kvrt.load_engine("llama", config=kvrt.load_config(flags=flags))
    try:
        async with kvrt.open_runtime(engine=engine, config=config()) as rt:
            with pytest.raises(kvrt.InvalidArgumentError, match="recurrent"):
                async with rt.open_session(long_context=True):
                    pass
            async with rt.open_session() as session:  # the runtime is still usable
                await session.ensure_context([Segment("a", "Hello there.")])
    finally:
        engine.close()


async def test_progress_is_reported_while_a_long_context_is_computed() -> None:
    async with long_session(config()) as (_, session):
        seen: list[tuple[int, int]] = []

        async def watch() -> None:
            while True:
                if (now := session.progress) is not None:
                    seen.append(now)
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            status = await session.ensure_context(haystack(120))
            tg.cancel_scope.cancel()
        assert session.progress is None
        assert status.long is not None
        assert all(0 <= done <= due for done, due in seen)
        # Every token to compute, then the window shown computed afresh added once chosen.
        assert seen[0][1] == status.logical_tokens
        assert {due for _, due in seen} <= {status.logical_tokens, status.long.computed_tokens}
        assert len({done for done, _ in seen}) > 4  # a figure a window


async def test_saving_a_long_context_is_refused_not_cut(tmp_path: Path) -> None:
    async with long_session(config()) as (_, session):
        await session.ensure_context(haystack(120))
        with pytest.raises(kvrt.InvalidArgumentError, match="long context"):
            await session.save(tmp_path / "saved.json")
        assert not (tmp_path / "saved.json").exists()
        await session.ensure_context(haystack(8))  # fits again: saved as any context
        await session.save(tmp_path / "saved.json")


async def test_a_cancelled_long_context_sent_again_is_as_if_never_cancelled() -> None:
    """Cancelled at await points spread over the windows of an ingest, the session stays
    consistent, and the same context sent again ends with the next logits, bit for bit,
    of a session never cancelled (each window is the same whatever was done before)."""
    context = haystack(120, needle_at=50)
    async with long_session(config()) as (_, session):
        points: list[str] = []
        session._actor.fault = points.append
        await session.ensure_context(context)
        session._actor.fault = None
        reference = await next_logits(session)
    assert len(points) > 50
    for k in range(3, len(points), len(points) // 4):
        async with long_session(config()) as (_, session):
            with anyio.CancelScope() as scope:
                session._actor.fault = canceller(session, scope, at=k)
                await session.ensure_context(context)
            session._actor.fault = None
            assert scope.cancelled_caught, k
            report = session.explain()
            assert report.consistent, report.problems
            status = await session.ensure_context(context)
            assert status.long is not None and not status.exact
            assert np.array_equal(await next_logits(session), reference), k
