"""A child process for the disk tier's tests: writes synthetic blocks through a cold store
whose RAM holds two, so every block is spilled to ``path``.

    python tests/support/disk_writer.py PATH FIRST LAST

Prints ``written N`` as the disk tier commits blocks, then ``done``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import numpy as np

from kvrt import CacheClass, ColdBlock, ColdBlockMeta, ColdKey, policies
from kvrt._cold import ColdEntry, ColdStore, DiskTier, token_digest

SIZE = 64 * 1024


def block(i: int) -> ColdEntry:
    """Block ``i``: its bytes and tokens follow from ``i`` alone, so a reader can check them."""
    tokens = tuple(range(i, i + 16))
    data = np.full(SIZE, i % 251, dtype=np.uint8)
    meta = ColdBlockMeta(fingerprint="f", kv_type="f16", start=i * 16, tokens=tokens, n_bytes=SIZE)
    key = ColdKey("f", token_digest([i]), token_digest(tokens), i * 16)
    return ColdEntry(key, CacheClass.VOLATILE, ColdBlock(meta=meta, data=data))


@asynccontextmanager
async def serving(store: ColdStore) -> AsyncIterator[ColdStore]:
    """``store`` with its service task running; closed (queued writes finished) on exit."""
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        try:
            yield store
        finally:
            store.close()


def disk_tier(path: str, budget: int = 1 << 30) -> DiskTier:
    return DiskTier(path, budget, "f", policies.get("cold_victim", "class_lru").order)


async def main(path: str, first: int, last: int) -> None:
    disk = disk_tier(path)
    disk.open()
    store = ColdStore(2 * SIZE, policies.get("cold_victim", "class_lru"), tiers=[disk])
    async with serving(store):
        for i in range(first, last):
            await store.put(block(i))
            print("written", disk.writes, flush=True)
    print("done", disk.writes, flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
