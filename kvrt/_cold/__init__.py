"""The cold store and its tiers, from the service down to the bytes.

- :mod:`.store` — the service sessions talk to: the RAM tier, its budget, pins, and the
  traffic to the tiers below (write-through, demotion, promotion);
- :mod:`.shared` — other values replicas share on the remote server (replies, API state);
- :mod:`.stats` — what the store and its tiers report;
- :mod:`.ram` — the RAM tier's entries and their budget;
- :mod:`.tier` — the protocol every tier below RAM implements, which the store knows them by;
- :mod:`.disk` — the disk tier: one file per block, crash-safe, rebuilt on open;
- :mod:`.remote` — the remote tier: blocks shared by many hosts through Redis/Valkey;
- :mod:`.trust` — names and tags that let a shared store be read without trusting it;
- :mod:`.blockfile` — a block's bytes outside RAM, checked before use;
- :mod:`.entry` — what every tier holds: immutable blocks under a content key.

Dependencies run one way, in the order of :data:`LAYERS`; the architecture test holds it."""

from .disk import BlockIO, DiskStats, DiskTier, default_disk_path
from .entry import LONG_PREFIX, PARTIAL_PREFIX, ColdEntry, ColdKey, salted, token_digest
from .remote import RemoteStats, RemoteTier
from .shared import SharedStore
from .stats import ColdStats
from .store import ColdStore, Fetched, Tier
from .tier import ColdTier
from .trust import ForgedValueError, Signer, load_secret

__all__ = [
    "LONG_PREFIX",
    "PARTIAL_PREFIX",
    "BlockIO",
    "ColdEntry",
    "ColdKey",
    "ColdStats",
    "ColdStore",
    "ColdTier",
    "DiskStats",
    "DiskTier",
    "Fetched",
    "ForgedValueError",
    "RemoteStats",
    "RemoteTier",
    "SharedStore",
    "Signer",
    "Tier",
    "default_disk_path",
    "load_secret",
    "salted",
    "token_digest",
]

LAYERS = (
    "store",
    "shared",
    "stats",
    "ram",
    "tier",
    "disk",
    "remote",
    "trust",
    "blockfile",
    "entry",
)
"""The modules from the top down: each imports only those after it."""
