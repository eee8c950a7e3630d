"""Users kept apart: a cache salt scopes every reuse, so one user cannot learn another's
prompt through the cache.

The attack this guards against is measured, not assumed: a client that knows how another
client's system prompt begins sends that beginning plus one guessed character at a time;
where the cache is shared, the right guess reuses one token more (and comes back sooner).
Within one scope the attack works here (so the test can fail); across salts it learns
nothing.
"""

from __future__ import annotations

import pytest

import kvrt
from kvrt import Segment
from tests.support.models import NO_DISK, tiny
from tests.support.tenants import PIN, PREFIX, SECRET

pytestmark = pytest.mark.anyio


async def guess_the_pin(
    rt: kvrt.Runtime, victim: str | None, attacker: str | None
) -> tuple[str, list[list[int]]]:
    """The victim's session holds the secret; the attacker guesses it digit by digit from
    how many tokens each guess reuses. What it recovered (stops at the first tie) and the
    counts it saw."""
    async with rt.open_session(hot_tokens=512, cache_salt=victim) as s:
        await s.ensure_context([Segment("system", SECRET), Segment("user", "Hello")])
    known, seen = "", []
    for _ in PIN:
        counts = []
        for digit in "0123456789":
            async with rt.open_session(hot_tokens=512, cache_salt=attacker) as s:
                guess = [Segment("system", PREFIX + known + digit + "?"), Segment("user", "Hi")]
                status = await s.ensure_context(guess)
                counts.append(status.reused_tokens + status.restored_tokens)
        seen.append(counts)
        best = max(counts)
        if counts.count(best) != 1:
            break
        known += str(counts.index(best))
    return known, seen


@pytest.mark.parametrize(
    ("victim", "attacker", "learns"),
    [
        (None, None, True),  # no salt: one user's machine, everything shared
        ("tenant-a", "tenant-a", True),  # one scope
        ("tenant-a", "tenant-b", False),
        ("tenant-a", None, False),
        (None, "tenant-b", False),
    ],
)
async def test_a_cache_salt_stops_a_prompt_being_guessed_through_the_cache(
    victim: str | None, attacker: str | None, learns: bool
) -> None:
    async with kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt:
        found, seen = await guess_the_pin(rt, victim, attacker)
    if learns:
        assert found == PIN, seen
    else:
        assert found == "", seen  # no guess stood out, not even the first


async def test_a_bad_cache_salt_is_refused() -> None:
    async with kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt:
        for bad, match in (
            ("", "cache_salt must not be empty"),
            ("x" * 257, "cache_salt holds 257 characters; at most 256"),
            ("a\nb", "cache_salt must be printable"),
        ):
            with pytest.raises(kvrt.InvalidArgumentError, match=match):
                async with rt.open_session(cache_salt=bad):
                    pass
        with pytest.raises(kvrt.ArgumentTypeError, match="cache_salt must be a str"):
            async with rt.open_session(cache_salt=7):  # type: ignore[arg-type]
                pass


async def test_salted_blocks_on_disk_come_back_only_under_their_salt(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The salt is part of each block's identity: after a restart the disk tier serves a
    salt's blocks to that salt alone."""
    config = kvrt.load_config(flags={"disk.path": str(tmp_path / "blocks")})
    context = [Segment("system", SECRET), Segment("user", "Hello")]
    async with (
        kvrt.open_runtime(engine=tiny(), config=config) as rt,
        rt.open_session(hot_tokens=512, cache_salt="tenant-a", write_through="all") as s,
    ):
        await s.ensure_context(context)
    for salt, restored in (("tenant-a", True), ("tenant-b", False), (None, False)):
        async with (
            kvrt.open_runtime(engine=tiny(), config=config) as rt,
            rt.open_session(hot_tokens=512, cache_salt=salt) as s,
        ):
            status = await s.ensure_context(context)
            assert (status.restored_tokens > 0) is restored, (salt, status)


async def test_remembered_replies_stay_with_their_salt() -> None:
    """A reply sent back is placed with the tokens generated for it only by sessions of
    the salt that generated it."""
    async with kvrt.open_runtime(engine=tiny(), config=NO_DISK) as rt:
        async with rt.open_session(hot_tokens=512, cache_salt="tenant-a") as s:
            await s.ensure_context([Segment("user", "Say something.")])
            reply = await s.generate(6, stop_at_end=False)
        memory = rt._replies
        assert memory.scoped("tenant-a").lookup(reply.text) is not None
        assert memory.scoped("tenant-b").lookup(reply.text) is None
        assert memory.scoped(None).lookup(reply.text) is None
