"""The remote tier on a real ``redis-server``: two processes share blocks bit-exactly, a
server that stops degrades to the local tiers without a hang, an altered value is refused.

The server is Debian's ``redis-server`` (``.ci/run`` installs it when missing), started on
a free loopback port for each test and stopped after it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np
import pytest
import redis

import kvrt
from kvrt import Segment, policies
from kvrt._cold import ColdStore, RemoteTier
from kvrt._cold.remote import key_name
from kvrt.adapters.llama import LlamaEngine

from ._agent import next_logits
from .disk_writer import SIZE, block, serving
from .test_disk_tier import DOC, FIRST_PROCESS, OTHER, references, settled


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs Debian's package)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(
        [*args, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            anyio.run(anyio.sleep, 0.05)
    else:
        process.kill()
        pytest.fail("redis-server did not start")
    found = Server(url, process)
    yield found
    found.stop()


def remote_only(url: str) -> kvrt.Config:
    return kvrt.load_config(flags={"remote.url": url, "disk.budget": "0"})


@pytest.mark.anyio
async def test_an_altered_value_is_refused_and_a_good_one_served(server: Server) -> None:
    victim = policies.get("cold_victim", "class_lru")
    store = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(server.url)])
    async with serving(store):
        for i in range(2):
            await store.put(block(i))
        await settled(store)
    assert store.stats().remote is not None and store.stats().remote.writes == 2

    client = redis.Redis.from_url(server.url)
    name = key_name(block(0).key)
    raw = client.get(name)
    assert isinstance(raw, bytes) and raw.startswith(b"KVRTBLK")
    client.setrange(name, len(raw) - 5, b"X")  # one byte of the payload

    fresh = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(server.url)])
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
    server: Server, engine: LlamaEngine, anyio_backend: str
) -> None:
    context = [Segment("doc", DOC), Segment("q", "Who kept the logbook?")]
    script = FIRST_PROCESS.format(doc=DOC, other=OTHER)
    env = {**os.environ, "KVRT_REMOTE_URL": server.url, "KVRT_DISK_BUDGET": "0"}
    done = await anyio.run_process([sys.executable, "-c", script], check=False, env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    keys = redis.Redis.from_url(server.url).keys("kvrt:v1:*")
    assert keys and all(k.count(b":") == 5 for k in keys)

    want, want_logits = await references(engine, context)
    async with kvrt.open_runtime(engine=engine, config=remote_only(server.url)) as rt:
        async with rt.open_session(hot_tokens=512) as s:
            status = await s.ensure_context(context)
            assert status.restored_tokens > 0 and status.exact
            choices = {b.choice for b in s.explain().blocks if b.segment == "doc"}
            assert any("restored from cold (remote)" in c for c in choices), choices
            got_logits = await next_logits(s)
            got = (await s.generate(max_tokens=16)).tokens
        assert rt.cold_stats().remote_hits > 0
    assert np.array_equal(got_logits, want_logits)
    assert got == want


@pytest.mark.anyio
async def test_a_server_that_stops_degrades_to_the_local_tiers(
    server: Server, engine: LlamaEngine
) -> None:
    first = [Segment("doc", DOC), Segment("q", "Who kept the logbook?")]
    second = [Segment("other", OTHER), Segment("q", "Who baked?")]
    cfg = kvrt.load_config(flags={"remote.url": server.url, "remote.timeout": "1"})
    async with (
        kvrt.open_runtime(engine=engine, config=cfg) as rt,
        rt.open_session(hot_tokens=512) as s,
    ):
        await s.ensure_context(first)
        want = (await s.generate(max_tokens=8)).tokens
        await s.ensure_context(second)
        server.stop()
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
async def test_a_poisoned_key_is_skipped_and_the_tier_stays_up(server: Server) -> None:
    """A value of another type under a kvrt name (someone's list) is a miss for that key
    alone: the tier stays up and serves the others."""
    victim = policies.get("cold_victim", "class_lru")
    store = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(server.url)])
    async with serving(store):
        for i in range(2):
            await store.put(block(i))
        await settled(store)
    client = redis.Redis.from_url(server.url)
    client.delete(key_name(block(0).key))
    client.rpush(key_name(block(0).key), b"not", b"a", b"block")

    fresh = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(server.url)])
    async with serving(fresh):
        await fresh.discover([block(0).key, block(1).key])
        assert await fresh.fetch(block(0).key) is None
        good = await fresh.fetch(block(1).key)
        assert good is not None and good.tier == "remote"
    stats = fresh.stats().remote
    assert stats is not None and stats.up and stats.errors == 0 and stats.refused == 1
