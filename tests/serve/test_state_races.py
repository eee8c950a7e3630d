"""``kvrt serve``'s state under races and refusals, through the real routes: two servers
on one SQLite file, and replicas on one real ``redis-server``. A response refused (its
kept copy too large) leaves its conversation as it was; a conversation deleted while its
response streams ends that stream with its last event; items added while another process
deletes their conversation land before the deletion or not at all, and each tenant's
recorded bytes are what it holds."""

from __future__ import annotations

import json
import sqlite3
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from kvrt._cold import Signer
from tests.support.models import zoo_path
from tests.support.redis import RedisServer
from tests.support.server import kvrt_serve

pytestmark = [pytest.mark.subprocess, pytest.mark.model]

SECRET = "the replicas' secret, 32 bytes or more\n"
TRIALS = 40


def call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


@contextmanager
def servers(tmp_path: Path, count: int, *flags: str) -> Iterator[list[str]]:
    """``count`` ``kvrt serve`` processes on the zoo's tiny llama with ``flags``."""
    model = ("--model", zoo_path("llama"), "--disk-budget", "0")
    with ExitStack() as stack:
        yield [
            stack.enter_context(kvrt_serve(tmp_path / f"serve-{n}.log", *model, *flags))
            for n in range(count)
        ]


def race(urls: list[str]) -> dict[str, bool]:
    """Trials of item adds and a metadata change on one conversation at once, spread over
    the servers, with its deletion in every other trial: every add answered 200 is
    readable, or the conversation is gone and stays gone on every server. Each
    conversation, and whether it was deleted."""
    return {trial(urls, deleted=n % 2 == 0): n % 2 == 0 for n in range(TRIALS)}


def trial(urls: list[str], *, deleted: bool) -> str:
    status, conv = call(urls[0], "POST", "/v1/conversations", {"items": []})
    assert status == 200, conv
    cid: str = conv["id"]
    writes: list[tuple[str, str, str, Any]] = [
        (
            urls[n % len(urls)],
            "POST",
            f"/v1/conversations/{cid}/items",
            {"items": [message(str(n))]},
        )
        for n in range(4)
    ]
    writes.append((urls[0], "POST", f"/v1/conversations/{cid}", {"metadata": {"t": "1"}}))
    if deleted:
        writes.append((urls[-1], "DELETE", f"/v1/conversations/{cid}", None))
    start = threading.Barrier(len(writes))
    answers: list[tuple[int, Any]] = [(0, None)] * len(writes)

    def write(n: int) -> None:
        start.wait()
        answers[n] = call(*writes[n])

    threads = [threading.Thread(target=write, args=(n,)) for n in range(len(writes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(status in (200, 404) for status, _ in answers), answers
    added = {got["data"][0]["id"] for status, got in answers[:4] if status == 200}
    for url in urls:
        status, listed = call(url, "GET", f"/v1/conversations/{cid}/items")
        if deleted:
            assert status == 404  # deleted, whatever came before or after
            status, _ = call(url, "POST", f"/v1/conversations/{cid}", {"metadata": {"a": "b"}})
            assert status == 404  # never a 200 for a deleted conversation
        else:
            assert status == 200 and {i["id"] for i in listed["data"]} == added
    return cid


def test_two_servers_on_one_sqlite_file_keep_its_invariants(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    with servers(tmp_path, 2, "--state", str(path)) as urls:
        race(urls)
    db = sqlite3.connect(path)
    orphans = db.execute(
        "SELECT count(*) FROM items WHERE NOT EXISTS (SELECT 1 FROM conversations c WHERE "
        "c.tenant = items.tenant AND c.id = items.conversation)"
    ).fetchone()[0]
    assert orphans == 0  # no item outside every bound
    for cid, count, size in db.execute("SELECT id, items, size FROM conversations"):
        held = db.execute(
            "SELECT count(*), coalesce(sum(length(item)), 0) FROM items WHERE conversation = ?",
            (cid,),
        ).fetchone()
        assert (count, size) == held, cid


@pytest.mark.parametrize("replicas", [1, 2])
def test_replicas_on_one_redis_keep_its_invariants(
    tmp_path: Path, redis_server: RedisServer, replicas: int
) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    flags = ("--remote-url", redis_server.url, "--remote-secret-file", str(secret))
    with servers(tmp_path, replicas, *flags) as urls:
        raced = race(urls)
    signer = Signer(SECRET.strip().encode())
    client: Any = redis.Redis.from_url(redis_server.url)  # its answers are typed loosely
    index, sizes = signer.name("conversations", b"-\0"), signer.name("conversation-sizes", b"-\0")
    held = {k.decode(): int(v) for k, v in client.hgetall(sizes).items()}
    listed = {k.decode() for k in client.zrange(index, 0, -1)}
    # No ghost conversation, no phantom bytes: what is charged is what is held.
    assert listed == set(held) == {cid for cid, deleted in raced.items() if not deleted}
    for cid in listed:
        assert client.exists(signer.name("conversation", b"-\0" + cid.encode()))
        items = signer.name("items", b"-\0" + cid.encode())
        assert held[cid] == sum(len(v) - signer.tag_bytes for v in client.hvals(items))


def test_a_refused_response_leaves_its_conversation_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    with servers(tmp_path, 1, "--state", str(path), "--response-store", "8KiB") as (url,):
        status, conv = call(url, "POST", "/v1/conversations", {"items": [message("x" * 13_000)]})
        assert status == 200
        cid, model = conv["id"], call(url, "GET", "/v1/models")[1]["data"][0]["id"]
        ask = {"model": model, "input": "Go on.", "conversation": cid, "max_output_tokens": 2}
        status, refused = call(url, "POST", "/v1/responses", ask)
        assert status == 507 and refused["error"]["code"] == "state_too_large", refused
        assert len(call(url, "GET", f"/v1/conversations/{cid}/items")[1]["data"]) == 1
        events = stream(url, {**ask, "stream": True})
        assert events[-1]["type"] == "response.failed", events[-1]
        assert len(call(url, "GET", f"/v1/conversations/{cid}/items")[1]["data"]) == 1
        # Not kept, it is not stored at all: the conversation takes the turn alone.
        status, answered = call(url, "POST", "/v1/responses", {**ask, "store": False})
        assert status == 200, answered
        assert len(call(url, "GET", f"/v1/conversations/{cid}/items")[1]["data"]) == 3


def stream(url: str, body: Any, *, on_first: Any = None) -> list[dict[str, Any]]:
    """A streamed Responses request's events (``on_first()`` called once the first
    arrives)."""
    request = urllib.request.Request(
        url + "/v1/responses",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if on_first is not None and len(events) == 1:
                    on_first()
    return events


def test_a_conversation_deleted_while_its_response_streams_ends_the_stream_cleanly(
    tmp_path: Path,
) -> None:
    with servers(tmp_path, 1, "--state", str(tmp_path / "s.sqlite3")) as (url,):
        model = call(url, "GET", "/v1/models")[1]["data"][0]["id"]
        conv = call(url, "POST", "/v1/conversations", {"items": [message("Hello.")]})[1]
        cid = conv["id"]
        ask = {"model": model, "input": "Go on.", "conversation": cid, "stream": True}
        events = stream(
            url,
            {**ask, "max_output_tokens": 64},
            on_first=lambda: call(url, "DELETE", f"/v1/conversations/{cid}"),
        )
        assert events[-1]["type"] == "response.failed", events[-1]["type"]
        error = events[-1]["response"]["error"]
        assert error["code"] == "conversation_not_found" and cid in error["message"]


def test_replicas_refuse_state_written_back_after_it_changed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Whoever can write the server's keyspace but lacks the secret writes old values back
    under their own names (``DUMP`` then ``RESTORE``): a deleted conversation or response
    stays deleted on every replica (a signed tombstone), and metadata rolled back is
    refused by the replicas that saw the newer."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    flags = ("--remote-url", redis_server.url, "--remote-secret-file", str(secret))
    client: Any = redis.Redis.from_url(redis_server.url)

    def snapshot() -> dict[bytes, bytes]:
        return {key: client.dump(key) for key in client.keys("*")}

    def write_back(values: dict[bytes, bytes]) -> None:
        for key, value in values.items():
            client.restore(key, 0, value, replace=True)

    with servers(tmp_path, 2, *flags) as (a, b):
        model = call(a, "GET", "/v1/models")[1]["data"][0]["id"]
        conv = call(a, "POST", "/v1/conversations", {"items": [message("secret plan")]})[1]
        kept = call(
            a, "POST", "/v1/responses", {"model": model, "input": "Hi.", "max_output_tokens": 2}
        )[1]
        before = snapshot()
        assert call(b, "DELETE", f"/v1/conversations/{conv['id']}")[0] == 200
        assert call(b, "DELETE", f"/v1/responses/{kept['id']}")[0] == 200
        write_back(before)
        for url in (a, b):
            assert call(url, "GET", f"/v1/conversations/{conv['id']}/items")[0] == 404
            assert call(url, "GET", f"/v1/responses/{kept['id']}")[0] == 404

        other = call(a, "POST", "/v1/conversations", {"metadata": {"v": "1"}})[1]
        old = snapshot()
        changed = call(a, "POST", f"/v1/conversations/{other['id']}", {"metadata": {"v": "2"}})
        assert changed[1]["metadata"] == {"v": "2"}
        assert call(b, "GET", f"/v1/conversations/{other['id']}")[1]["metadata"] == {"v": "2"}
        write_back(old)
        for url in (a, b):
            status, got = call(url, "GET", f"/v1/conversations/{other['id']}")
            assert status == 500 and got["error"]["code"] == "state_damaged", got
