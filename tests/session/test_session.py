"""Sessions on both engines, on asyncio and on trio: the zoo's tiny llama where the
property needs no real text, the embedded SmolLM2 where it does."""

from __future__ import annotations

import threading
from functools import partial

import anyio
import numpy as np
import pytest

import kvrt
import kvrt._engine.spare
from kvrt import Config, MemoryConfig, Residency
from kvrt._paging.placement import LEADING_MIN_TOKENS
from kvrt._session import context_tokens
from kvrt.adapters.llama import LlamaEngine
from tests.support.models import (
    FILE_A,
    FILE_B,
    NO_DISK,
    SYSTEM,
    context,
    greedy,
    llama_cpp_greedy,
    loaded,
    tiny,
)

pytestmark = [pytest.mark.anyio, pytest.mark.model]


@pytest.fixture(params=["llama", "openvino"])
def backend(request: pytest.FixtureRequest) -> str:
    """The engine-neutral session tests run on both engines."""
    return str(request.param)


async def test_resent_evicted_segment_is_restored_exactly(backend: str) -> None:
    ctx = context(("file:a.py", FILE_A), question="What does add_3 return?")
    async with (
        kvrt.open_runtime(engine=tiny(backend=backend)) as rt,
        rt.open_session(hot_tokens=1024) as never,
    ):
        await never.ensure_context(ctx)
        expected = await greedy(never, 24)
    # A fresh runtime with no disk tier: the session above left its blocks in the cold
    # store (RAM and disk) when it closed.
    async with (
        kvrt.open_runtime(engine=tiny(backend=backend), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        first = await s.ensure_context(ctx)
        assert first.prefilled_tokens == first.logical_tokens
        evicted = await s.evict("file:a.py")
        assert evicted > 0
        report = s.explain()
        assert report.recurrent_seen_tokens is None  # no recurrent layers
        assert {b.residency for b in report.blocks if b.segment == "file:a.py"} == {Residency.COLD}
        again = await s.ensure_context(ctx)
        assert again.restored_tokens == evicted
        assert again.prefilled_tokens == 0
        assert again.reused_tokens == first.logical_tokens - evicted
        assert {b.residency for b in s.explain().blocks} == {Residency.HOT}
        assert await greedy(s, 24) == expected


async def test_file_pushed_out_by_another_comes_back_from_cold(backend: str) -> None:
    async with (
        kvrt.open_runtime(engine=tiny(backend=backend)) as rt,
        rt.open_session(hot_tokens=512) as s,
    ):
        await s.ensure_context(context(("file:a.py", FILE_A), question="Explain add_1."))
        await greedy(s, 8)
        second = await s.ensure_context(context(("file:b.py", FILE_B), question="Explain mul_2."))
        assert second.evicted_tokens > 0  # a.py's blocks went to the cold store first
        question = "What does add_3 return?"
        third = await s.ensure_context(context(("file:a.py", FILE_A), question=question))
        n_file = len(rt.engine.tokenize(FILE_A, add_special=False))
        n_question = len(rt.engine.tokenize(question, add_special=False))
        assert third.restored_tokens == n_file
        assert third.prefilled_tokens == n_question  # nothing of a.py was computed again
        report = s.explain()
        assert report.consistent, report.problems
        assert report.cold_store.exact_hits >= 1
        got = await greedy(s, 16)
    async with (
        kvrt.open_runtime(engine=tiny(backend=backend)) as rt,
        rt.open_session(hot_tokens=512) as fresh,
    ):
        await fresh.ensure_context(context(("file:a.py", FILE_A), question=question))
        assert await greedy(fresh, 16) == got


async def test_greedy_output_equals_llama_cpp_python() -> None:
    async with kvrt.open_runtime(engine=loaded("llama")) as rt:
        prompt = rt.engine.apply_chat_template(
            [("system", SYSTEM), ("user", "Why is the sky blue?")]
        )
        async with rt.open_session(hot_tokens=1024) as s:
            await s.ensure_context([kvrt.Segment("chat", prompt, parse_special=True)])
            ours = await greedy(s, 40)
        tokens = rt.engine.tokenize(prompt, add_special=True, parse_special=True)
        path = rt.model_info.model.path
    assert ours == llama_cpp_greedy(path, tokens, 40)


async def test_generation_goes_past_the_hot_budget(backend: str) -> None:
    async with (
        kvrt.open_runtime(engine=tiny(backend=backend)) as rt,
        rt.open_session(hot_tokens=512) as s,
    ):
        status = await s.ensure_context(
            context(question="Write a long list of numbered review notes.")
        )
        peak = 0
        n = 0
        async for _piece in s.generate(480, stop_at_end=False):
            n += 1
            peak = max(peak, s.explain().hot_tokens)
        report = s.explain()
        assert n == 480
        assert peak <= 512 and report.hot_tokens <= 512
        assert report.logical_tokens == status.logical_tokens + 480 > 512
        assert report.counters.evicted_tokens > 0
        assert report.residency_tokens["cold"] > 0 and report.residency_tokens["dropped"] == 0
        assert report.consistent, report.problems
        # The sinks and the recent window stayed hot throughout.
        assert all(b.residency is Residency.HOT for b in report.blocks if b.protected)


async def test_two_sessions_share_one_model_and_cold_store(backend: str) -> None:
    ctx = context(("file:a.py", FILE_A), question="What does add_5 return?")
    async with (
        kvrt.open_runtime(engine=tiny(backend=backend)) as rt,
        rt.open_session(hot_tokens=1024, name="one") as one,
        rt.open_session(hot_tokens=1024, name="two") as two,
    ):
        await one.ensure_context(ctx)
        evicted = await one.evict("file:a.py")
        hits = rt.cold_stats().exact_hits
        status = await two.ensure_context(ctx)
        # file:a.py from one's eviction; the system prompt and repo map from one's
        # write-through (stable classes go to the cold store as soon as they are computed)
        choices = {b.segment: b.choice for b in two.explain().blocks}
        assert choices == {
            "system": "restored from cold",
            "repo_map": "restored from cold",
            "file:a.py": "restored from cold",
            "user": "prefilled",
        }
        assert status.restored_tokens > evicted > 0
        assert status.prefilled_tokens == status.logical_tokens - status.restored_tokens
        assert rt.cold_stats().exact_hits > hits
        await one.ensure_context(ctx)
        assert await greedy(one, 12) == await greedy(two, 12)


async def test_bad_input() -> None:
    """The session's own validation (llama.cpp alone: it does not depend on the engine)."""
    engine = tiny()
    per_token = engine.facts.kv_bytes_per_token
    small = Config(memory=MemoryConfig(cold=per_token * 512), disk=kvrt.DiskConfig(budget=0))
    async with kvrt.open_runtime(engine=engine, config=small) as rt:
        async with rt.open_session(hot_tokens=512) as s:
            assert s.explain().planner_context == 1024
            with pytest.raises(
                kvrt.ContextTooLargeError,
                match=r"needs \d+ tokens but the session's planner context is 1024 \(largest segment 'huge'",
            ):
                await s.ensure_context([kvrt.Segment("huge", FILE_A * 4)])
            with pytest.raises(kvrt.InvalidContextError, match="segment name 'x' appears twice"):
                await s.ensure_context([kvrt.Segment("x", "a"), kvrt.Segment("x", "b")])
            await s.ensure_context(context(question="Hello?"))
            with pytest.raises(
                kvrt.UnknownSegmentError,
                match=r"no segment named 'file:zz.py' in this session \(segments: system, repo_map, user\)",
            ):
                await s.evict("file:zz.py")
            with pytest.raises(kvrt.InvalidRangeError, match="holds the context's last token"):
                await s.evict("user")
            assert s.explain().consistent
        with pytest.raises(kvrt.SessionClosedError, match="is closed"):
            await s.ensure_context(context(question="Again?"))
        with pytest.raises(kvrt.ConfigError, match="hot_tokens must be between 512"):
            async with rt.open_session(hot_tokens=100):
                pass
    with pytest.raises(kvrt.ConfigError, match="the host cold budget is 0 bytes"):
        async with kvrt.open_runtime(engine=engine, config=Config(memory=MemoryConfig(cold=0))):
            pass
    with pytest.raises(
        kvrt.ConfigError,
        match=r"invalid policies\.hot_eviction: no hot_eviction policy named 'fifo'",
    ):
        async with kvrt.open_runtime(
            config=kvrt.load_config(env={}, flags={"hot_eviction": "fifo"})
        ):
            pass


async def test_next_logits_are_what_generation_draws_from() -> None:
    async with (
        kvrt.open_runtime(engine=loaded(), config=NO_DISK) as rt,
        rt.open_session() as s,
    ):
        with pytest.raises(kvrt.InvalidRangeError, match="ensure_context first"):
            await s.next_logits()
        await s.ensure_context([kvrt.Segment("user", "The capital of France is")])
        logits = await s.next_logits()
        assert logits.shape == (rt.model_info.model.n_vocab,) and logits.dtype == np.float32
        logits[:] = 0  # a copy: the session's own are untouched
        first = [p.token async for p in s.generate(1, stop_at_end=False)]
        again = await s.next_logits()  # after the generated token, computed by the step
        await s.ensure_context([kvrt.Segment("user", "The capital of France is")])
        assert int(np.argmax(await s.next_logits())) == first[0]
        assert not np.array_equal(again, await s.next_logits())


@pytest.mark.parametrize("edit", ["question", "file"])
async def test_a_context_diverging_inside_a_block_restores_the_tokens_it_shares(
    edit: str,
) -> None:
    """Another session's context that differs from a cold one only from some token on —
    a question reworded, a file edited in its middle — restores every token before the
    divergence (the block holding it comes back, its tokens after the divergence go) and
    computes only the rest; the next-token logits equal computing it all."""
    question = "What does add_3 return? Answer in one word."
    changed = FILE_A.replace("return a + b + 9", "return a - b + 9")
    first = context(("file:a.py", FILE_A), question=question)
    ctx = (
        context(("file:a.py", FILE_A), question="What does add_3 return? Answer in one line.")
        if edit == "question"
        else context(("file:a.py", changed), question=question)
    )
    async with kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt:  # the paths, not text
        async with rt.open_session() as a:
            await a.ensure_context(first)
        async with rt.open_session() as b:
            status = await b.ensure_context(ctx)
            got = await b.next_logits()
            report = b.explain()
        async with rt.open_session(restore="never") as fresh:  # computes everything
            computed = await fresh.ensure_context(ctx)
            want = await fresh.next_logits()
        old, new = context_tokens(rt.engine, first), context_tokens(rt.engine, ctx)
    shared = next(i for i, (x, y) in enumerate(zip(old, new, strict=False)) if x != y)
    block_start = max(b.start for b in report.blocks if b.start <= shared)
    assert shared - block_start >= LEADING_MIN_TOKENS  # the case under test: enough to keep
    assert computed.restored_tokens == 0 and computed.prefilled_tokens == len(new)
    assert status.restored_tokens == shared  # to the token, not to the last whole block
    assert status.prefilled_tokens == len(new) - shared
    assert status.exact and np.array_equal(got, want)
    choices = [b.choice or "" for b in report.blocks]
    assert sum("leading tokens restored" in c for c in choices) == 1


@pytest.mark.parametrize("backend", ["llama", "openvino"])
async def test_tokens_after_a_segment_replaced_in_place_are_computed_again(backend: str) -> None:
    """A file replaced by another of the same token length, which the cold store holds:
    it is restored in place, and what follows it — the same tokens at the same positions,
    but computed after the old file — is computed again, not reused: the logits equal a
    fresh computation of the new context (bit for bit on llama.cpp; on OpenVINO, whose
    logits depend on the batch cut, the greedy continuation)."""
    old = "alpha beta gamma delta " * 10
    new = "alpha beta gamma delta " * 9 + "alpha beta gamma theta "
    tail = [kvrt.Segment("b", FILE_B[:300]), kvrt.Segment("q", "What does mul_2 return?")]
    async with kvrt.open_runtime(engine=tiny(backend=backend), config=NO_DISK) as rt:
        tokenize = rt.engine.tokenize
        assert len(tokenize(old, add_special=False)) == len(tokenize(new, add_special=False))
        system = kvrt.Segment("system", SYSTEM)
        async with rt.open_session() as other:  # leaves the new file's block in the store
            await other.ensure_context([system, kvrt.Segment("f", new), tail[1]])
        ctx = [system, kvrt.Segment("f", new), *tail]
        async with rt.open_session() as s:
            await s.ensure_context([system, kvrt.Segment("f", old), *tail])
            status = await s.ensure_context(ctx)
            got, first = await s.next_logits(), await greedy(s, 8)
        async with rt.open_session(restore="never") as fresh:
            await fresh.ensure_context(ctx)
            want, reference = await fresh.next_logits(), await greedy(fresh, 8)
    n_tail = len(context_tokens(rt.engine, ctx)) - len(context_tokens(rt.engine, ctx[:2]))
    assert status.restored_tokens >= len(tokenize(new, add_special=False))
    assert status.prefilled_tokens >= n_tail  # nothing after the file was reused
    assert status.exact
    if backend == "llama":
        assert np.array_equal(got, want)
    assert first == reference


async def test_explain_is_a_snapshot_the_actor_publishes_between_commands() -> None:
    """``explain()`` never reads the engine context while a worker thread changes it: it
    returns what the actor published after its last command, and a report once returned
    never changes (its counters are copies)."""
    import anyio

    first = context(("file:a.py", FILE_A), question="Explain add_1.")
    longer = context(("file:a.py", FILE_A), ("file:b.py", FILE_B), question="Explain mul_2.")
    async with (
        kvrt.open_runtime(engine=loaded("llama"), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=2048) as s,
    ):
        await s.ensure_context(first)
        before = s.explain()
        computed = before.engine.prefill_tokens
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.ensure_context, longer)
            while s.explain().mailbox["in_flight"] == 0:
                await anyio.sleep(0.001)
            during = s.explain()  # the call is in flight, its prefill in a worker thread
        after = s.explain()
        assert during.consistent and during.logical_tokens == before.logical_tokens
        assert after.logical_tokens > before.logical_tokens
        assert after.engine.prefill_tokens > computed
        assert before.engine.prefill_tokens == computed  # the earlier report did not move
        assert before.counters.ensure_calls == 1 and after.counters.ensure_calls == 2


async def test_a_context_placed_while_its_session_closes_waits_for_the_copies(
    anyio_backend: str,
) -> None:
    """A conversation sent again while the session that holds it hot is closing (a server
    parking idle sessions, its next request already here): the closing session claims the
    blocks it will offer as its close begins, so the other session waits for those copies
    and restores them, reply included, computing only what is new, as it does once the
    close is over. The engine is held meanwhile: without the claim the blocks would not be
    in the store yet when the other session plans, and it would compute them."""
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name three rivers of France and where they rise."},
    ]

    async def converse(race: bool | None) -> tuple[kvrt.Completion, kvrt.Completion]:
        async with (
            kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt,
            rt.open_session() as a,
            rt.open_session() as b,
        ):
            reply = await a.chat(first, max_tokens=12)
            again = [*first, {"role": "assistant", "content": reply.text}]
            again.append({"role": "user", "content": "Which is longest?"})
            if race is None:  # never evicted: the session that generated the reply
                return reply, await a.chat(again, max_tokens=4, logprobs=2)
            if not race:
                await a.aclose()
                return reply, await b.chat(again, max_tokens=4, logprobs=2)
            held, release = anyio.Event(), threading.Event()

            def hold() -> None:
                anyio.from_thread.run_sync(held.set)
                release.wait()

            done: list[kvrt.Completion] = []

            async def second() -> None:
                done.append(await b.chat(again, max_tokens=4, logprobs=2))

            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(rt.engine_turns.run, None, "held by the test", hold))
                await held.wait()  # no engine call runs until released
                tg.start_soon(a.aclose)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(second)
                await anyio.wait_all_tasks_blocked()
                release.set()
            return reply, done[0]

    reply, got = await converse(race=True)
    same, want = await converse(race=False)
    assert reply.tokens == same.tokens and len(reply.tokens) > 4
    assert want.usage.restored_tokens > len(reply.tokens)  # the reply came back from cold
    assert got.usage.restored_tokens == want.usage.restored_tokens, got.usage
    assert got.usage.prefilled_tokens == want.usage.prefilled_tokens, got.usage
    assert got.context.exact and want.context.exact
    assert got.logprobs == want.logprobs and got.text == want.text
    _, live = await converse(race=None)  # and what never left the generating session
    assert got.logprobs == live.logprobs and got.text == live.text


async def test_the_engine_frees_its_spare_context_once_no_session_opens_for_a_while(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The context a closed session leaves for the next one is kept while sessions come
    and go, and freed once the runtime has had none open for ``SPARE_SECONDS``."""
    monkeypatch.setattr(kvrt._engine.spare, "SPARE_SECONDS", 0.2)
    engine = tiny()
    assert isinstance(engine, LlamaEngine)
    engine.release_spare()  # whatever an earlier test left
    async with kvrt.open_runtime(engine=engine, config=NO_DISK) as rt:
        async with rt.open_session() as s:
            await s.ensure_context([kvrt.Segment("user", "Hello there.")])
        assert engine.holds_spare
        async with rt.open_session() as s:  # within the wait: it starts in the spare
            assert not engine.holds_spare
            await anyio.sleep(0.4)  # a session open all along: nothing to free
        assert engine.holds_spare
        with anyio.fail_after(10):
            while engine.holds_spare:
                await anyio.sleep(0.02)
        async with rt.open_session() as s:  # and sessions still open after it
            await s.ensure_context([kvrt.Segment("user", "Hello again.")])
    engine.release_spare()
