"""``kvrt serve``'s own state in its database, through the openai client: kept responses
outlive a restart, a store past its bounds or a damaged row is a clear error (never a 200
for what was not kept, never a traceback), and a 20 MB conversation read leaves the event
loop free for everyone else."""

from __future__ import annotations

import sqlite3
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.server import client, off_loop, server

pytestmark = [pytest.mark.anyio, pytest.mark.model]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_kept_responses_outlive_a_restart(anyio_backend: str, tmp_path: Path) -> None:
    path = str(tmp_path / "state.sqlite3")
    async with server(state_path=path) as (_, url):
        c = client(url)
        model = (await off_loop(c.models.list)).data[0].id
        first = await off_loop(
            lambda: c.responses.create(model=model, input="Name a colour.", max_output_tokens=4)
        )
    async with server(state_path=path) as (_, url):
        c = client(url)
        kept = await off_loop(c.responses.retrieve, first.id)
        assert kept.id == first.id and kept.output_text == first.output_text
        again = await off_loop(
            lambda: c.responses.create(
                model=model, input="Another.", previous_response_id=first.id, max_output_tokens=2
            )
        )
        assert again.usage is not None and again.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
        items = await off_loop(lambda: c.responses.input_items.list(again.id))
        assert [i.type for i in items.data] == ["message"]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_what_cannot_be_kept_is_an_error_and_a_damaged_row_is_refused(
    anyio_backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.sqlite3"
    async with server(state_path=str(path), conversation_store_bytes=4096) as (_, url):
        c = client(url, max_retries=0)
        model = (await off_loop(c.models.list)).data[0].id
        conv = await off_loop(
            lambda: c.conversations.create(items=[{"role": "user", "content": "Hello."}])
        )
        big: Any = [{"role": "user", "content": "x" * 5000}]
        with pytest.raises(openai.APIStatusError) as full:
            await off_loop(lambda: c.conversations.items.create(conv.id, items=big))
        assert full.value.status_code == 507 and "4,096" in full.value.message
        # A response whose conversation cannot take its output is not a 200.
        with pytest.raises(openai.APIStatusError) as full:
            await off_loop(
                lambda: c.responses.create(
                    model=model, input="x" * 4000, conversation=conv.id, max_output_tokens=2
                )
            )
        assert full.value.status_code == 507
        listed = await off_loop(lambda: c.conversations.items.list(conv.id))
        assert len(listed.data) == 1  # nothing half kept
        other = await off_loop(
            lambda: c.conversations.create(items=[{"role": "user", "content": "Hi."}])
        )
    db = sqlite3.connect(path)
    db.execute("UPDATE items SET item = x'ff00' WHERE conversation = ?", (conv.id,))
    db.commit()
    db.close()
    async with server(state_path=str(path)) as (_, url):
        c = client(url, max_retries=0)
        with pytest.raises(openai.APIStatusError) as damaged:
            await off_loop(lambda: c.conversations.items.list(conv.id))
        assert damaged.value.status_code == 500 and "damaged" in damaged.value.message
        with pytest.raises(openai.APIStatusError) as damaged:
            await off_loop(
                lambda: c.responses.create(
                    model=model, input="Hi.", conversation=conv.id, max_output_tokens=2
                )
            )
        assert damaged.value.status_code == 500 and "item 0" in damaged.value.message
        listed = await off_loop(lambda: c.conversations.items.list(other.id))
        assert [i.type for i in listed.data] == ["message"]  # the rest stays readable
    assert "Traceback" not in caplog.text


def _health_times(url: str, stop: threading.Event, seen: list[float]) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            r.read()
        seen.append(time.perf_counter() - began)
        time.sleep(0.005)


async def test_a_20_mb_conversation_read_leaves_health_fast(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with server(state_path=str(tmp_path / "state.sqlite3")) as (_, url):
        c = client(url)
        conv = await off_loop(lambda: c.conversations.create(items=[]))
        part: Any = [{"role": "user", "content": "y" * 1_000_000} for _ in range(5)]
        for _ in range(4):  # 20 MB in four requests
            await off_loop(lambda: c.conversations.items.create(conv.id, items=part))
        stop, seen = threading.Event(), list[float]()
        watcher = threading.Thread(target=_health_times, args=(url, stop, seen))
        watcher.start()
        try:
            began, reads = time.monotonic(), 0
            while time.monotonic() - began < 1.5 or reads < 4:  # the last item reads it all
                listed: Any = await off_loop(
                    lambda: c.conversations.items.list(conv.id, limit=2, order="desc")
                )
                last = listed.data[-1].id
                one = await off_loop(
                    lambda last=last: c.conversations.items.retrieve(last, conversation_id=conv.id)
                )
                assert one.id == last
                reads += 1
        finally:
            stop.set()
            await off_loop(watcher.join)  # (the loop serves the request in flight)
    assert len(seen) > 5 and max(seen) < 0.05, sorted(seen)[-5:]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_store_that_cannot_open_refuses_with_its_reason(
    anyio_backend: str, tmp_path: Path
) -> None:
    """An app mounted without ``Server.open`` meets its store on the first request: a
    store that cannot be opened (here a folder where the database file should be) is a 503
    naming it, never a 500 without a body."""
    import httpx

    import kvrt
    from tests.support.models import tiny

    config = kvrt.serve.ServeConfig(state_path=str(tmp_path))
    async with kvrt.open_runtime(engine=tiny("llama")) as rt:
        app = kvrt.serve.create_app(rt, config)
        model = kvrt.serve.model_id(rt, config)
        sent = {"model": model, "input": "Hi", "max_output_tokens": 1}
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kvrt") as c:
                answer = await c.post("/v1/responses", json=sent)
        finally:
            await app.state.server.aclose()
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "state_unavailable"
