"""Runtime-driven retrieval: exact hits, approximate hits under policy, calibrated choices."""

from __future__ import annotations

import math

import anyio
import numpy as np
import pytest

import kvrt
from kvrt import Residency
from kvrt._paging.placement import LEADING_MIN_TOKENS
from kvrt.adapters.llama import LlamaEngine
from kvrt.backend import AdmitMode, EvictMode
from tests.support.models import (
    FILE_A,
    FILE_B,
    NO_DISK,
    REPO_MAP,
    SYSTEM,
    greedy,
    loaded,
    next_logits,
    tiny,
)
from tests.support.text import record_tokenized

pytestmark = [pytest.mark.anyio, pytest.mark.model]


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
    async with kvrt.open_runtime(engine=tiny(backend=backend)) as rt:
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

    # Allowed: restored from the cold copy with keys re-rotated, and labelled so. A fresh
    # runtime with no disk tier: the sessions above left exact copies of MOVED in their
    # cold store (RAM and disk) when they closed.
    async with (
        kvrt.open_runtime(engine=tiny(backend=backend), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024, approximate="allow") as s,
    ):
        await s.ensure_context(ORIGINAL)
        await s.evict("file:a.py")
        status = await s.ensure_context(MOVED)
        assert status.approximate_tokens == n_file
        assert status.restored_tokens == 0  # nothing here was an exact hit
        assert not status.exact and status.exact_restores  # the call, the capability
        n_after = len(rt.engine.tokenize("What does add_3 return?", add_special=False))
        assert status.approximate_context_tokens == n_file + n_after
        report = s.explain()
        moved = blocks_of(report, "file:a.py")
        assert all(b.approximate and b.residency is Residency.HOT for b in moved)
        assert all(
            b.choice is not None and b.choice.startswith("restored approximately") for b in moved
        )
        assert "re-rotated by +" in (moved[0].choice or "")
        assert all(b.approximate for b in blocks_of(report, "user"))  # computed after it
        assert not any(b.approximate for b in blocks_of(report, "file:b.py"))
        assert report.approximate_tokens == status.approximate_context_tokens
        assert report.cold_store.approximate_hits >= len(moved)

        # Approximate KV never enters the cold store.
        puts = s.explain().cold_store.puts
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
        assert again.exact
        assert not any(b.approximate for b in s.explain().blocks)
        assert await greedy(s, 16) == expected


async def test_approximate_restore_is_close_to_recompute(backend: str) -> None:
    """The label is honest: an approximate restore is near, not equal to, recomputing
    (the next token's argmax may differ)."""
    async with (
        kvrt.open_runtime(engine=tiny(backend=backend)) as rt,
        rt.open_session(hot_tokens=1024) as exact,
    ):
        # Kept open: a session that closes offers its blocks to the cold store, and MOVED's
        # would then be exact hits for the session below.
        await exact.ensure_context(MOVED)
        want = await next_logits(exact)
        async with rt.open_session(hot_tokens=1024, approximate="allow") as s:
            await s.ensure_context(ORIGINAL)
            await s.evict("file:a.py")
            status = await s.ensure_context(MOVED)
            assert status.approximate_tokens > 0
            got = await next_logits(s)
        delta = float(np.max(np.abs(got - want)))
        corr = float(np.corrcoef(got, want)[0, 1])
        print(
            f"{backend}: approximate vs recompute max |Δlogit| {delta:.3f}, correlation {corr:.4f}"
        )
        assert delta > 0.0  # not exact, as labelled
        assert corr > 0.95  # but close: the same tokens' KV, attended to another prefix


async def test_resent_earlier_turn_restores_every_cold_block_with_the_choice_shown() -> None:
    turn1 = ctx(("file:a.py", FILE_A), question="What does add_3 return?")
    turn2 = ctx(("file:b.py", FILE_B), question="What does mul_2 return?")
    async with kvrt.open_runtime(engine=loaded("llama")) as rt:
        async with rt.open_session(hot_tokens=512) as never:
            await never.ensure_context(turn1)
            expected = await greedy(never, 16)
        async with rt.open_session(hot_tokens=512, restore="calibrated") as s:
            await s.ensure_context(turn1)
            await greedy(s, 8)
            second = await s.ensure_context(turn2)
            assert second.evicted_tokens > 0
            third = await s.ensure_context(turn1)
            n_file = len(rt.engine.tokenize(FILE_A, add_special=False))
            n_question = len(rt.engine.tokenize("What does add_3 return?", add_special=False))
            # Every block that had gone cold came back; at most the last token is computed
            # again for its logits (a reply followed it, so none were kept for it), with
            # the one before it (never a one-token batch).
            assert third.prefilled_tokens <= 2
            assert third.restored_tokens == n_file + n_question
            report = s.explain()
            assert report.consistent, report.problems
            for name in ("file:a.py", "user"):
                for block in blocks_of(report, name):
                    assert block.residency is Residency.HOT
                    assert block.choice is not None
                    assert block.choice.startswith("restored from cold (est. ")
                    assert "to recompute" in block.choice
            calibrated = rt.policy("restore", "calibrated")
            restores, prefills = calibrated.observations
            assert restores >= 1 and prefills >= 1  # fitted from this session's own work
            assert await greedy(s, 16) == expected


def small_cold(n_bytes: int, wait: float) -> kvrt.Config:
    """A small RAM cold store and no disk tier: what is pinned is all a prefetch holds."""
    return kvrt.Config(
        memory=kvrt.MemoryConfig(cold=n_bytes),
        session=kvrt.SessionConfig(cold_wait=wait),
        disk=kvrt.DiskConfig(budget=0),
    )


async def test_prefetch_pins_blocks_through_pressure_and_can_be_cancelled(
    anyio_backend: str,
) -> None:
    a_ctx = ctx(("file:a.py", FILE_A), question="What does add_3 return?")
    b_ctx = ctx(("file:b.py", FILE_B), question="What does mul_2 return?")
    engine = tiny()  # a store of ~350 tokens: file:a.py's three blocks and little else
    store = small_cold(347 * engine.facts.kv_bytes_per_token, 0.2)
    async with kvrt.open_runtime(engine=engine, config=store) as rt:
        n_file = len(rt.engine.tokenize(FILE_A, add_special=False))
        async with rt.open_session(hot_tokens=1024) as s, rt.open_session(hot_tokens=1024) as t:
            await s.ensure_context(a_ctx)
            await s.evict("file:a.py")
            a_blocks = blocks_of(s.explain(), "file:a.py")  # 128 + 128 + 23 tokens
            assert [b.residency for b in a_blocks] == [Residency.COLD] * 3

            cancelled = s.prefetch(a_ctx)
            found = await cancelled.wait()
            assert found is not None and found.cold_blocks >= 3
            assert rt.cold_stats().pinned == found.cold_blocks
            cancelled.cancel()
            await anyio.sleep(0.05)
            assert rt.cold_stats().pinned == 0

            job = s.prefetch(a_ctx)
            report = await job.wait()
            assert report is not None
            # file:a.py's three blocks, and whatever of the system prompt and repo map (written
            # through when computed) the small store still holds
            assert report.cold_blocks >= 3 and report.cold_tokens >= n_file
            assert rt.cold_stats().pinned == report.cold_blocks

            # Another session's evictions need the room the pinned blocks take.
            await t.ensure_context(b_ctx)
            with pytest.raises(kvrt.ColdStoreFullError, match=r"stayed full for 0\.2 s"):
                await t.evict("file:b.py")
            assert {b.residency for b in blocks_of(t.explain(), "file:b.py")} == {Residency.HOT}
            assert rt.cold_stats().bytes <= rt.cold_stats().budget_bytes

            status = await s.ensure_context(a_ctx)
            assert status.restored_tokens == n_file and status.prefilled_tokens == 0
            assert rt.cold_stats().pinned == 0  # released once the call placed the context

            # Unpinned now: the other session's eviction goes through.
            assert await t.evict("file:b.py") > 0
            assert t.explain().consistent


async def test_a_prefetch_reaches_the_call_it_prepares_through_that_call(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetch's tokenizations ride in the next ensure_context's command: that call
    tokenizes nothing itself, even when it queues behind a running generate; a call made
    before the prefetch does not take them, and a prefetch not ready when its call begins
    is cancelled (its call tokenizes for itself)."""
    a_ctx = ctx(("file:a.py", FILE_A), question="What does add_3 return?")
    b_ctx = ctx(("file:b.py", FILE_B), question="What does mul_2 return?")
    async with (
        kvrt.open_runtime(engine=tiny()) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        calls = record_tokenized(monkeypatch, rt.engine)
        await s.ensure_context(a_ctx)
        await s.evict("file:a.py")
        await s.ensure_context(b_ctx)

        async with anyio.create_task_group() as tg:
            pieces = s.generate(max_tokens=24)  # the session is busy generating
            first = await anext(pieces)
            job = s.prefetch(a_ctx)
            report = await job.wait()
            assert report is not None and report.cold_blocks >= 3
            calls.clear()
            statuses: list[kvrt.ContextStatus] = []

            async def ensure() -> None:
                statuses.append(await s.ensure_context(a_ctx))

            tg.start_soon(ensure)  # queued behind the generation
            async for _ in pieces:
                pass
            assert first.index == 0
        assert calls == []  # every tokenization came with the command
        # Every block came back, the question's with the logits kept with it: nothing computed.
        assert statuses[0].restored_tokens > 0 and statuses[0].prefilled_tokens == 0
        assert rt.cold_stats().pinned == 0

        # The next call has no prefetch: it tokenizes for itself.
        await s.ensure_context(b_ctx)
        assert calls != []

        # A prefetch that is not ready when its call begins is cancelled, not waited for.
        calls.clear()
        job = s.prefetch(a_ctx)
        await s.ensure_context(a_ctx)
        assert await job.wait() is None or rt.cold_stats().pinned == 0
        assert rt.cold_stats().pinned == 0


async def test_file_whose_tail_changed_reuses_its_unchanged_leading_blocks() -> None:
    edited = FILE_A.replace("return a + b + 13", "return a - b - 13")  # its last function
    async with (
        kvrt.open_runtime(engine=tiny()) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        block = rt.config.session.block_tokens
        old = rt.engine.tokenize(FILE_A, add_special=False)
        new = rt.engine.tokenize(edited, add_special=False)
        same = 0  # whole leading blocks with the same tokens
        while (same + 1) * block <= min(len(old), len(new)) and (
            old[same * block : (same + 1) * block] == new[same * block : (same + 1) * block]
        ):
            same += 1
        assert 0 < same < len(new) // block + 1  # the edit is past the first block

        await s.ensure_context(ctx(("file:a.py", FILE_A), question="What does add_13 return?"))
        await s.evict("file:a.py")
        status = await s.ensure_context(ctx(("file:a.py", edited), question="And now?"))
        # The unchanged blocks come back, and the edited block's tokens before the edit.
        lead = next(i for i, (x, y) in enumerate(zip(old, new, strict=False)) if x != y)
        lead -= same * block
        lead = lead if lead >= LEADING_MIN_TOKENS else 0
        assert status.restored_tokens == same * block + lead
        choices = [b.choice for b in blocks_of(s.explain(), "file:a.py")]
        assert choices[:same] == ["restored from cold"] * same
        edited_first = (
            f"{lead} leading tokens restored from a cold block that diverges after them, "
            "the rest prefilled"
            if lead
            else "prefilled"
        )
        assert choices[same] == edited_first
        assert set(choices[same + 1 :]) <= {"prefilled"}


def test_a_blend_splices_the_restored_tail_after_the_recomputed_head(engine: LlamaEngine) -> None:
    """``admit(block, TAIL, skip=m)`` after computing the block's first ``m`` tokens: with
    the same prefix and the same batches as a never-evicting reference, the next token's
    logits are bit-identical (a splice at the wrong offset would not be); misuse refused."""
    tokens = engine.tokenize(SYSTEM + FILE_A, add_special=True)
    a, head, tail = tokens[:96], tokens[96:112], tokens[112:160]
    nxt = tokens[160]
    ref = engine.open_context(512)
    ctx = engine.open_context(512)
    try:
        for part, start in ((a, 0), (head, 96), (tail, 112)):
            ref.prefill(part, start=start)
            ctx.prefill(part, start=start)
        want = ref.step(nxt).copy()
        block = ctx.export(96, 160)
        ctx.evict(96, 160, EvictMode.GAP)
        with pytest.raises(kvrt.InvalidRangeError, match="not the block's first"):
            ctx.admit(block, AdmitMode.TAIL, skip=16)  # its head is not computed yet
        ctx.prefill(head, start=96)
        for bad in (-1, 64, 1.5, True):
            with pytest.raises(kvrt.InvalidRangeError, match="skip must be an integer"):
                ctx.admit(block, AdmitMode.TAIL, skip=bad)  # type: ignore[arg-type]
        with pytest.raises(kvrt.InvalidRangeError, match="at the tail only"):
            ctx.admit(block, AdmitMode.IN_PLACE, skip=16)
        assert ctx.admit(block, AdmitMode.TAIL, skip=16) == 96
        assert list(ctx.positions) == list(range(160))
        assert list(ctx.tokens) == tokens[:160]
        assert np.array_equal(ctx.step(nxt), want)
    finally:
        ref.close()
        ctx.close()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_blend_computes_the_first_tokens_after_the_changed_prefix_afresh(
    anyio_backend: str,
) -> None:
    """``approximate="blend:R"``: of the run of approximate hits after the changed prefix
    (a.py and the question, after b.py), the first ceil(R * n) tokens are computed and the
    rest restored; labelled and counted so. R = 1 computes everything."""
    got: dict[str, np.ndarray] = {}
    async with (
        kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024) as exact,
    ):
        n_file = len(rt.engine.tokenize(FILE_A, add_special=False))
        n_after = len(rt.engine.tokenize("What does add_3 return?", add_special=False))
        await exact.ensure_context(MOVED)
        want = await next_logits(exact)
    for policy, ratio in (("allow", 0.0), ("blend:0.5", 0.5), ("blend:1", 1.0)):
        # A runtime each: what one ratio computed exactly would be an exact hit for the next.
        async with (
            kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt,
            rt.open_session(hot_tokens=1024, approximate=policy) as s,
        ):
            await s.ensure_context(ORIGINAL)
            await s.evict("file:a.py")
            status = await s.ensure_context(MOVED)
            got[policy] = await next_logits(s)
            moved = blocks_of(s.explain(), "file:a.py")
            fresh = math.ceil(ratio * (n_file + n_after))
            assert status.approximate_tokens == max(0, n_file - fresh)
            run_start = moved[0].start
            for b in moved:
                head = max(0, min(b.n_tokens, run_start + fresh - b.start))
                if head == b.n_tokens:  # all of it computed, after fresh KV only
                    assert b.choice == "prefilled" and not b.approximate
                    continue
                assert b.approximate and b.residency is Residency.HOT
                label = f"first {head} tokens computed afresh"
                assert (label in (b.choice or "")) is (head > 0), b.choice
    for policy, logits in got.items():
        print(f"{policy}: max |Δlogit| vs recompute {float(np.max(np.abs(logits - want))):.3f}")
    assert float(np.max(np.abs(got["blend:1"] - want))) < 1e-3  # computed, like the reference
