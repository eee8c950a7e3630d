"""The server's API state in a real database: SQLite (through the standard library) and a
real ``redis-server`` behind one protocol. Kept across a restart, bounded per tenant by
count, bytes and age, what cannot be kept a clear error, a damaged or forged row refused
with the rest readable, concurrent writes kept in order."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis

import kvrt
from kvrt._cold import RemoteTier, Signer
from kvrt.serve.state import (
    Bounds,
    ConversationHead,
    KeptResponse,
    SharedState,
    SqliteState,
    StateError,
    StateStore,
)
from tests.support.redis import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.model]

SECRET = b"the replicas' secret, long enough"


@pytest.fixture(params=["sqlite", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@asynccontextmanager
async def opened(
    kind: str, where: Path | RedisServer, bounds: Bounds | None = None
) -> AsyncIterator[StateStore]:
    """A store of ``kind``: SQLite in the folder ``where``, or on the Redis server."""
    store: StateStore
    if kind == "sqlite":
        assert isinstance(where, Path)
        store = await SqliteState.open(str(where / "state.sqlite3"), bounds or Bounds())
    else:
        assert isinstance(where, RedisServer)
        shared = kvrt.SharedStore(RemoteTier(where.url, signer=Signer(SECRET)))
        store = SharedState(shared, bounds or Bounds())
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
def where(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Path | RedisServer:
    if kind == "sqlite":
        return tmp_path
    server: RedisServer = request.getfixturevalue("redis_server")
    return server


def kept(n: int, size: int = 10) -> KeptResponse:
    message = kvrt.Message(role="user", content=f"question {n} " + "x" * size)
    return KeptResponse((message,), (0, 1), b'{"id": "resp_%d"}' % n)


def item(n: int, size: int = 10) -> dict[str, Any]:
    text = f"item {n} " + "y" * size
    return {
        "type": "message",
        "id": f"msg_{n}",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }


async def test_responses_and_conversations_survive_a_restart(
    kind: str, where: Path | RedisServer
) -> None:
    async with opened(kind, where) as store:
        await store.keep_response("alice", "resp_1", kept(1))
        await store.create_conversation(
            "alice", "conv_1", ConversationHead(7, {"k": "v"}), [item(1)]
        )
        await store.add_items("alice", "conv_1", [item(2), item(3)])
        assert await store.remove_item("alice", "conv_1", "msg_2") is True
    async with opened(kind, where) as store:
        assert await store.response("alice", "resp_1") == kept(1)
        head = await store.conversation("alice", "conv_1")
        assert head is not None and head.created_at == 7 and head.metadata == {"k": "v"}
        assert head.items == 2
        assert [i["id"] for i in await store.items("alice", "conv_1") or []] == ["msg_1", "msg_3"]
        # Another tenant reaches none of it.
        assert await store.response("bob", "resp_1") is None
        assert await store.conversation("bob", "conv_1") is None
        assert await store.items(None, "conv_1") is None
        assert await store.remove_item("bob", "conv_1", "msg_1") is None
        assert not await store.forget_response("bob", "resp_1")
        assert not await store.delete_conversation("bob", "conv_1")
        assert await store.delete_conversation("alice", "conv_1")
        assert await store.conversation("alice", "conv_1") is None


async def test_kept_responses_are_bounded_per_tenant_by_count_bytes_and_age(
    kind: str, where: Path | RedisServer
) -> None:
    bounds = Bounds(responses=3, response_bytes=2000, response_age=2.0)
    async with opened(kind, where, bounds) as store:
        for n in range(5):
            await store.keep_response("alice", f"resp_{n}", kept(n))
        await store.keep_response("bob", "resp_b", kept(9))
        found = [await store.response("alice", f"resp_{n}") is not None for n in range(5)]
        assert found == [False, False, True, True, True]  # the least recently used went
        assert await store.response("bob", "resp_b") is not None  # another tenant's stay
        await store.keep_response("alice", "resp_big", kept(5, size=1200))
        await store.keep_response("alice", "resp_big2", kept(6, size=700))
        assert await store.response("alice", "resp_big") is None  # bytes: past 2000
        with pytest.raises(StateError) as refused:
            await store.keep_response("alice", "resp_huge", kept(7, size=5000))
        assert refused.value.kind == "too_large" and "2,000" in str(refused.value)
        await anyio.sleep(2.5)
        assert await store.response("bob", "resp_b") is None  # aged out


async def test_conversations_are_bounded_per_tenant_and_refused_past_the_bound(
    kind: str, where: Path | RedisServer
) -> None:
    bounds = Bounds(conversations=2, conversation_bytes=3000)
    async with opened(kind, where, bounds) as store:
        await store.create_conversation("alice", "conv_a", ConversationHead(1, {}), [])
        await store.create_conversation("alice", "conv_b", ConversationHead(1, {}), [item(1)])
        with pytest.raises(StateError) as full:
            await store.create_conversation("alice", "conv_c", ConversationHead(1, {}), [])
        assert full.value.kind == "full" and "2 conversations" in str(full.value)
        await store.create_conversation("bob", "conv_c", ConversationHead(1, {}), [])
        with pytest.raises(StateError) as full:
            await store.add_items("alice", "conv_a", [item(2, size=4000)])
        assert full.value.kind == "full" and "3,000" in str(full.value)
        assert [i["id"] for i in await store.items("alice", "conv_a") or []] == []
        assert await store.delete_conversation("alice", "conv_b")
        await store.create_conversation("alice", "conv_c", ConversationHead(1, {}), [])


async def test_concurrent_item_writes_are_all_kept_in_order(
    kind: str, where: Path | RedisServer
) -> None:
    async with opened(kind, where) as store:
        await store.create_conversation(None, "conv_1", ConversationHead(1, {}), [])
        async with anyio.create_task_group() as tg:
            for n in range(30):  # each write two items, which stay together and in order
                tg.start_soon(store.add_items, None, "conv_1", [item(2 * n), item(2 * n + 1)])
                await anyio.lowlevel.checkpoint()
        ids = [i["id"] for i in await store.items(None, "conv_1") or []]
        assert sorted(ids) == sorted(f"msg_{n}" for n in range(60)) and len(ids) == 60
        for first, second in zip(ids[::2], ids[1::2], strict=True):
            assert int(second.split("_")[1]) == int(first.split("_")[1]) + 1, ids


async def test_a_damaged_row_is_refused_and_the_rest_stays_readable(tmp_path: Path) -> None:
    async with opened("sqlite", tmp_path) as store:
        await store.keep_response(None, "resp_1", kept(1))
        await store.keep_response(None, "resp_2", kept(2))
        await store.create_conversation(None, "conv_1", ConversationHead(1, {}), [item(1), item(2)])
        await store.create_conversation(None, "conv_2", ConversationHead(1, {}), [item(3)])
    db = sqlite3.connect(tmp_path / "state.sqlite3")
    db.execute("UPDATE responses SET record = x'c1c1c1' WHERE id = 'resp_1'")
    db.execute("UPDATE items SET item = 'not json' WHERE conversation = 'conv_1' AND seq = 2")
    db.commit()
    db.close()
    async with opened("sqlite", tmp_path) as store:
        with pytest.raises(StateError) as damaged:
            await store.response(None, "resp_1")
        assert damaged.value.kind == "damaged" and "'resp_1'" in str(damaged.value)
        assert await store.response(None, "resp_2") == kept(2)
        with pytest.raises(StateError) as damaged:
            await store.items(None, "conv_1")
        assert damaged.value.kind == "damaged" and "item 1" in str(damaged.value)
        assert [i["id"] for i in await store.items(None, "conv_2") or []] == ["msg_3"]
        assert await store.remove_item(None, "conv_1", "msg_2")  # a damaged item can go
        assert [i["id"] for i in await store.items(None, "conv_1") or []] == ["msg_1"]


async def test_a_forged_or_moved_value_on_the_shared_server_is_refused(
    redis_server: RedisServer,
) -> None:
    async with opened("redis", redis_server) as store:
        await store.keep_response(None, "resp_1", kept(1))
        await store.keep_response(None, "resp_2", kept(2))
        await store.create_conversation(None, "conv_1", ConversationHead(1, {}), [item(1), item(2)])
    client = redis.Redis.from_url(redis_server.url)
    shared = kvrt.SharedStore(RemoteTier(redis_server.url, signer=Signer(SECRET)))
    one = shared.name("response", b"-\0resp_1")
    two = shared.name("response", b"-\0resp_2")
    client.set(one, client.get(two) or b"")  # resp_2's value moved under resp_1's name
    items = shared.name("items", b"-\0conv_1")
    client.hset(items, "2", client.hget(items, "1") or b"")  # item 1 copied over item 2
    async with opened("redis", redis_server, Bounds(response_bytes=1 << 20)) as store:
        with pytest.raises(StateError) as forged:
            await store.response(None, "resp_1")
        assert forged.value.kind == "damaged" and "secret" in str(forged.value)
        assert await store.response(None, "resp_2") == kept(2)
        with pytest.raises(StateError):
            await store.items(None, "conv_1")
        assert client.exists(one) == 0  # refused values are deleted
        client.set(two, b"\0" * (64 << 20))  # larger than a response may be: never fetched
        sent = int(client.info("stats")["total_net_output_bytes"])
        with pytest.raises(StateError) as large:
            await store.response(None, "resp_2")
        assert large.value.kind == "damaged" and "too large" in str(large.value)
        assert (
            int(client.info("stats")["total_net_output_bytes"]) - sent < 2 * Bounds().response_bytes
        )


async def test_a_full_or_read_only_database_is_an_error_never_silence(tmp_path: Path) -> None:
    store = await SqliteState.open(
        str(tmp_path / "state.sqlite3"), Bounds(), max_file_bytes=64 * 1024
    )
    try:
        with pytest.raises(StateError) as full:
            for n in range(200):
                await store.keep_response(None, f"resp_{n}", kept(n, size=2000))
        assert full.value.kind == "full" and "full" in str(full.value)
        kept_before = n
        assert await store.response(None, "resp_0") is not None  # what was kept stays
        assert kept_before > 3
    finally:
        await store.aclose()
    store = await SqliteState.open(str(tmp_path / "state.sqlite3"), Bounds())
    try:
        store._db.execute("PRAGMA query_only = ON")  # as a read-only disk answers
        with pytest.raises(StateError) as read_only:
            await store.keep_response(None, "resp_new", kept(1))
        assert read_only.value.kind == "unavailable" and "readonly" in str(read_only.value)
        assert await store.response(None, "resp_0") is not None  # reads still work
    finally:
        await store.aclose()


async def test_a_damaged_database_or_a_fifo_is_refused_at_open(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"this is not a database" * 200)
    with pytest.raises(StateError) as damaged:
        await SqliteState.open(str(junk), Bounds())
    assert damaged.value.kind == "damaged" and str(junk) in str(damaged.value)
    fifo = tmp_path / "fifo.sqlite3"
    import os

    os.mkfifo(fifo)
    with anyio.fail_after(5), pytest.raises(StateError) as refused:
        await SqliteState.open(str(fifo), Bounds())
    assert "not a regular file" in str(refused.value)


async def test_rows_of_the_wrong_type_fail_only_their_own_reads(tmp_path: Path) -> None:
    async with opened("sqlite", tmp_path) as store:
        await store.keep_response("alice", "resp_1", kept(1))
        await store.keep_response("alice", "resp_2", kept(2))
        await store.create_conversation("alice", "conv_1", ConversationHead(1, {}), [item(1)])
        await store.create_conversation("alice", "conv_2", ConversationHead(1, {}), [item(2)])
    db = sqlite3.connect(tmp_path / "state.sqlite3")
    db.execute("UPDATE responses SET size = 'big', used = 'then' WHERE id = 'resp_1'")
    db.execute("UPDATE conversations SET created_at = 'big', size = 'big' WHERE id = 'conv_1'")
    db.execute("UPDATE items SET seq = 'x' WHERE conversation = 'conv_2'")
    db.commit()
    db.close()
    async with opened("sqlite", tmp_path) as store:
        for read in (store.response("alice", "resp_1"), store.conversation("alice", "conv_1")):
            with pytest.raises(StateError) as damaged:
                await read
            assert damaged.value.kind == "damaged"
        await store.keep_response("alice", "resp_3", kept(3))  # the tenant goes on
        assert await store.response("alice", "resp_2") == kept(2)
        assert await store.add_items("alice", "conv_2", [item(3)])
        await store.create_conversation("alice", "conv_3", ConversationHead(1, {}), [item(4)])
        assert await store.delete_conversation("alice", "conv_1")  # a damaged one can go


async def test_foreign_and_oversized_values_on_the_shared_server_are_refused_unread(
    redis_server: RedisServer,
) -> None:
    async with opened("redis", redis_server) as store:
        await store.create_conversation(None, "conv_1", ConversationHead(1, {}), [item(1)])
        await store.create_conversation(None, "conv_2", ConversationHead(1, {}), [item(2)])
        await store.keep_response(None, "resp_1", kept(1))
    client: Any = redis.Redis.from_url(redis_server.url)
    shared = kvrt.SharedStore(RemoteTier(redis_server.url, signer=Signer(SECRET)))
    client.hset(shared.name("conversation-sizes", b"-\0"), "conv_9", "lots")
    client.hset(shared.name("response-sizes", b"-\0"), "resp_9", "lots")
    client.set(shared.name("item-seq", b"-\0conv_1"), "seven")
    items = shared.name("items", b"-\0conv_2")
    client.hset(items, "2", b"\0" * (65 * 2**20))  # past any request: never read
    async with opened("redis", redis_server) as store:
        assert await store.add_items(None, "conv_1", [item(3)])  # the tenant goes on
        await store.keep_response(None, "resp_2", kept(2))
        assert [i["id"] for i in await store.items(None, "conv_1") or []] == ["msg_1", "msg_3"]
        sent = int(client.info("stats")["total_net_output_bytes"])
        assert [i["id"] for i in await store.items(None, "conv_2") or []] == ["msg_2"]
        assert int(client.info("stats")["total_net_output_bytes"]) - sent < 2**20
        assert client.hlen(items) == 1  # the oversized item was deleted unread
        client.hset(items, "7", b"forged")  # an item the head does not count
        with pytest.raises(StateError) as refused:
            await store.items(None, "conv_2")
        assert refused.value.kind == "damaged" and "counts 1" in str(refused.value)
        assert await store.delete_conversation(None, "conv_2")  # a damaged one can go


CHILD = """
import sys, subprocess, anyio
from kvrt.serve.state import SqliteState, Bounds, ConversationHead, StateError

async def main(path):
    store = await SqliteState.open(path, Bounds())
    await store.create_conversation(None, "conv_1", ConversationHead(1, {}), [])
    if subprocess.run(["chattr", "+i", *__import__("glob").glob(path + "*")]).returncode:
        print("no-chattr")
        return
    try:
        await store.add_items(None, "conv_1", [{"type": "message", "id": "m", "content": "x"}])
    except StateError as exc:
        print(exc.kind)

anyio.run(main, sys.argv[1])
"""


def _root_with(tool: str) -> bool:
    import os
    import shutil

    return os.geteuid() == 0 and shutil.which(tool) is not None


@pytest.mark.skipif(not _root_with("chattr"), reason="needs root and chattr")
def test_files_made_immutable_under_the_store_are_an_error_not_a_sigbus(tmp_path: Path) -> None:
    """A write-ahead log's index is a file mapped into memory: made immutable while the
    server ran, the next write ended the process with SIGBUS. A rollback journal's
    failure is an error."""
    import subprocess
    import sys

    path = tmp_path / "state.sqlite3"
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=60
        )
    finally:
        subprocess.run(["chattr", "-R", "-i", str(tmp_path)], check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    if done.stdout.split() == ["no-chattr"]:
        pytest.skip("this file system takes no immutable flag")
    assert done.stdout.split() == ["unavailable"], done.stdout


@pytest.mark.skipif(not _root_with("mount"), reason="needs root to mount a small tmpfs")
async def test_a_full_disk_still_lets_a_conversation_be_deleted(tmp_path: Path) -> None:
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("this sandbox cannot mount a tmpfs")
    try:
        store = await SqliteState.open(str(disk / "state.sqlite3"), Bounds())
        try:
            await store.create_conversation(None, "conv_1", ConversationHead(1, {}), [])
            with pytest.raises(StateError) as full:
                for n in range(10_000):
                    await store.add_items(None, "conv_1", [item(n, size=20_000)])
            assert full.value.kind == "full"
            assert await store.delete_conversation(None, "conv_1")
            assert await store.conversation(None, "conv_1") is None
        finally:
            await store.aclose()
    finally:
        subprocess.run(["umount", str(disk)], check=False)


async def test_a_page_of_a_large_conversation_reads_that_page_alone(
    redis_server: RedisServer,
) -> None:
    """A one-item page, and one item, of a 20 MB conversation on the shared server read
    that item (and the conversation's head and item names), not the 20 MB."""
    client: Any = redis.Redis.from_url(redis_server.url)
    async with opened("redis", redis_server) as store:
        await store.create_conversation(None, "conv_1", ConversationHead(1, {}), [])
        for n in range(20):
            await store.add_items(None, "conv_1", [item(n, size=1_000_000)])
        sent = int(client.info("stats")["total_net_output_bytes"])
        page = await store.item_page(None, "conv_1", limit=1, order="desc", after="msg_10")
        one = await store.item(None, "conv_1", "msg_3")
        read = int(client.info("stats")["total_net_output_bytes"]) - sent
    assert page is not None and [i["id"] for i in page[0]] == ["msg_9"] and page[1]
    assert one is not None and one["id"] == "msg_3"
    assert read < 3_500_000, read  # the item after, the page's item and the one item
