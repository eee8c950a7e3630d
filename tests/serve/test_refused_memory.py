"""A refused request leaves no memory behind: not in an idle session, not in a reference
cycle waiting for the garbage collector (an error's traceback holding the frames that held
the request). In process with the collector held off, on both event loops; and as a
``kvrt serve`` process whose RSS, after rounds of refused requests of a 20 MB
conversation and 5 MB prompts, comes back within 50 MiB of where it was."""

from __future__ import annotations

import gc
import json
import sys
import time
import urllib.request
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.models import tiny, zoo_path
from tests.support.server import kvrt_serve, off_loop, post, server

pytestmark = pytest.mark.model

BIG = 500_000
"""Characters (or bytes) from which a string counts as a request's."""
MARKS = ("refused ", "kept ")
"""Words the requests' and the conversation's texts are made of: a large string holding
one near its start is theirs (the worker's other tests hold large strings of their own)."""


def conversation(url: str, megabytes: int) -> str:
    """A kept conversation holding ``megabytes`` of text: its id."""
    item = {"type": "message", "role": "user", "content": "kept " * 200_000}
    status, conv, _ = post(url, "/v1/conversations", b'{"items": []}')
    assert status == 200, conv
    for _ in range(megabytes):
        body = json.dumps({"items": [item]}).encode()
        status, got, _ = post(url, f"/v1/conversations/{conv['id']}/items", body)
        assert status == 200, got
    return str(conv["id"])


def refused(url: str, model: str, cid: str) -> None:
    """Requests refused after their body was read and their conversation fetched: each a
    4xx."""
    asks: list[tuple[str, dict[str, Any] | bytes]] = [
        ("/v1/responses", {"model": model, "input": "Hi.", "conversation": cid}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "refused " * 600_000}]}),
        ("/v1/responses", {"model": model, "input": "refused " * 600_000, "max_output_tokens": 2}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "refused " * 400_000}}}]}),
        (f"/v1/conversations/{cid}/items", {"items": [{"type": "nonsense", "text": "refused " * 400_000}]}),
        ("/v1/chat/completions", b'{"model": "' + b"refused " * 400_000),
    ]  # fmt: skip
    for path, ask in asks:
        body = ask if isinstance(ask, bytes) else json.dumps(ask).encode()
        status, answer, _ = post(url, path, body)
        assert 400 <= status < 500, (path, status, answer)


def held_big_strings() -> tuple[int, int]:
    """Large strings and bytes still alive, and those only reference cycles keep (what
    the garbage collector would free), each in bytes."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        garbage = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    in_cycles = _big_reachable(garbage)
    alive = {id(r): len(r) for o in gc.get_objects() for r in gc.get_referents(o) if _theirs(r)}
    return sum(alive.values()), in_cycles


def _theirs(o: Any) -> bool:
    """Whether ``o`` is a large string or bytes of the test's requests or conversation."""
    if type(o) is str:
        return len(o) > BIG and any(m in o[:2000] for m in MARKS)
    if type(o) is bytes:
        return len(o) > BIG and any(m.encode() in o[:2000] for m in MARKS)
    return False


_SKIPPED = (type(sys), type, *weakref.ProxyTypes)
"""Not followed: modules and classes (everything is reachable from them), dead proxies."""


def _big_reachable(roots: list[Any]) -> int:
    seen, queue, total = set(), deque(roots), 0
    while queue:
        o = queue.popleft()
        if id(o) in seen or type(o) in _SKIPPED:
            continue
        seen.add(id(o))
        if type(o) in (str, bytes):
            total += len(o) if _theirs(o) else 0
            continue
        queue.extend(gc.get_referents(o))
    return total


@pytest.mark.anyio
async def test_refused_requests_leave_nothing_in_sessions_or_cycles(anyio_backend: str) -> None:
    async with server(engine=tiny("llama"), state_path=None, max_grammar_bytes=4096) as (rt, url):
        model = Path(rt.model_info.model.path).stem
        cid = await off_loop(conversation, url, 3)
        gc.collect()
        gc.disable()
        try:
            await off_loop(refused, url, model, cid)
            alive, in_cycles = held_big_strings()
        finally:
            gc.enable()
    assert in_cycles == 0  # nothing waits for the garbage collector
    assert alive == 0  # nor in a session (its last call) or anywhere else


@pytest.mark.subprocess
def test_refused_requests_give_their_memory_back_to_the_system(tmp_path: Path) -> None:
    flags = ("--model", zoo_path("llama"), "--disk-budget", "0", "--state", "none")
    with kvrt_serve(tmp_path / "serve.log", *flags) as url:
        port = url.rsplit(":", 1)[1]
        (process,) = (p for p in psutil.Process().children(recursive=True) if port in p.cmdline())
        with urllib.request.urlopen(url + "/v1/models") as got:
            model = json.loads(got.read())["data"][0]["id"]
        cid = conversation(url, 20)
        time.sleep(2)
        before = process.memory_info().rss
        for _ in range(3):
            refused(url, model, cid)
        time.sleep(10)
        after = process.memory_info().rss
    assert after - before < 50 * 2**20, (before >> 20, after >> 20)
