"""Values replicas share through the remote server, besides blocks: what each trusts of
them is what it trusts of blocks (:mod:`~kvrt._cold.trust`): names are keyed hashes of
what a value holds, values carry the secret's tag, and one that fails it, or is larger
than its kind may be, is never used (counted, deleted).

The runtime's reply memory uses it, so a reply one replica generated is placed as it was
generated on every replica; ``kvrt serve`` keeps its API state there (kept responses,
conversations) when ``remote.url`` is set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from .._errors import SharedValueError
from .remote import RemoteTier, bounded_get
from .trust import ForgedValueError

if TYPE_CHECKING:
    import redis

__all__ = ["SharedStore"]

log = logging.getLogger("kvrt")
T = TypeVar("T")


class SharedStore:
    """Signed values on the remote server of a runtime (``Runtime.shared``).

    Each value has a *kind* (a short word: ``reply``, ``response`` ...) and an *identity*
    (bytes that say what it holds, tenant included); its name on the server derives from
    both and the secret. Every call is bounded by the remote tier's timeout; a server
    that is down answers None or False at once.
    """

    def __init__(self, tier: RemoteTier) -> None:
        self._tier = tier
        self.refused = 0
        """Values that failed their tag or size (never used, deleted)."""

    @property
    def signed(self) -> bool:
        """Whether values are signed with a shared secret (else every writer is trusted)."""
        return self._tier.signer.signed

    @property
    def tag_bytes(self) -> int:
        """Bytes a sealed value holds beyond the value itself (its tag)."""
        return int(self._tier.signer.tag_bytes)

    @property
    def up(self) -> bool:
        return self._tier.up

    def name(self, kind: str, ident: bytes) -> str:
        """The server's name of the value of ``kind`` that ``ident`` identifies."""
        return self._tier.signer.name(kind, ident)

    def seal(self, name: str, value: bytes) -> bytes:
        """``value`` as stored under ``name`` (with its tag, where values are signed)."""
        return self._tier.signer.seal(name, value)

    def open(self, name: str, stored: bytes) -> bytes:
        """The value sealed in ``stored`` under ``name``; a
        :class:`~kvrt.SharedValueError` (counted) if its tag fails."""
        try:
            return bytes(self._tier.signer.open(name, stored))
        except ForgedValueError as exc:
            self.refused += 1
            log.warning("kvrt: refused a shared value %s: %s", name, exc)
            raise SharedValueError(f"the shared value {name} was refused: {exc}") from None

    async def get(self, kind: str, ident: bytes, *, max_bytes: int) -> bytes | None:
        """The value, checked; None when absent or the server is down. One larger than
        ``max_bytes`` or whose tag fails is deleted and a :class:`~kvrt.SharedValueError`
        (counted): it is never used."""
        name = self.name(kind, ident)
        limit = max_bytes + self._tier.signer.tag_bytes
        got = await self.run("read", partial(bounded_get, name=name, limit=limit))
        if got is None:
            return None
        size, raw = got
        if not size:
            return None
        try:
            if size > limit:
                self.refused += 1
                log.warning("kvrt: refused a shared value %s of %d bytes", name, size)
                raise SharedValueError(
                    f"the shared value {name} holds {size} bytes, more than its kind's {limit}"
                )
            return self.open(name, raw)
        except SharedValueError:
            await self.run("delete", lambda client: client.delete(name))
            raise

    async def put(self, kind: str, ident: bytes, value: bytes, *, ttl: float | None = None) -> bool:
        """Store ``value`` (replacing what was there), for ``ttl`` seconds if given; True
        once the server holds it."""
        name = self.name(kind, ident)
        sealed = self.seal(name, value)
        expire = None if ttl is None else max(1, int(ttl))
        done = await self.run("write", lambda client: client.set(name, sealed, ex=expire))
        return bool(done)

    async def delete(self, kind: str, ident: bytes) -> bool:
        """Delete the value; whether the call reached the server."""
        name = self.name(kind, ident)
        return await self.run("delete", lambda client: client.delete(name)) is not None

    async def run(self, what: str, fn: Callable[[redis.Redis], T]) -> T | None:
        """Run ``fn(client)`` in a worker thread (a pipeline, a script); None when it fails
        (counted, the server marked down if it did not answer)."""
        client = self._tier.client
        return await self._tier.call(what, lambda: fn(client))
