"""The cold store's accounting: never over budget, victims by policy, honest statistics."""

from __future__ import annotations

from contextlib import ExitStack

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt import (
    CacheClass,
    ColdBlock,
    ColdBlockMeta,
    ColdKey,
    ColdStoreFullError,
    KvrtError,
    policies,
)
from kvrt._cold import ColdEntry, ColdStore, token_digest


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
                e.n_bytes for e in (store.lookup(k) for k in list(store.ram._slots)) if e
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


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(100, 3000),
    steps=st.lists(st.tuples(st.integers(1, 800), st.booleans()), min_size=1, max_size=30),
)
def test_pinned_entries_are_never_dropped(budget: int, steps: list[tuple[int, bool]]) -> None:
    """Whatever is pinned stays; a put that cannot fit without dropping it fails, bounded."""

    async def body(store: ColdStore) -> None:
        with ExitStack() as pins:
            held: list[ColdKey] = []
            for i, (size, pin) in enumerate(steps):
                e = entry(i, size)
                free = budget - sum(_peeked(store, k).n_bytes for k in held)
                try:
                    ok = await store.put(e, wait=0.0)
                except ColdStoreFullError:
                    assert size > free  # only when the pinned entries leave no room
                    continue
                assert ok == (size <= budget)
                assert ok or size > budget
                if ok and pin:
                    pins.enter_context(store.pinned([e.key]))
                    held.append(e.key)
                assert all(k in store for k in held)
                stats = store.stats()
                assert stats.bytes <= budget and stats.pinned == len(held)
                # The token index covers exactly the entries present.
                indexed = {k for keys in store.ram._by_tokens.values() for k in keys}
                assert indexed == set(store.ram._slots)
        assert store.stats().pinned == 0

    anyio.run(with_store, budget, body)


@pytest.mark.anyio
async def test_full_store_waits_for_a_pin_then_commits() -> None:
    async def body(store: ColdStore) -> None:
        first = entry(0, 100)
        assert await store.put(first)
        late = entry(1, 100)
        with store.pinned([first.key]):
            with pytest.raises(ColdStoreFullError, match=r"stayed full for 0\.05 s"):
                await store.put(late, wait=0.05)
            assert store.stats().full_failures == 1

        async def release_soon(stack: ExitStack) -> None:
            await anyio.sleep(0.05)
            stack.close()

        stack = ExitStack()
        stack.enter_context(store.pinned([first.key]))
        async with anyio.create_task_group() as tg:
            tg.start_soon(release_soon, stack)
            assert await store.put(late, wait=5.0)  # waits for the pin, then drops ``first``
        assert late.key in store and first.key not in store
        assert store.stats().full_waits == 2

    await with_store(150, body)


@pytest.mark.anyio
async def test_similar_finds_the_same_tokens_after_another_prefix() -> None:
    async def body(store: ColdStore) -> None:
        e = entry(3, 10)  # tokens 0..15 at position 48 after prefix [3]
        assert await store.put(e)
        elsewhere = ColdKey("f", token_digest([9, 9]), e.key.tokens, 200)
        assert store.similar(elsewhere) is e
        assert store.similar(e.key) is None  # its own key is an exact hit, not a similar one
        other_model = ColdKey("g", elsewhere.prefix, e.key.tokens, 200)
        assert store.similar(other_model) is None
        assert store.stats().approximate_hits == 1

    await with_store(100, body)


def _peeked(store: ColdStore, key: ColdKey) -> ColdEntry:
    found = store.peek(key)
    assert found is not None
    return found


@pytest.mark.anyio
async def test_a_claim_holds_its_keys_until_released_and_leaves_others_claims_alone(
    anyio_backend: str,
) -> None:
    """A closing session's claim (:meth:`ColdStore.claim`) makes sessions placing the same
    blocks wait; a key already claimed stays with its first claim; releasing wakes the
    waiters once, and a second release does nothing."""

    async def body(store: ColdStore) -> None:
        a, b, c = (entry(i, 8).key for i in range(3))
        computing = store.claim([a])  # a session computing ``a``
        release = store.claim([a, b])
        first, claimed = store.computed(a), store.computed(b)
        assert first is not None and claimed is not None
        release()
        assert claimed.is_set() and store.computed(b) is None
        assert store.computed(a) is first and not first.is_set()  # the first claim's
        release()  # twice: nothing more
        assert store.computed(a) is first
        computing()
        assert first.is_set() and store.computed(a) is None and store.computed(c) is None

    await with_store(1000, body)
