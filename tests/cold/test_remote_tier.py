"""The remote tier on a real ``redis-server``: two processes share blocks bit-exactly, a
server that stops degrades to the local tiers without a hang, an altered value is refused.

The server is Debian's ``redis-server`` (``.ci/run`` installs it when missing), started on
a free loopback port for each test and stopped after it.
"""

from __future__ import annotations

import os
import sys

import anyio
import numpy as np
import pytest
import redis

import kvrt
from kvrt import Segment, policies
from kvrt._cold import ColdStore, RemoteTier
from kvrt.adapters.llama import LlamaEngine
from tests.support.disk_writer import SIZE, block, serving
from tests.support.models import next_logits
from tests.support.redis import RedisServer
from tests.support.tiers import DOC, FIRST_PROCESS, OTHER, references, settled


def remote_only(url: str) -> kvrt.Config:
    return kvrt.load_config(flags={"remote.url": url, "disk.budget": "0"})


@pytest.mark.anyio
async def test_an_altered_value_is_refused_and_a_good_one_served(redis_server: RedisServer) -> None:
    victim = policies.get("cold_victim", "class_lru")
    store = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(redis_server.url)])
    async with serving(store):
        for i in range(2):
            await store.put(block(i))
        await settled(store)
    remote = store.stats().remote
    assert remote is not None and remote.writes == 2

    client = redis.Redis.from_url(redis_server.url)
    name = RemoteTier(redis_server.url).key_name(block(0).key)
    raw = client.get(name)
    assert isinstance(raw, bytes) and raw.startswith(b"KVRTBLK")
    client.setrange(name, len(raw) - 5, b"X")  # one byte of the payload

    fresh = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(redis_server.url)])
    async with serving(fresh):
        await fresh.discover([block(0).key, block(1).key, block(5).key])
        assert fresh.tier(block(0).key) == fresh.tier(block(1).key) == "remote"
        assert fresh.tier(block(5).key) is None
        assert await fresh.fetch(block(0).key) is None  # refused, never served
        good = await fresh.fetch(block(1).key)
        assert good is not None and good.tier == "remote"
        assert np.array_equal(good.entry.data, block(1).data)
        again = await fresh.fetch(block(1).key)
        assert again is not None and again.tier == "ram"  # promoted
    stats = fresh.stats()
    assert stats.remote is not None and stats.remote.refused == 1 and stats.remote.hits == 1
    assert stats.remote.warning is not None and "refused" in stats.remote.warning
    assert stats.remote_hits == 1


@pytest.mark.subprocess
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the disk tier's twin runs trio
async def test_two_processes_share_blocks_through_the_server(
    redis_server: RedisServer, engine: LlamaEngine, anyio_backend: str
) -> None:
    context = [Segment("doc", DOC), Segment("q", "Who kept the logbook?")]
    script = FIRST_PROCESS.format(doc=DOC, other=OTHER)
    env = {**os.environ, "KVRT_REMOTE_URL": redis_server.url, "KVRT_DISK_BUDGET": "0"}
    done = await anyio.run_process([sys.executable, "-c", script], check=False, env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    keys: list[bytes] = redis.Redis.from_url(redis_server.url).keys("kvrt:v2:blk:*")  # type: ignore[assignment]
    assert keys and all(k.count(b":") == 3 for k in keys)  # names say nothing of the model

    want, want_logits = await references(engine, context)
    async with kvrt.open_runtime(engine=engine, config=remote_only(redis_server.url)) as rt:
        async with rt.open_session(hot_tokens=512) as s:
            status = await s.ensure_context(context)
            assert status.restored_tokens > 0 and status.exact
            choices = {b.choice for b in s.explain().blocks if b.segment == "doc"}
            assert any("restored from cold (remote)" in (c or "") for c in choices), choices
            got_logits = await next_logits(s)
            got = (await s.generate(max_tokens=16)).tokens
        assert rt.cold_stats().remote_hits > 0
    assert np.array_equal(got_logits, want_logits)
    assert got == want


@pytest.mark.anyio
async def test_a_server_that_stops_degrades_to_the_local_tiers(
    redis_server: RedisServer, engine: LlamaEngine
) -> None:
    first = [Segment("doc", DOC), Segment("q", "Who kept the logbook?")]
    second = [Segment("other", OTHER), Segment("q", "Who baked?")]
    cfg = kvrt.load_config(flags={"remote.url": redis_server.url, "remote.timeout": "1"})
    async with (
        kvrt.open_runtime(engine=engine, config=cfg) as rt,
        rt.open_session(hot_tokens=512) as s,
    ):
        await s.ensure_context(first)
        want = (await s.generate(max_tokens=8)).tokens
        await s.ensure_context(second)
        redis_server.stop()
        with anyio.fail_after(60):  # bounded: nothing waits on a dead server for long
            status = await s.ensure_context(first)
            got = (await s.generate(max_tokens=8)).tokens
        assert status.restored_tokens > 0  # from the local tiers
        report = s.explain().cold_store
        assert report.remote is not None and report.remote.errors > 0
        assert not report.remote.up
        assert report.remote.warning is not None and "local tiers" in report.remote.warning
    assert got == want


@pytest.mark.anyio
async def test_a_poisoned_key_is_skipped_and_the_tier_stays_up(redis_server: RedisServer) -> None:
    """A value of another type under a kvrt name (someone's list) is a miss for that key
    alone: the tier stays up and serves the others."""
    victim = policies.get("cold_victim", "class_lru")
    store = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(redis_server.url)])
    async with serving(store):
        for i in range(2):
            await store.put(block(i))
        await settled(store)
    client = redis.Redis.from_url(redis_server.url)
    name = RemoteTier(redis_server.url).key_name(block(0).key)
    client.delete(name)
    client.rpush(name, b"not", b"a", b"block")

    fresh = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(redis_server.url)])
    async with serving(fresh):
        await fresh.discover([block(0).key, block(1).key])
        assert await fresh.fetch(block(0).key) is None
        good = await fresh.fetch(block(1).key)
        assert good is not None and good.tier == "remote"
    stats = fresh.stats().remote
    assert stats is not None and stats.up and stats.errors == 0 and stats.refused == 1
