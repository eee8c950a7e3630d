"""What every tier of the cold store holds: immutable KV blocks under a content key."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from .._backend import ColdBlock, ColdBlockMeta
from .._types import CacheClass

__all__ = ["ColdEntry", "ColdKey", "token_digest"]


def token_digest(tokens: Sequence[int], seed: bytes = b"") -> str:
    """A stable digest of a token sequence (optionally chained onto ``seed``)."""
    h = hashlib.blake2b(seed, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


class ColdKey(msgspec.Struct, frozen=True):
    """Identity of a cold block: equal keys mean restoring equals never having evicted."""

    fingerprint: str
    """Model digest plus KV layout."""
    prefix: str
    """Digest of every logical token before the block."""
    tokens: str
    """Digest of the block's own tokens."""
    start: int
    """Position of the block's first token."""

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

    @property
    def n_bytes(self) -> int:
        return int(self.block.data.size)

    @property
    def meta(self) -> ColdBlockMeta:
        return self.block.meta

    @property
    def data(self) -> npt.NDArray[np.uint8]:
        return self.block.data
