"""``kvrt serve`` as a process, shared by tenants: one API key's clients never learn
another's prompt through the cache, on one replica, across replicas sharing one Redis, and
after a restart; ``cache_salt`` narrows reuse within a tenant.

The probe is the published attack: knowing how another client's system prompt begins, send
that beginning plus one guessed digit and read ``usage.prompt_tokens_details.
cached_tokens``, which is one higher for the right digit wherever the cache is shared. It
recovers the code within a tenant (so the test can fail) and nothing across tenants.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.models import zoo_path
from tests.support.redis import RedisServer as Redis
from tests.support.server import kvrt_serve
from tests.support.tenants import PIN, PREFIX, SECRET

pytestmark = [pytest.mark.subprocess, pytest.mark.model]

KEYS = "key-alice-1 alice\nkey-alice-2 alice\nkey-bob bob\n"


@contextmanager
def serving(tmp_path: Path, *flags: str) -> Iterator[str]:
    """``kvrt serve`` on the zoo's tiny llama with the three keys above and one session
    (so every new conversation takes its place and sends its blocks to the cold store):
    its base URL."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    flags = ("--model", zoo_path("llama"), "--api-key", f"@{keys}", "--max-sessions", "1", *flags)
    with kvrt_serve(tmp_path / f"serve-{time.monotonic_ns()}.log", *flags) as url:
        yield url


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def ask(url: str, key: str, system: str, salt: str | None = None) -> int:
    """One chat request, in a session of its own (the one before it leaves for the cold
    store, as under load); the prompt tokens it reports as cached."""
    extra = {"cache_salt": salt} if salt is not None else None
    done = client(url, key).chat.completions.create(
        extra_headers={"X-Session-Id": uuid.uuid4().hex},
        model="llama",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body=extra,
    )
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    return int(done.usage.prompt_tokens_details.cached_tokens or 0)


def guess(url: str, key: str, salt: str | None = None) -> tuple[str, list[list[int]]]:
    """The code as the cached-token counts give it away, digit by digit (stops at the
    first tie), and the counts seen."""
    known, seen = "", []
    for _ in PIN:
        counts = [ask(url, key, PREFIX + known + d + "?", salt) for d in "0123456789"]
        seen.append(counts)
        if counts.count(max(counts)) != 1:
            break
        known += str(counts.index(max(counts)))
    return known, seen


@pytest.mark.parametrize(
    ("attacker", "salt", "learns"),
    [
        ("key-alice-2", None, True),  # another key of the victim's tenant: one scope
        ("key-bob", None, False),  # another tenant
        ("key-alice-2", "elsewhere", False),  # the victim's tenant, another salt
    ],
)
def test_a_tenant_cannot_guess_another_tenants_prompt(
    tmp_path: Path, attacker: str, salt: str | None, learns: bool
) -> None:
    with serving(tmp_path, "--disk-budget", "0") as url:
        ask(url, "key-alice-1", SECRET)
        found, seen = guess(url, attacker, salt)
    assert (found == PIN) if learns else (found == ""), seen


def test_replicas_on_one_redis_and_a_restart_keep_tenants_apart(
    tmp_path: Path, redis_server: Redis
) -> None:
    """Two replicas share blocks through one Redis, and a restart finds them on disk: a
    tenant's context comes back for that tenant, on the other replica and after the
    restart, and for no other tenant."""
    disk = tmp_path / "blocks"
    shared = ("--remote-url", redis_server.url, "--disk-budget", "0")
    with serving(tmp_path, *shared) as one, serving(tmp_path, *shared) as two:
        assert ask(one, "key-alice-1", SECRET) == 0
        ask(one, "key-bob", "Something else entirely, to move alice's blocks out.")
        assert ask(two, "key-bob", SECRET) == 0  # bob on the other replica: nothing
        assert ask(two, "key-alice-2", SECRET) > 0  # alice there: from Redis
    with serving(tmp_path, "--disk-path", str(disk)) as url:
        ask(url, "key-alice-1", SECRET)
        ask(url, "key-bob", "Something else entirely, to move alice's blocks out.")
    with serving(tmp_path, "--disk-path", str(disk)) as url:  # restarted
        assert ask(url, "key-bob", SECRET) == 0
        assert ask(url, "key-alice-2", SECRET) > 0


def raw_post(url: str, path: str, body: bytes, headers: list[tuple[str, str]]) -> tuple[int, Any]:
    """A POST with exactly these headers, repeated ones included (http.client)."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", path)
    for name, value in [
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
        *headers,
    ]:
        conn.putheader(name, value)
    conn.endheaders()
    conn.send(body)
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def test_keys_salts_and_stored_responses_are_checked(tmp_path: Path) -> None:
    chat = json.dumps(
        {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    ).encode()
    with serving(tmp_path, "--disk-budget", "0") as url:
        status, body = raw_post(
            url,
            "/v1/chat/completions",
            chat,
            [("Authorization", "Bearer key-bob"), ("Authorization", "Bearer key-alice-1")],
        )
        assert status == 400 and "one Authorization header" in body["error"]["message"]
        for salt in ("", "x" * 257, "a\nb"):
            bad = json.dumps({**json.loads(chat), "cache_salt": salt}).encode()
            status, body = raw_post(
                url, "/v1/chat/completions", bad, [("Authorization", "Bearer key-bob")]
            )
            assert status == 400 and body["error"]["param"] == "cache_salt", body
        alice = client(url, "key-alice-1")
        first = alice.responses.create(
            model="llama", input="Remember the number 7.", max_output_tokens=1
        )
        again = client(url, "key-alice-2").responses.create(
            model="llama", input="Which number?", previous_response_id=first.id, max_output_tokens=1
        )
        assert again.id and again.status in ("completed", "incomplete")  # same tenant, other key
        with pytest.raises(openai.NotFoundError, match="is not kept"):
            client(url, "key-bob").responses.create(
                model="llama",
                input="Which number?",
                previous_response_id=first.id,
                max_output_tokens=1,
            )
