"""What every tier of the cold store holds: immutable KV blocks under a content key."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from .._engine.contract import ColdBlock, ColdBlockMeta
from .._types import CacheClass

__all__ = ["LONG_PREFIX", "PARTIAL_PREFIX", "ColdEntry", "ColdKey", "salted", "token_digest"]

PARTIAL_PREFIX = "pw"
"""How the prefix field of a partial-window block's key begins (an exact key's prefix is
a hex digest, which never does): see :mod:`kvrt._paging.provenance`."""

LONG_PREFIX = "lw"
"""How the prefix field of a long-context block's key begins: KV a session computed at
window positions of a context longer than the model's trained one (see
:mod:`kvrt._paging.long`)."""


def token_digest(tokens: Sequence[int], seed: bytes = b"", lone: Iterable[int] = ()) -> str:
    """A stable digest of a token sequence (optionally chained onto ``seed``) and of how
    its KV was computed: ``lone`` holds the offsets of the tokens computed alone, as a
    generated token is (the rest in batches). A token's KV computed alone has other bits
    than the same token's computed in a batch, and so does everything after it: the
    lineage is part of the identity of the block and of every block after it."""
    h = hashlib.blake2b(seed, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    alone = sorted(lone)
    if alone:
        h.update(b"\0lone\0")
        h.update(np.asarray(alone, dtype=np.int32).tobytes())
    return h.hexdigest()


def salted(fingerprint: str, salt: str | None) -> str:
    """The fingerprint a session's blocks carry under a cache salt: blocks are reused only
    between sessions of the same salt (the key's identity, so in every tier, on every host
    and after restarts). No salt: the fingerprint itself, shared by every unsalted session."""
    if salt is None:
        return fingerprint
    h = hashlib.blake2b(fingerprint.encode(), digest_size=16, person=b"kvrt cache salt")
    h.update(salt.encode())
    return h.hexdigest()


class ColdKey(msgspec.Struct, frozen=True):
    """Identity of a cold block: equal keys mean restoring equals never having evicted."""

    fingerprint: str
    """Model digest plus KV layout."""
    prefix: str
    """Digest of every logical token before the block, and of how each was computed."""
    tokens: str
    """Digest of the block's own tokens and of which were computed alone
    (:func:`token_digest`)."""
    start: int
    """Position of the block's first token."""

    @property
    def session_local(self) -> bool:
        """A partial-window block's key: KV computed while earlier blocks of its context
        were not hot, which only the session that computed it asks for. Such entries stay
        in RAM: never written to the tiers below, never an exact hit for anyone else.
        Long-context blocks (:attr:`spills`) are session-local too."""
        return self.prefix.startswith((PARTIAL_PREFIX, LONG_PREFIX))

    @property
    def spills(self) -> bool:
        """A long-context block's key: session-local KV that may go to the disk tier (a
        context as long as the tiers lives mostly there), never to a shared one."""
        return self.prefix.startswith(LONG_PREFIX)

    def digest(self) -> str:
        """One name for the key (hex), the same in every process: file names and remote keys."""
        h = hashlib.blake2b(digest_size=20)
        for part in (self.fingerprint, self.prefix, self.tokens, str(self.start)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()


@dataclass(frozen=True, slots=True)
class ColdEntry:
    """One immutable cold block: KV bytes plus what they belong to."""

    key: ColdKey
    cache_class: CacheClass
    block: ColdBlock
    logits: npt.NDArray[np.float32] | None = None
    """The logits after the block's last token, when the block ended its context and they
    were computed with exact KV: a session whose context ends there continues from them,
    as the session that computed them would have, instead of computing that token again
    (in another batch cut, which on some CPUs and engines gives other bits)."""
    lone: frozenset[int] = frozenset()
    """Offsets of the block's tokens whose KV was computed alone (a generated reply's),
    as its key's token digest holds them."""

    @property
    def n_bytes(self) -> int:
        """The bytes it holds: KV bytes, and its logits if it has them."""
        extra = 0 if self.logits is None else int(self.logits.nbytes)
        return int(self.block.data.size) + extra

    @property
    def meta(self) -> ColdBlockMeta:
        return self.block.meta

    @property
    def data(self) -> npt.NDArray[np.uint8]:
        return self.block.data
