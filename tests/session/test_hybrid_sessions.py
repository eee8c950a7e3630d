"""Hybrid models (attention and recurrent layers) and recurrent ones (Mamba-2) through
kvrt's sessions, on the suite's tiny random-weight fixtures (every hybrid layout the zoo
writes: Granite 4 and LFM2 with the attention layer in the middle or first, Nemotron-H's
attention without RoPE, Falcon-H1's attention beside a recurrent mixer in every layer):
every context kvrt labels exact gives logits bit for bit equal to computing it at once in
a fresh context, and the greedy continuation of ``llama_cpp.Llama`` itself — restored in
place, in a new session, after an edit in the middle, from disk after a restart and from
a Redis server in another runtime. (Churn on the engine contexts: ``test_churn``.)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, cast

import anyio
import msgspec
import numpy as np
import pytest

import kvrt
from kvrt import Segment
from kvrt.testing import zoo
from tests.support.models import llama_cpp_greedy, tiny, zoo_path
from tests.support.redis import RedisServer

HYBRIDS = [n for n, v in zoo.VARIANTS.items() if v.recurrent and v.architecture != "mamba2"]
WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "cache", "window", "block", "state"]


def segments(seed: int = 3, edit: int | None = None) -> list[Segment]:
    """A system prompt, four files of random words and a question (about 700 tokens);
    ``edit``: that file's text changed."""
    rng = random.Random(seed)
    files = [" ".join(rng.choice(WORDS) for _ in range(110)) for _ in range(4)]
    if edit is not None:
        files[edit] = "an edited file: " + files[edit]
    return [
        Segment("system", "You review code.", cache_class=kvrt.CacheClass.TASK_PINNED),
        *(Segment(f"file{i}", text) for i, text in enumerate(files)),
        Segment("user", "Which file is longest?"),
    ]


def fresh(
    engine: kvrt.backend.Engine, tokens: list[int], n: int = 8
) -> tuple[np.ndarray, list[int]]:
    """Logits after ``tokens`` computed at once in a fresh context, and its greedy tokens."""
    ctx = engine.open_context(len(tokens) + n + 8)
    try:
        logits = ctx.prefill(tokens).copy()
        return logits, cast(Any, ctx).generate(n, stop_at_end=False)
    finally:
        ctx.close()


def tokens_of(s: kvrt.Session) -> list[int]:
    """The session's logical context, read from its layout (for checks only)."""
    return [t for b in s._actor.window.blocks for t in b.tokens]


async def check(s: kvrt.Session, want: tuple[np.ndarray, list[int]]) -> None:
    logits = await s.next_logits()
    assert np.array_equal(logits, want[0]), f"max |Δlogit| {np.abs(logits - want[0]).max()}"
    got = (await s.generate(len(want[1]), stop_at_end=False)).tokens
    assert list(got) == want[1]


CONFIG = kvrt.Config(
    disk=kvrt.DiskConfig(budget=0),
    session=kvrt.SessionConfig(block_tokens=64, recent_tokens=64),
)


@pytest.mark.parametrize(
    ("name", "anyio_backend"),
    [(n, "trio") for n in HYBRIDS] + [("granitehybrid", "asyncio"), ("lfm2", "asyncio")],
)
async def test_a_hybrid_restores_exactly_across_sessions_and_edits(
    name: str, anyio_backend: str
) -> None:
    engine = tiny(name)
    assert engine.facts.recurrent == "hybrid" and engine.facts.checkpoint_bytes > 0
    assert any("recurrent" in kind for kind in engine.facts.layer_kinds)
    context = segments()
    async with kvrt.open_runtime(engine=engine, config=CONFIG) as rt:
        async with rt.open_session(hot_tokens=1024) as a:
            status = await a.ensure_context(context)
            assert status.exact and status.prefilled_tokens == status.logical_tokens
            tokens = tokens_of(a)
            want = fresh(engine, tokens)
            # llama.cpp's own greedy decoding of the same prompt: the independent reference
            assert llama_cpp_greedy(zoo_path(name), tokens, 8) == want[1]
            await check(a, want)
            # churn: a file in the middle leaves the window, comes back from cold in place
            await a.evict("file1")
            # what the model saw: the attention layers not the file, the recurrent state all
            report = a.explain()
            assert next(g for g in report.segments if g.name == "file1").hot_tokens == 0
            assert report.recurrent_seen_tokens == report.logical_tokens
            again = await a.ensure_context(context)
            assert again.exact and again.restored_tokens > 0
            await check(a, want)
            # an edit in the middle: the recurrent state goes back before it
            edited = segments(edit=2)
            status = await a.ensure_context(edited)
            assert status.exact and status.reused_tokens > 0
            await check(a, fresh(engine, tokens_of(a)))
        async with rt.open_session(hot_tokens=1024) as b:
            # a new session: the blocks come back with their checkpoints
            status = await b.ensure_context(context)
            assert status.exact and status.restored_tokens >= status.logical_tokens // 2
            await check(b, want)


@pytest.mark.parametrize("name", ["granitehybrid", "mamba2"])
@pytest.mark.parametrize(("tier", "anyio_backend"), [("disk", "trio"), ("remote", "asyncio")])
async def test_restored_exactly_from_disk_or_redis_in_another_runtime(
    redis_server: RedisServer, tmp_path: Path, name: str, tier: str, anyio_backend: str
) -> None:
    """The blocks and their checkpoints outlive the runtime: on disk (a restart) or on a
    real ``redis-server``; a second runtime, its RAM empty, restores the context from
    there bit-exactly."""
    engine = tiny(name)
    config = kvrt.Config(
        disk=kvrt.DiskConfig(path=str(tmp_path), budget=1 << 30 if tier == "disk" else 0),
        remote=kvrt.RemoteConfig(url=redis_server.url if tier == "remote" else None),
        session=kvrt.SessionConfig(block_tokens=64, recent_tokens=64),
    )
    context = segments(seed=5)
    async with (
        kvrt.open_runtime(engine=engine, config=config) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        await s.ensure_context(context)
        want = fresh(engine, tokens_of(s))
    async with (
        kvrt.open_runtime(engine=engine, config=config) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        status = await s.ensure_context(context)
        assert status.exact and status.restored_tokens > status.logical_tokens // 2
        assert any(tier in (b.choice or "") for b in s.explain().blocks)
        await check(s, want)


@pytest.mark.parametrize("anyio_backend", ["trio", "asyncio"])
async def test_a_recurrent_model_reuses_prefixes_exactly(anyio_backend: str) -> None:
    """Mamba-2 keeps no KV, only a state of one size that has integrated every token: no
    window to page, and a context sharing a prefix with one kvrt has seen restores the
    state after its last shared block and computes from there, bit for bit. Only the
    window's tail can leave it (a middle range is refused, naming why)."""
    engine = tiny("mamba2")
    facts = engine.facts
    assert facts.recurrent == "recurrent" and facts.kv_bytes_per_token == 0
    assert facts.checkpoint_bytes > 0 and set(facts.layer_kinds) == {"recurrent"}
    context = segments(seed=11)
    async with kvrt.open_runtime(engine=engine, config=CONFIG) as rt:
        assert rt.model_info.hot_context_tokens == facts.trained_context
        async with rt.open_session() as a:
            status = await a.ensure_context(context)
            assert status.exact and status.prefilled_tokens == status.logical_tokens
            tokens = tokens_of(a)
            want = fresh(engine, tokens)
            assert llama_cpp_greedy(zoo_path("mamba2"), tokens, 8) == want[1]
            await check(a, want)
            with pytest.raises(kvrt.InvalidRangeError, match="only the window's tail can leave"):
                await a.evict("file1")
            capabilities = a.explain().capabilities
            assert capabilities.recurrent and not capabilities.remove_middle
            # still usable: the generated tokens leave the tail (back to the checkpoint
            # kept after the prefill); the last token's logits are computed again from
            # the checkpoint after the block before it
            placed = await a.ensure_context(context)
            assert placed.exact and 0 < placed.prefilled_tokens < 64
            await check(a, want)
            edited = await a.ensure_context(segments(seed=11, edit=2))
            assert edited.exact and edited.reused_tokens > 0 and edited.prefilled_tokens > 0
            await check(a, fresh(engine, tokens_of(a)))
        async with rt.open_session() as b:
            status = await b.ensure_context(context)
            assert status.exact and status.restored_tokens == status.logical_tokens
            await check(b, want)
        async with rt.open_session(hot_tokens=256) as c:
            with pytest.raises(
                kvrt.ContextTooLargeError, match=r"planner context is 256.*pages nothing"
            ):
                await c.ensure_context(context)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_blocks_without_a_checkpoint_never_end_a_restored_context(
    anyio_backend: str,
) -> None:
    """Under ``kv_sized`` the fixture's volatile blocks (64 tokens of 256 KV bytes each,
    against a 39,756-byte checkpoint) carry none. A new session sending the same files
    with another question restores up to the last block that carries one (the system
    prompt's), computes the rest, and is exact."""
    engine = tiny("granitehybrid")
    config = kvrt.Config(
        disk=kvrt.DiskConfig(budget=0),
        session=kvrt.SessionConfig(block_tokens=64, recent_tokens=64),
        policies=kvrt.PolicyConfig(checkpoint="kv_sized", write_through="all"),
    )
    context = segments(seed=9)
    other = [*context[:-1], Segment("user", "Which file is shortest, and why?")]
    async with kvrt.open_runtime(engine=engine, config=config) as rt:
        async with rt.open_session(hot_tokens=1024) as a:
            await a.ensure_context(context)
        async with rt.open_session(hot_tokens=1024) as b:
            status = await b.ensure_context(other)
            assert status.exact
            system = len(engine.tokenize(context[0].text))
            assert 0 < status.restored_tokens <= max(system, 64)
            assert status.prefilled_tokens > 0
            await check(b, fresh(engine, tokens_of(b)))
        async with rt.open_session(hot_tokens=1024) as c:
            # the whole context: its last block carries its checkpoint, so every block
            # before it comes back too (their own states are replaced by the next one's)
            status = await c.ensure_context(context)
            assert status.exact and status.restored_tokens == status.logical_tokens
            await check(c, fresh(engine, tokens_of(c)))


@pytest.mark.parametrize("name", ["granitehybrid", "falcon-h1"])
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_an_edit_behind_a_gap_without_checkpoints_is_computed_exactly(
    name: str, anyio_backend: str
) -> None:
    """Under ``kv_sized`` the files' blocks carry no checkpoint. With a file in the middle
    evicted (a gap in the attention KV) an edit of the last file removes the window's
    tail: the state goes back to the system prompt's checkpoint, and the tokens after the
    gap cannot be computed from there (the state would skip the gap), so they leave too
    and are placed again. What the session then labels exact is bit for bit a fresh
    computation."""
    engine = tiny(name)
    config = msgspec.structs.replace(CONFIG, policies=kvrt.PolicyConfig(checkpoint="kv_sized"))
    async with (
        kvrt.open_runtime(engine=engine, config=config) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        await s.ensure_context(segments(seed=13))
        await s.evict("file1")
        status = await s.ensure_context(segments(seed=13, edit=3))
        assert status.exact
        await check(s, fresh(engine, tokens_of(s)))


@pytest.mark.parametrize("name", ["granitehybrid", "mamba2"])
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_whatever_a_random_agent_does_exact_means_a_fresh_computation(
    name: str, anyio_backend: str
) -> None:
    """Random contexts (pieces in and out, questions changing), evictions, admits,
    generation and cancelled calls, in a small window (granitehybrid: 192 tokens over
    16-token blocks, checkpoints only where ``kv_sized`` keeps them, so tails go back across
    gaps) or a whole one (Mamba-2, which pages nothing): after every ``ensure_context``
    labelled exact, the next logits are bit for bit a fresh context's."""
    from tests.support.fuzz import SMALL, canceller, one_op, random_context

    engine = tiny(name)
    hot = 192 if engine.facts.recurrent == "hybrid" else 1024
    config = kvrt.Config(
        disk=kvrt.DiskConfig(budget=0),
        session=kvrt.SessionConfig(**SMALL),
        policies=kvrt.PolicyConfig(checkpoint="kv_sized"),
    )
    rng = random.Random(f"hybrid-{name}")
    checked = 0
    async with (
        kvrt.open_runtime(engine=engine, config=config) as rt,
        rt.open_session(hot_tokens=hot) as s,
    ):
        current = random_context(rng)
        await s.ensure_context(current)
        for _ in range(60):
            if rng.random() < 0.2:
                with anyio.CancelScope() as scope:
                    s._actor.fault = canceller(s, scope, at=rng.randrange(8))
                    await one_op(s, rng, current)
                s._actor.fault = None
            else:
                await one_op(s, rng, current)
            status = await s.ensure_context(current)
            if status.exact:
                logits = await s.next_logits()
                want = fresh(engine, tokens_of(s), n=0)[0]
                assert np.array_equal(logits, want), np.abs(logits - want).max()
                checked += 1
            assert s.explain().consistent
    assert checked >= 30
