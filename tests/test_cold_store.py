"""The cold store's accounting: never over budget, victims by policy, honest statistics."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from kvrt import CacheClass, ColdBlock, ColdBlockMeta, ColdKey, KvrtError
from kvrt._cold_store import ColdEntry, ColdStore, token_digest


def entry(i: int, n_bytes: int, cache_class: CacheClass = CacheClass.VOLATILE) -> ColdEntry:
    data = np.full(n_bytes, i % 251, dtype=np.uint8)
    data.flags.writeable = False
    meta = ColdBlockMeta(
        fingerprint="f", kv_type="f16", start=i * 16, tokens=tuple(range(16)), n_bytes=n_bytes
    )
    key = ColdKey("f", token_digest([i]), token_digest(range(16)), i * 16)
    return ColdEntry(key, cache_class, ColdBlock(meta=meta, data=data))


async def with_store(budget: int, body):  # type: ignore[no-untyped-def]
    store = ColdStore(budget, policies.get("cold_victim", "class_lru"), queue_size=2)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        try:
            return await body(store)
        finally:
            store.close()


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(1, 5000),
    puts=st.lists(
        st.tuples(st.integers(1, 3000), st.sampled_from(list(CacheClass)), st.booleans()),
        max_size=40,
    ),
)
def test_never_over_budget_and_counts_add_up(
    budget: int, puts: list[tuple[int, CacheClass, bool]]
) -> None:
    async def body(store: ColdStore) -> None:
        committed = refused = 0
        for i, (size, cls, look) in enumerate(puts):
            ok = await store.put(entry(i, size, cls))
            assert ok == (size <= budget)
            committed += ok
            refused += not ok
            stats = store.stats()
            assert stats.bytes <= budget
            assert stats.bytes == sum(
                e.n_bytes for e in (store.lookup(k) for k in list(store._slots)) if e
            )
            if look and ok:
                assert store.lookup(entry(i, size, cls).key) is not None  # just committed: present
        stats = store.stats()
        assert stats.puts == committed and stats.refused == refused
        assert stats.entries == committed - stats.evictions

    anyio.run(with_store, budget, body)


@pytest.mark.anyio
async def test_victims_go_by_class_then_least_recently_used() -> None:
    async def body(store: ColdStore) -> None:
        pinned = entry(0, 100, CacheClass.TASK_PINNED)
        old = entry(1, 100)
        recent = entry(2, 100)
        for e in (pinned, old, recent):
            assert await store.put(e)
        assert store.lookup(old.key) is not None  # touching makes "recent" the older one
        assert await store.put(entry(3, 100))
        assert recent.key not in store and old.key in store and pinned.key in store
        assert await store.put(entry(4, 200))  # needs room for 200: both volatile go first
        assert pinned.key in store
        assert store.stats().evictions == 3

    await with_store(300, body)


@pytest.mark.anyio
async def test_put_of_a_present_key_is_a_touch() -> None:
    async def body(store: ColdStore) -> None:
        e = entry(0, 10)
        assert await store.put(e) and await store.put(e)
        assert store.stats().puts == 1 and store.stats().bytes == 10

    await with_store(100, body)


def test_zero_budget_is_refused() -> None:
    with pytest.raises(KvrtError, match="needs a budget above zero bytes"):
        ColdStore(0, policies.get("cold_victim", "class_lru"))
