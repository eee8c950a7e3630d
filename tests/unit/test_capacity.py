"""Capacity derivation: every branch, with hand-computed expectations."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrt import (
    CapacityInputs,
    LayerProfile,
    Limit,
    MemoryPolicy,
    MemoryReading,
    resolve_capacity,
)
from kvrt._engine.capacity import (
    DEFAULT_HOST_COLD_FRACTION,
    FALLBACK_CONTEXT,
    RESERVE_FLOOR_BYTES,
    tokens_for_bytes,
)

GiB = 1024**3
MiB = 1024**2
KVPT = 23040  # SmolLM2 f16


def inputs(**kw: object) -> CapacityInputs:
    base: dict[str, object] = dict(
        trained_context=8192,
        kv_bytes_per_token=KVPT,
        weight_bytes=100 * MiB,
        memory=MemoryReading(
            free_bytes=4 * GiB,
            total_bytes=8 * GiB,
            host_free_bytes=4 * GiB,
            host_total_bytes=8 * GiB,
            hot_in_host_memory=False,
        ),
        policy=MemoryPolicy(host_cold_bytes=0, reserve_bytes=512 * MiB, headroom=0.0),
    )
    base.update(kw)
    return CapacityInputs(**base)  # type: ignore[arg-type]


def test_memory_bounds_hot_window_exactly() -> None:
    cap = resolve_capacity(inputs(trained_context=1_000_000))
    usable = 4 * GiB - 512 * MiB
    assert cap.usable_bytes == usable
    assert cap.hot_context_tokens == (usable - 100 * MiB) // KVPT
    assert cap.hot_limited_by == (Limit.MEMORY,)


def test_headroom_shrinks_usable() -> None:
    cap = resolve_capacity(
        inputs(policy=MemoryPolicy(host_cold_bytes=0, reserve_bytes=512 * MiB, headroom=0.25))
    )
    assert cap.usable_bytes == int((4 * GiB - 512 * MiB) * 0.75)
    assert cap.headroom == 0.25


def test_trained_context_bounds_hot_when_memory_is_plenty() -> None:
    cap = resolve_capacity(inputs())
    assert cap.hot_context_tokens == 8192
    assert cap.hot_limited_by == (Limit.TRAINED_CONTEXT,)
    assert cap.effective_context == cap.hot_context_tokens


def test_request_caps_hot_and_planner() -> None:
    cap = resolve_capacity(
        inputs(
            request_context=2000,
            policy=MemoryPolicy(host_cold_bytes=GiB, reserve_bytes=512 * MiB, headroom=0.0),
        )
    )
    assert cap.hot_context_tokens == 2000
    assert cap.planner_effective_context == 2000
    assert Limit.REQUEST in cap.hot_limited_by
    assert Limit.REQUEST in cap.planner_limited_by


def test_hot_cap_bounds_hot_but_not_planner() -> None:
    cap = resolve_capacity(
        inputs(
            hot_cap_tokens=512,
            policy=MemoryPolicy(host_cold_bytes=GiB, reserve_bytes=512 * MiB, headroom=0.0),
        )
    )
    assert cap.hot_context_tokens == 512
    assert cap.hot_limited_by == (Limit.HOT_CAP,)
    assert cap.planner_effective_context == 8192  # hot + 46k cold tokens, clamped to trained


def test_user_memory_cap_below_free_memory() -> None:
    cap = resolve_capacity(
        inputs(
            trained_context=10**7,
            policy=MemoryPolicy(
                max_bytes=GiB, host_cold_bytes=0, reserve_bytes=512 * MiB, headroom=0.0
            ),
        )
    )
    assert cap.usable_bytes == GiB - 512 * MiB
    assert cap.hot_context_tokens == (GiB - 512 * MiB - 100 * MiB) // KVPT


def test_cold_budget_grows_planner_context() -> None:
    cold = 64 * MiB
    cap = resolve_capacity(
        inputs(
            hot_cap_tokens=1000,
            policy=MemoryPolicy(host_cold_bytes=cold, reserve_bytes=512 * MiB, headroom=0.0),
        )
    )
    assert cap.cold_store_tokens == cold // KVPT
    assert cap.planner_effective_context == 1000 + cold // KVPT
    assert cap.planner_limited_by == (Limit.COLD_BUDGET,)
    assert cap.host_cold_budget_bytes == cold


def test_cold_budget_never_passes_trained_context() -> None:
    cap = resolve_capacity(
        inputs(
            hot_cap_tokens=1000,
            policy=MemoryPolicy(host_cold_bytes=100 * GiB, reserve_bytes=512 * MiB, headroom=0.0),
        )
    )
    assert cap.planner_effective_context == 8192
    assert cap.planner_limited_by == (Limit.TRAINED_CONTEXT,)


def test_sparse_attention_may_pass_trained_context() -> None:
    cap = resolve_capacity(
        inputs(
            hot_cap_tokens=1000,
            sparse_beyond_trained=True,
            policy=MemoryPolicy(host_cold_bytes=GiB, reserve_bytes=512 * MiB, headroom=0.0),
        )
    )
    assert cap.planner_effective_context == 1000 + GiB // KVPT


def test_default_cold_budget_is_a_quarter_of_free_host_ram() -> None:
    cap = resolve_capacity(inputs(policy=MemoryPolicy(reserve_bytes=512 * MiB, headroom=0.0)))
    assert cap.host_cold_budget_bytes == int(4 * GiB * DEFAULT_HOST_COLD_FRACTION)


def test_shared_host_memory_takes_cold_budget_out_of_hot() -> None:
    mem = MemoryReading(
        free_bytes=GiB,
        total_bytes=8 * GiB,
        host_free_bytes=GiB,
        host_total_bytes=8 * GiB,
        hot_in_host_memory=True,
    )
    apart = resolve_capacity(
        inputs(
            trained_context=10**7,
            memory=MemoryReading(
                **{
                    **{f: getattr(mem, f) for f in mem.__struct_fields__},
                    "hot_in_host_memory": False,
                }
            ),
            policy=MemoryPolicy(host_cold_bytes=256 * MiB, reserve_bytes=256 * MiB, headroom=0.0),
        )
    )
    shared = resolve_capacity(
        inputs(
            trained_context=10**7,
            memory=mem,
            policy=MemoryPolicy(host_cold_bytes=256 * MiB, reserve_bytes=256 * MiB, headroom=0.0),
        )
    )
    assert apart.hot_context_tokens - shared.hot_context_tokens == pytest.approx(
        256 * MiB / KVPT, abs=1
    )


def test_reserve_floor_applies() -> None:
    cap = resolve_capacity(
        inputs(policy=MemoryPolicy(reserve_bytes=0, host_cold_bytes=0, headroom=0.0))
    )
    assert cap.reserve_bytes == RESERVE_FLOOR_BYTES
    assert any("floor" in n for n in cap.notes)


def test_reserve_floor_is_bounded_on_tiny_machines() -> None:
    mem = MemoryReading(free_bytes=512 * MiB, total_bytes=512 * MiB)
    cap = resolve_capacity(
        inputs(memory=mem, policy=MemoryPolicy(reserve_bytes=0, host_cold_bytes=0))
    )
    assert cap.reserve_bytes == 128 * MiB


def test_default_reserve_is_five_percent_of_total() -> None:
    cap = resolve_capacity(inputs(policy=MemoryPolicy(host_cold_bytes=0, headroom=0.0)))
    assert cap.reserve_bytes == int(8 * GiB * 0.05)


def test_unknown_memory_degrades_to_model_bound() -> None:
    cap = resolve_capacity(inputs(memory=MemoryReading()))
    assert cap.usable_bytes is None
    assert cap.hot_context_tokens == 8192
    assert cap.host_cold_budget_bytes == 0
    assert any("free memory unknown" in n for n in cap.notes)


def test_unknown_kv_size_degrades() -> None:
    cap = resolve_capacity(
        inputs(kv_bytes_per_token=None, policy=MemoryPolicy(host_cold_bytes=GiB))
    )
    assert cap.hot_context_tokens == 8192
    assert cap.cold_store_tokens == 0
    assert cap.kv_bytes_per_token is None
    assert any("KV bytes per token unknown" in n for n in cap.notes)


def test_unknown_weights_count_as_zero() -> None:
    cap = resolve_capacity(inputs(weight_bytes=None, trained_context=10**7))
    assert cap.hot_context_tokens == (4 * GiB - 512 * MiB) // KVPT
    assert any("weight size unknown" in n for n in cap.notes)


def test_nothing_known_falls_back() -> None:
    cap = resolve_capacity(CapacityInputs())
    assert cap.hot_context_tokens == FALLBACK_CONTEXT
    assert cap.hot_limited_by == (Limit.FALLBACK,)


def test_memory_exhausted_gives_zero_hot_tokens() -> None:
    mem = MemoryReading(free_bytes=300 * MiB, total_bytes=8 * GiB)
    cap = resolve_capacity(inputs(memory=mem))
    assert cap.hot_context_tokens == 0
    assert any("no room" in n for n in cap.notes)


def test_sliding_window_layers_cost_at_most_the_window() -> None:
    layers = LayerProfile(n_layers=6, n_swa_layers=5, sliding_window=512)
    budget = 2000 * KVPT
    # 512 tokens cost the full per-token price; past the window only 1 of 6 layers grows.
    assert tokens_for_bytes(budget, KVPT, layers) == 512 + int((budget - 512 * KVPT) // (KVPT / 6))
    assert tokens_for_bytes(100 * KVPT, KVPT, layers) == 100
    full = LayerProfile(n_layers=6, n_swa_layers=5, sliding_window=512, swa_full=True)
    assert tokens_for_bytes(budget, KVPT, full) == 2000


@given(
    free=st.integers(0, 64 * GiB),
    cold=st.integers(0, 64 * GiB),
    request=st.none() | st.integers(1, 10**6),
    cap_tokens=st.none() | st.integers(1, 10**6),
    trained=st.none() | st.integers(1, 10**6),
)
def test_invariants(
    free: int, cold: int, request: int | None, cap_tokens: int | None, trained: int | None
) -> None:
    cap = resolve_capacity(
        CapacityInputs(
            trained_context=trained,
            kv_bytes_per_token=KVPT,
            weight_bytes=0,
            request_context=request,
            hot_cap_tokens=cap_tokens,
            memory=MemoryReading(free_bytes=free, total_bytes=64 * GiB, host_free_bytes=free),
            policy=MemoryPolicy(host_cold_bytes=cold),
        )
    )
    assert 0 <= cap.hot_context_tokens <= cap.planner_effective_context
    for bound in (trained, request):
        if bound is not None:
            assert cap.planner_effective_context <= max(bound, cap.hot_context_tokens)
            assert cap.hot_context_tokens <= bound
    if cap_tokens is not None:
        assert cap.hot_context_tokens <= cap_tokens
    assert cap.planner_effective_context <= cap.hot_context_tokens + cold // KVPT
