"""The cold store's parts, public so that a benchmark (``kvrt bench``'s, or yours) can
time them one by one; a runtime assembles them itself from its config.

Every tier below RAM implements :class:`ColdTier` (``write``, ``read``, ``remove``...) and
keeps :class:`ColdEntry` values: immutable KV blocks under a content key
(:class:`kvrt.ColdKey`, its prefix digests made by :func:`token_digest`). kvrt's own tiers
are :class:`DiskTier` (one checked file per block, under :func:`default_disk_path`
unless told otherwise) and :class:`RemoteTier` (Redis/Valkey,
shared by hosts; with a :class:`Signer`, values sealed with the replicas' secret). A block
outside RAM is the bytes :func:`encode_block` writes and :func:`decode_block` checks. A
runtime's sessions share one :class:`ColdStore` (``Runtime.cold_store``): the RAM tier,
its budget and the traffic to the tiers below.
"""

from __future__ import annotations

from ._cold import ColdEntry as ColdEntry
from ._cold import ColdStore as ColdStore
from ._cold import ColdTier as ColdTier
from ._cold import DiskTier as DiskTier
from ._cold import RemoteTier as RemoteTier
from ._cold import Signer as Signer
from ._cold import default_disk_path as default_disk_path
from ._cold import token_digest as token_digest
from ._cold.blockfile import decode as decode_block
from ._cold.blockfile import encode as encode_block

__all__ = [
    "ColdEntry",
    "ColdStore",
    "ColdTier",
    "DiskTier",
    "RemoteTier",
    "Signer",
    "decode_block",
    "default_disk_path",
    "encode_block",
    "token_digest",
]
