"""KV computed under a partial window is never served as exact, on either engine.

A block computed while earlier blocks of its context were out of the hot window attended
to less than its key promises. Such KV stays with the session that computed it (labelled,
kept in RAM under a key of its own), and is computed again once its whole prefix fits.
Every claim is checked against the same tokens computed afresh without eviction: next-token
logits bit for bit, greedy tokens equal. Engines give other bits for other batch cuts
(OpenVINO always; llama.cpp for one-token batches on CPUs without AVX-512), so each
reference computes the tokens in the pieces the session did: the exact prefix it restored
as the session that computed it did (at once), then what it computed itself (at once).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import pytest

import kvrt
from kvrt import Residency, Segment
from kvrt._paging.tokens import context_tokens
from tests.support.models import NO_DISK, loaded, next_logits, tiny, zoo_path
from tests.support.partial import (
    SYSTEM,
    WORDS,
    check_exact,
    files_context,
    in_pieces,
    partial_blocks,
)
from tests.support.redis import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.model]


@pytest.fixture(scope="module", params=["llama", "openvino"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def model_for(backend: str) -> kvrt.backend.Engine:
    """The zoo's tiny llama on either engine: what is checked needs no real text (every
    architecture's turn is in test_architectures)."""
    return tiny(backend=backend)


def model_file(backend: str) -> str:
    """The model a child process opens for ``backend``."""
    return zoo_path("llama")


async def reference(
    engine: kvrt.backend.Engine, segments: list[Segment], n: int = 8
) -> tuple[np.ndarray, list[int]]:
    """A session that never evicts, in a runtime whose cold store starts empty: its
    next-token logits and greedy continuation."""
    async with (
        kvrt.open_runtime(engine=engine, config=NO_DISK) as rt,
        rt.open_session(hot_tokens=2048) as s,
    ):
        status = await s.ensure_context(segments)
        assert status.prefilled_tokens == status.logical_tokens and status.exact
        logits = await next_logits(s)
        tokens = (await s.generate(n, stop_at_end=False)).tokens
    return logits, list(tokens)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_another_session_gets_exact_kv_not_the_partial_window(
    backend: str, anyio_backend: str
) -> None:
    """The issue's case: a 512-token window computes an 800-token context, a 2048-token
    one gets the same context. What the first computed with its whole prefix hot (its
    first batch, before anything was evicted) comes back; the rest is computed again."""
    engine = model_for(backend)
    context = files_context()
    fresh = await reference(engine, context)
    async with kvrt.open_runtime(engine=engine, config=NO_DISK) as rt:
        async with rt.open_session(hot_tokens=512) as small:
            status = await small.ensure_context(context)
            assert status.logical_tokens > 700 and status.evicted_tokens > 0
            # What was computed while the first file was out of the window is labelled.
            assert not status.exact and status.partial_window_tokens > 0
            report = small.explain()
            assert report.partial_window_tokens == status.partial_window_tokens
            labelled = partial_blocks(report)
            assert labelled and all("partial" in (b.choice or "") for b in labelled)
            assert any("under a partial window" in (b.choice or "") for b in labelled)
            assert {b.segment for b in labelled} >= {"user"}  # the context's end saw least
            exact_end = min(b.start for b in labelled)  # the first batch: [0, exact_end)
            # Its own blocks: re-sent, the session restores its partial-window copies and
            # still says so.
            again = await small.ensure_context(context)
            assert not again.exact and again.partial_window_tokens > 0
        stats = rt.cold_stats()
        async with rt.open_session(hot_tokens=2048) as big:
            status = await big.ensure_context(context)
            # The blocks computed with their whole prefix are restored; the others are
            # computed afresh, never taken from the small session's partial-window copies.
            assert status.restored_tokens == exact_end
            assert status.prefilled_tokens == status.logical_tokens - exact_end
            assert status.exact and status.partial_window_tokens == 0
            assert not partial_blocks(big.explain())
            want = in_pieces(engine, context, [exact_end])
            assert want[1] == fresh[1]  # the same continuation as computing it all at once
            await check_exact(big, want)
        assert rt.cold_stats().exact_hits > stats.exact_hits


SMALL_BLOCKS = {"KVRT_BLOCK_TOKENS": "64", "KVRT_RECENT_TOKENS": "64"}
"""Blocks of 64 tokens: a 256-token window under a 420-token context, half the work."""

CHILD = """
import anyio, json, sys, kvrt
from tests.support.partial import files_context

async def main():
    async with kvrt.open_runtime(sys.argv[1], model=sys.argv[3] or None) as rt:
        async with rt.open_session(hot_tokens=256) as s:
            status = await s.ensure_context(files_context(words=130))
            saved = await s.save(sys.argv[2])
        print(json.dumps({"exact": status.exact, "partial": status.partial_window_tokens,
                          "on_disk": saved.on_disk, "blocks": len(saved.blocks),
                          "pending": rt.cold_stats().pending_writes}))

anyio.run(main)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_disk_redis_and_resume_hold_only_exact_kv(
    backend: str,
    redis_server: RedisServer,
    tmp_path: Path,
    anyio_backend: str,
) -> None:
    """A process computes the context under a partial window with the disk and Redis
    tiers on, saves the session and exits; later processes get the context from disk,
    from Redis and by ``resume=``: exact, or labelled not exact where the window is small."""
    import anyio

    engine = model_for(backend)
    context = files_context(words=130)
    disk = tmp_path / "blocks"
    saved = tmp_path / "agent.json"
    env = {k: v for k, v in os.environ.items() if k != "KVRT_CACHE_DIR"}  # the built IR
    env.update(KVRT_DISK_PATH=str(disk), KVRT_DISK_BUDGET="1GiB", KVRT_REMOTE_URL=redis_server.url)
    env.update(SMALL_BLOCKS)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = await anyio.run_process(
        [sys.executable, "-c", CHILD, backend, str(saved), model_file(backend)],
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    child = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert not child["exact"] and child["partial"] > 0
    # Only blocks computed with their whole prefix reached the tiers below RAM.
    assert 0 < child["on_disk"] < child["blocks"]

    def on_disk(copy: str) -> kvrt.Config:
        """A runtime on a copy of the folder the child left (each check starts from it)."""
        folder = tmp_path / copy
        shutil.copytree(disk, folder)
        flags = {"disk.path": str(folder), "disk.budget": "1GiB"}
        return kvrt.load_config(env=SMALL_BLOCKS, flags=flags)

    async with (
        kvrt.open_runtime(engine=engine, config=on_disk("small")) as rt,
        rt.open_session(resume=saved) as s,  # the saved window: 256 tokens
    ):
        assert s.resumed is not None and not s.resumed.exact
        assert s.resumed.partial_window_tokens > 0
    async with (
        kvrt.open_runtime(engine=engine, config=on_disk("resumed")) as rt,
        rt.open_session(resume=saved, hot_tokens=1024) as s,
    ):
        resumed = s.resumed
        assert resumed is not None and resumed.exact
        assert 0 < resumed.restored_tokens < resumed.logical_tokens
        assert any("(disk)" in (b.choice or "") for b in s.explain().blocks)
        want = in_pieces(engine, context, [resumed.restored_tokens])
        await check_exact(s, want)
    async with (
        kvrt.open_runtime(engine=engine, config=on_disk("restarted")) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        status = await s.ensure_context(context)
        assert status.restored_tokens == resumed.restored_tokens and status.exact
        await check_exact(s, want)

    remote = kvrt.load_config(
        env=SMALL_BLOCKS, flags={"remote.url": redis_server.url, "disk.budget": "0"}
    )
    async with (
        kvrt.open_runtime(engine=engine, config=remote) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        status = await s.ensure_context(context)
        assert status.restored_tokens == resumed.restored_tokens and status.exact
        assert any("(remote)" in (b.choice or "") for b in s.explain().blocks)
        await check_exact(s, want)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_session_whose_context_later_fits_is_exact_again(
    backend: str, anyio_backend: str
) -> None:
    """A reply generated while a file was evicted saw a partial window; once the context
    fits again, the default policy computes it again (exact), ``keep`` keeps it (labelled)."""
    engine = loaded(backend)  # a real reply: its text must tokenize back to its tokens
    head = files_context(seed=3, n_files=1, words=120)
    for policy in ("recompute", "keep"):
        async with (
            kvrt.open_runtime(engine=engine, config=NO_DISK) as rt,
            rt.open_session(hot_tokens=1024, partial_window=policy) as s,
        ):
            await s.ensure_context(head)
            await s.evict("file0")
            done = await s.generate(6, stop_at_end=False)
            assert not done.context.exact and done.context.partial_window_tokens > 0
            reply = next(b for b in s.explain().blocks if b.segment == "assistant")
            assert reply.partial_window and reply.residency is Residency.HOT
            # The reply, sent back as text, is the same tokens (checked), so the session
            # keeps it in place.
            assert engine.tokenize(done.text, add_special=False) == list(done.tokens)
            full = [*head, Segment("assistant", done.text), Segment("next", " Why?")]
            status = await s.ensure_context(full)
            blocks = {b.segment: b for b in s.explain().blocks}
            if policy == "recompute":
                assert status.exact and status.partial_window_tokens == 0
                assert "partial-window KV was replaced" in (blocks["assistant"].choice or "")
                assert status.restored_tokens > 0  # the file came back from cold
                # As a session that never evicted: the head at once, the reply one token
                # at a time (as it was generated, and as it is computed again), the rest.
                n_head = len(context_tokens(engine, head))
                alone = list(range(n_head, n_head + len(done.tokens) + 1))
                await check_exact(s, in_pieces(engine, full, alone))
            else:
                assert not status.exact and status.partial_window_tokens > 0
                assert blocks["assistant"].partial_window
                assert status.prefilled_tokens < 16  # only the new segment computed


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_context_that_never_fitted_is_computed_as_if_sent_a_file_at_a_time(
    anyio_backend: str,
) -> None:
    """Once the window is full, each block of a context larger than it is computed after
    as much of what came before as the window keeps (a sliding window), not in runs that
    push out all but the block before them: the context sent at once gives the logits,
    bit for bit, of the same context sent one file more at a time. On llama.cpp only:
    OpenVINO gives other bits for other batch cuts, and the two sends cut the first
    window's batches differently."""
    engine = model_for("llama")
    context = files_context(seed=5, n_files=8, words=180)
    logits = []
    for steps in ([context], [context[:k] for k in range(1, len(context) + 1)]):
        async with (
            kvrt.open_runtime(engine=engine, config=NO_DISK) as rt,
            rt.open_session(hot_tokens=512) as s,
        ):
            for sent in steps:
                status = await s.ensure_context(sent)
            assert status.logical_tokens > 2 * 512 and not status.exact
            logits.append(await next_logits(s))
    np.testing.assert_array_equal(logits[0], logits[1])


PIECES = {
    name: " ".join(random.Random(i).choice(WORDS) for _ in range(40))
    for i, name in enumerate("abcd")
}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_random_windows_and_resends_match_fresh_contexts(anyio_backend: str) -> None:
    """Random contexts (pieces in one order, so later ones hit earlier blocks) sent to
    sessions with random windows sharing one cold store: whenever a status says exact,
    the logits equal those of computing the context at once in a fresh engine context;
    otherwise it says why. On llama.cpp, batches of two tokens or more give the same bits
    whatever the cut (OpenVINO's do not), so any exact placement must equal that."""
    rng = random.Random(21)
    engine = tiny()
    config = kvrt.Config(
        session=kvrt.SessionConfig(block_tokens=16, sink_tokens=4, recent_tokens=16),
        disk=kvrt.DiskConfig(budget=0),
    )
    fresh: dict[tuple[str, ...], np.ndarray] = {}
    exact = partial = 0
    async with kvrt.open_runtime(engine=engine, config=config) as rt, AsyncExitStack() as stack:
        sessions = [
            await stack.enter_async_context(rt.open_session(hot_tokens=hot))
            for hot in (96, 128, 192, 512)
        ]
        for _ in range(30):
            names = tuple(sorted(rng.sample(sorted(PIECES), rng.randint(1, 4))))
            context = [
                Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
                *(Segment(n, PIECES[n]) for n in names),
                Segment("q", " Which word comes first?"),
            ]
            s = rng.choice(sessions)
            status = await s.ensure_context(context)
            if names not in fresh:
                fresh[names] = in_pieces(engine, context, [], n=0)[0]
            got = await next_logits(s)
            if status.exact:
                exact += 1
                assert np.array_equal(got, fresh[names]), (names, s.explain().blocks)
            else:
                partial += 1
                assert status.partial_window_tokens > 0, status
    assert exact and partial  # both kinds were met
