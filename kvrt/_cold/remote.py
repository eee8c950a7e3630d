"""The remote tier: blocks shared by many hosts through a Redis or Valkey server.

A block's name is a keyed hash of its identity (see :mod:`~kvrt._cold.trust`): the same
on every host, whatever its settings (context size, hot window), and, with a shared
secret, impossible to compute or read anything from without it. Values are the
:mod:`~kvrt._cold.blockfile` bytes, sealed with the secret's tag, checked on read as a
disk file is: a value whose size is past what a block of this model can be is refused
before it is fetched (``STRLEN``, then a bounded ``GETRANGE``); one that fails its tag,
its checksum or its key is refused; both are counted and deleted, so the block is
computed and written again. Values are written once (``SET NX``); eviction is left to the
server's ``maxmemory-policy``.

The client is redis-py's synchronous one, run in worker threads through anyio (so the
tier works the same on asyncio and trio), with bounded socket timeouts; checking a value
(its tag, its checksum) happens in that thread too. A server that stops answering is
marked down for ``retry_after`` seconds: the store carries on with its local tiers, the
failure shows in :class:`RemoteStats`, and nothing waits on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import msgspec
import numpy as np

from .._threads import in_thread
from . import blockfile
from .entry import ColdEntry, ColdKey
from .trust import ForgedValueError, Signer

if TYPE_CHECKING:
    import redis  # imported where a remote tier is made: 10 MiB a server without one saves

__all__ = ["RemoteStats", "RemoteTier", "bounded_get", "redis_client"]

log = logging.getLogger("kvrt")
T = TypeVar("T")

UNTRUSTED = (
    "the remote tier has no shared secret (KVRT_REMOTE_SECRET or remote.secret_file): it "
    "trusts every writer of {url}, whose blocks are restored as they are"
)


class RemoteStats(msgspec.Struct, frozen=True, kw_only=True):
    """The remote tier's figures."""

    url: str
    """The server (without its password)."""
    up: bool
    """False while the server is considered down (after a failed call)."""
    signed: bool
    """Blocks are named and sealed with a shared secret; False: every writer is trusted."""
    hits: int
    """Blocks read back and verified."""
    found: int
    """Blocks learnt to be on the server (by a lookup before placing a context)."""
    writes: int
    """Blocks written (``SET NX``)."""
    refused: int
    """Values that failed a check (damaged: never served), and calls the server answered
    with an error about the key (a value of another type under a kvrt name, a write
    refused by a full server): skipped, the tier stays up."""
    forged: int
    """Values whose tag did not match the secret (written without it, altered or moved
    under another name): never served, deleted."""
    oversized: int
    """Values larger than any block of this model, refused before they were fetched."""
    discarded: int
    """Blocks deleted from the server after the engine rejected them."""
    errors: int
    """Calls that failed (connection refused, timeout)."""
    warning: str | None
    """Why the tier is degraded, or that it trusts every writer."""


def redis_client(url: str, *, timeout: float, ca_file: str | None = None) -> redis.Redis:
    """A client for ``url`` (``rediss://`` for TLS, checked against ``ca_file`` when
    given), with bounded socket timeouts."""
    import redis

    extra: dict[str, Any] = {}
    if ca_file is not None:
        extra["ssl_ca_certs"] = ca_file
    return redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, **extra
    )


def bounded_get(client: Any, name: str, limit: int) -> tuple[int, Any]:
    """A value's size, and at most ``limit`` bytes of it, in one round trip (a value past
    the limit is never fetched whole)."""
    pipe = client.pipeline(transaction=False)
    pipe.strlen(name)
    pipe.getrange(name, 0, limit - 1)
    size, raw = pipe.execute()
    return int(size), raw


def safe_url(url: str) -> str:
    """``url`` without its user and password."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url.rpartition("@")[2]


class RemoteTier:
    """Blocks in a Redis/Valkey server at ``url``: a :class:`~kvrt._cold.tier.ColdTier`.

    ``signer`` names and seals values (no secret: plain names, every writer trusted);
    ``max_value_bytes`` is the most a value may hold (a block of this model, its logits
    and its tag): a larger one is refused unread.
    """

    name: Final = "remote"

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 2.0,
        retry_after: float = 5.0,
        signer: Signer | None = None,
        max_value_bytes: int = 1 << 30,
        ca_file: str | None = None,
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.retry_after = retry_after
        self.signer = signer or Signer(None)
        self.max_value_bytes = max_value_bytes
        self.client = redis_client(url, timeout=timeout, ca_file=ca_file)
        self._limiter = anyio.CapacityLimiter(4)
        self._known: set[ColdKey] = set()
        self._down_until = 0.0
        self.hits = self.found = self.writes = self.refused = self.errors = 0
        self.forged = self.oversized = self.discarded = 0
        self.warning: str | None = None
        self._trust_note = None if self.signer.signed else UNTRUSTED.format(url=safe_url(url))
        if self._trust_note is not None:
            log.warning("kvrt: %s", self._trust_note)

    def __contains__(self, key: object) -> bool:
        return key in self._known

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def key_name(self, key: ColdKey) -> str:
        """The name of ``key``'s value on the server."""
        return self.signer.name("blk", key.digest().encode())

    def stats(self) -> RemoteStats:
        return RemoteStats(
            url=safe_url(self.url),
            up=self.up,
            signed=self.signer.signed,
            hits=self.hits,
            found=self.found,
            writes=self.writes,
            refused=self.refused,
            forged=self.forged,
            oversized=self.oversized,
            discarded=self.discarded,
            errors=self.errors,
            warning=self.warning or self._trust_note,
        )

    def size(self, key: ColdKey) -> int | None:
        """Not known without a round trip."""
        return None

    def left_ram(self, key: ColdKey) -> None:
        """Not counted here: the disk tier, if any, counts blocks kept as tokens only."""

    def close(self) -> None:
        self.client.close()

    async def call(self, what: str, fn: Callable[[], T]) -> T | None:
        """Run one client call in a thread; None if it fails. A server that answered
        with an error about the key (a value of another type under a kvrt name, a full
        server refusing a write) leaves the tier up; one that did not answer marks it
        down for ``retry_after`` seconds."""
        if not self.up:
            return None
        import redis  # loaded with the client (redis_client)

        try:
            # A kvrt error the call raises (a state store's refusal) comes back without
            # the worker's traceback: no reference cycle keeps what the call was given.
            return await in_thread(fn, limiter=self._limiter)
        except redis.ResponseError as exc:
            self.refused += 1
            self.warning = f"the remote tier refused a {what}: {exc}"
            log.warning("kvrt: %s", self.warning)
            return None
        except redis.RedisError as exc:
            self.errors += 1
            self._down_until = time.monotonic() + self.retry_after
            self.warning = (
                f"remote tier {safe_url(self.url)} failed ({what}: {exc}); "
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
            pipe = self.client.pipeline(transaction=False)
            for k in ask:
                pipe.exists(self.key_name(k))
            return list(pipe.execute())

        answer = await self.call("lookup", exists)
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
        name = self.key_name(entry.key)
        head, payload = blockfile.encode(entry)
        done = await self.call("write", partial(self._seal_and_set, name, head, payload))
        if done is None:
            return False
        self._known.add(entry.key)
        self.writes += 1
        self._recovered()
        return True

    def _seal_and_set(self, name: str, head: bytes, payload: memoryview) -> bool:
        self.client.set(name, self.signer.seal(name, head, payload), nx=True)
        return True

    async def read(self, key: ColdKey) -> ColdEntry | None:
        """The verified block under ``key``; None if the server lacks it, is down, or
        holds a value that fails a check (refused, counted and deleted)."""
        name = self.key_name(key)
        got = await self.call("read", partial(self._fetch, name, key))
        if got is None:
            self._known.discard(key)
            return None
        self._recovered()
        entry, problem = got
        if entry is not None:
            self.hits += 1
            return entry
        self._known.discard(key)
        if problem is not None:
            kind, why = problem
            if kind == "forged":
                self.forged += 1
            elif kind == "oversized":
                self.oversized += 1
            else:
                self.refused += 1
            self.warning = f"refused a {kind} value for {name}: {why}"
            log.warning("kvrt: %s", self.warning)
        return None

    def _fetch(self, name: str, key: ColdKey) -> tuple[ColdEntry | None, tuple[str, str] | None]:
        """In a worker thread: the value's size, then at most ``max_value_bytes`` of it,
        checked (tag, checksum, key). A value that fails is deleted."""
        size, raw = bounded_get(self.client, name, self.max_value_bytes)
        if not size:
            return None, None
        problem: tuple[str, str]
        if size > self.max_value_bytes:
            problem = ("oversized", f"{size} bytes, more than a block's {self.max_value_bytes}")
        else:
            try:
                body = self.signer.open(name, raw)
                buf = np.frombuffer(body, dtype=np.uint8).copy()
                return blockfile.decode(buf, expect=key), None
            except ForgedValueError as exc:
                problem = ("forged", str(exc))
            except blockfile.CorruptBlockError as exc:
                problem = ("damaged", str(exc))
        self.client.delete(name)
        return None, problem

    async def discard(self, key: ColdKey) -> None:
        """Delete the block under ``key`` (the engine rejected its bytes)."""
        self._known.discard(key)
        if await self.call("delete", partial(self.client.delete, self.key_name(key))):
            self.discarded += 1

    def _recovered(self) -> None:
        if self.warning is not None and self.warning.startswith("remote tier"):
            self.warning = None
