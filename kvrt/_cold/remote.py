"""The remote tier: blocks shared by many hosts through a Redis or Valkey server.

Keys are ``kvrt:v1:<fingerprint>:<prefix digest>:<token digest>:<start>`` — the block's
identity and nothing of the instance (context size, hot window), so hosts with different
settings share. Values are the :mod:`~kvrt._cold.blockfile` bytes, checked on read exactly
as a disk file is (a value altered in the server is refused and counted). Values are
written once (``SET NX``); eviction is left to the server's ``maxmemory-policy``.

The client is redis-py's synchronous one, run in worker threads through anyio (so the
tier works the same on asyncio and trio), with bounded socket timeouts. A server that
stops answering is marked down for ``retry_after`` seconds: the store carries on with its
local tiers, the failure shows in :class:`RemoteStats`, and nothing waits on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final, TypeVar

import anyio
import msgspec
import numpy as np
import redis

from . import blockfile
from .entry import ColdEntry, ColdKey

__all__ = ["RemoteStats", "RemoteTier"]

log = logging.getLogger("kvrt")
T = TypeVar("T")


class RemoteStats(msgspec.Struct, frozen=True, kw_only=True):
    """The remote tier's figures."""

    url: str
    """The server (without its password)."""
    up: bool
    """False while the server is considered down (after a failed call)."""
    hits: int
    """Blocks read back and verified."""
    found: int
    """Blocks learnt to be on the server (by a lookup before placing a context)."""
    writes: int
    """Blocks written (``SET NX``)."""
    refused: int
    """Values that failed a check (damaged or altered: never served), and calls the
    server answered with an error about the key (a value of another type under a kvrt
    name, a write refused by a full server): skipped, the tier stays up."""
    errors: int
    """Calls that failed (connection refused, timeout)."""
    warning: str | None
    """Why the tier is degraded, if it is."""


def key_name(key: ColdKey) -> str:
    return f"kvrt:v1:{key.fingerprint}:{key.prefix}:{key.tokens}:{key.start}"


class RemoteTier:
    """Blocks in a Redis/Valkey server at ``url``: a :class:`~kvrt._cold.tier.ColdTier`."""

    name: Final = "remote"

    def __init__(self, url: str, *, timeout: float = 2.0, retry_after: float = 5.0) -> None:
        self.url = url
        self.timeout = timeout
        self.retry_after = retry_after
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self._limiter = anyio.CapacityLimiter(4)
        self._known: set[ColdKey] = set()
        self._down_until = 0.0
        self.hits = self.found = self.writes = self.refused = self.errors = 0
        self.warning: str | None = None

    def __contains__(self, key: object) -> bool:
        return key in self._known

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def stats(self) -> RemoteStats:
        safe = self.url.split("@")[-1] if "@" in self.url else self.url
        return RemoteStats(
            url=safe,
            up=self.up,
            hits=self.hits,
            found=self.found,
            writes=self.writes,
            refused=self.refused,
            errors=self.errors,
            warning=self.warning,
        )

    def size(self, key: ColdKey) -> int | None:
        """Not known without a round trip."""
        return None

    def left_ram(self, key: ColdKey) -> None:
        """Not counted here: the disk tier, if any, counts blocks kept as tokens only."""

    def close(self) -> None:
        self._client.close()

    async def _call(self, what: str, fn: Callable[[], T]) -> T | None:
        """Run one client call in a thread; None if it fails. A server that answered
        with an error about the key (a value of another type under a kvrt name, a full
        server refusing a write) leaves the tier up; one that did not answer marks it
        down for ``retry_after`` seconds."""
        if not self.up:
            return None
        try:
            return await anyio.to_thread.run_sync(fn, limiter=self._limiter)
        except redis.ResponseError as exc:
            self.refused += 1
            self.warning = f"the remote tier refused a {what}: {exc}"
            log.warning("kvrt: %s", self.warning)
            return None
        except redis.RedisError as exc:
            self.errors += 1
            self._down_until = time.monotonic() + self.retry_after
            self.warning = (
                f"remote tier {self.stats().url} failed ({what}: {exc}); "
                f"using the local tiers, next try in {self.retry_after:g} s"
            )
            log.warning("kvrt: %s", self.warning)
            return None

    async def discover(self, keys: Sequence[ColdKey]) -> int:
        """Learn which of ``keys`` the server holds (one round trip); how many it does."""
        ask = [k for k in keys if k not in self._known]
        if not ask:
            return 0

        def exists() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for k in ask:
                pipe.exists(key_name(k))
            return list(pipe.execute())

        answer = await self._call("lookup", exists)
        if not isinstance(answer, list):
            return 0
        found = [k for k, n in zip(ask, answer, strict=True) if n]
        self._known.update(found)
        self.found += len(found)
        self._recovered()
        return len(found)

    async def write(self, entry: ColdEntry) -> bool:
        """Store ``entry`` once; True if the server now holds it."""
        if entry.key in self._known:
            return True
        head, payload = blockfile.encode(entry)
        value = head + bytes(payload)
        done = await self._call("write", partial(self._set_once, key_name(entry.key), value))
        if done is None:
            return False
        self._known.add(entry.key)
        self.writes += 1
        self._recovered()
        return True

    def _set_once(self, name: str, value: bytes) -> bool:
        self._client.set(name, value, nx=True)
        return True

    async def read(self, key: ColdKey) -> ColdEntry | None:
        """The verified block under ``key``; None if the server lacks it, is down, or
        holds a value that fails a check (refused, counted)."""
        raw = await self._call("read", partial(self._client.get, key_name(key)))
        if not isinstance(raw, bytes):
            self._known.discard(key)
            return None
        self._recovered()
        buf = np.frombuffer(raw, dtype=np.uint8).copy()
        try:
            entry = blockfile.decode(buf, expect=key)
        except blockfile.CorruptBlockError as exc:
            self._known.discard(key)
            self.refused += 1
            self.warning = f"refused a damaged value for {key_name(key)}: {exc}"
            log.warning("kvrt: %s", self.warning)
            return None
        self.hits += 1
        return entry

    def _recovered(self) -> None:
        if self.warning is not None and self.warning.startswith("remote tier"):
            self.warning = None
