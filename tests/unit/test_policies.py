"""Policies: pure ordering objects, checked as properties."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvrt
from kvrt import policies
from kvrt._types import BlockView, CacheClass, ColdEntryView

classes = st.sampled_from(list(CacheClass))


@st.composite
def block_views(draw: st.DrawFn) -> list[BlockView]:
    n = draw(st.integers(0, 30))
    return [
        BlockView(
            id=i,
            cache_class=draw(classes),
            start=draw(st.integers(0, 8192)),
            n_tokens=draw(st.integers(1, 256)),
            last_used=draw(st.integers(0, 50)),
            score=draw(st.none() | st.floats(-10, 10)),
        )
        for i in range(n)
    ]


@given(block_views())
def test_class_lru_orders_by_class_then_recency(blocks: list[BlockView]) -> None:
    order = policies.get("hot_eviction", "class_lru").order(blocks)
    assert sorted(order) == [b.id for b in blocks]
    by_id = {b.id: b for b in blocks}
    keys = [(by_id[i].cache_class.rank, by_id[i].last_used, by_id[i].start) for i in order]
    assert keys == sorted(keys)


@given(block_views())
def test_score_lru_puts_unscored_and_low_scores_first_within_a_class(
    blocks: list[BlockView],
) -> None:
    order = policies.get("hot_eviction", "score_lru").order(blocks)
    assert sorted(order) == [b.id for b in blocks]
    by_id = {b.id: b for b in blocks}
    ranked = [by_id[i] for i in order]
    for a, b in itertools.pairwise(ranked):
        assert a.cache_class.rank <= b.cache_class.rank
        if a.cache_class is b.cache_class:
            sa = float("-inf") if a.score is None else a.score
            sb = float("-inf") if b.score is None else b.score
            assert sa <= sb


@given(st.lists(st.tuples(classes, st.integers(1, 10**6), st.integers(0, 100)), max_size=30))
def test_cold_class_lru(entries: list[tuple[CacheClass, int, int]]) -> None:
    views = [
        ColdEntryView(id=i, cache_class=c, n_bytes=n, last_used=u)
        for i, (c, n, u) in enumerate(entries)
    ]
    order = policies.get("cold_victim", "class_lru").order(views)
    assert sorted(order) == list(range(len(views)))
    keys = [(views[i].cache_class.rank, views[i].last_used) for i in order]
    assert keys == sorted(keys)


def test_registry() -> None:
    assert policies.names("hot_eviction") == [
        "class_lru",
        "relevance",
        "relevance_lexical",
        "score_lru",
    ]
    with pytest.raises(
        KeyError,
        match="no hot_eviction policy named 'nope' \\(known: class_lru, relevance, "
        "relevance_lexical, score_lru\\)",
    ):
        policies.get("hot_eviction", "nope")
    with pytest.raises(ValueError, match="already registered"):
        policies.register("hot_eviction", "class_lru")(object)
    with pytest.raises(ValueError, match="without ':'"):
        policies.register("hot_eviction", "a:b")(object)


def test_a_policy_with_a_knob_takes_it_after_a_colon() -> None:
    from kvrt._types import ApproximateQuery

    blend = policies.get("approximate", "blend:0.3")
    assert isinstance(blend, policies.BlendApproximate) and blend.ratio == 0.3
    assert isinstance(blend, kvrt.policy.Blending)
    assert policies.get("approximate", "blend").ratio == policies.BlendApproximate.DEFAULT_RATIO
    query = ApproximateQuery(
        cache_class=CacheClass.VOLATILE, start=200, source_start=100, n_tokens=128, n_bytes=1
    )
    assert blend.accept(query) and blend.recompute_tokens(query) == 39  # ceil(0.3 * 128)
    # In a run of hits, the run's first ceil(0.3 * 1000) = 300 tokens are computed afresh.
    for start, fresh in ((100, 128), (228, 128), (356, 44), (484, 0)):
        in_run = msgspec.structs.replace(query, start=start, run_start=100, run_tokens=1000)
        assert blend.recompute_tokens(in_run) == fresh
    assert policies.get("approximate", "blend:0").recompute_tokens(query) == 0
    assert policies.get("approximate", "blend:1").recompute_tokens(query) == 128
    for bad in ("blend:1.5", "blend:-0.1", "blend:half", "blend:"):
        with pytest.raises(kvrt.ConfigError, match="blend ratio must be a number in \\[0, 1\\]"):
            policies.get("approximate", bad)
    with pytest.raises(kvrt.ConfigError, match="'allow' takes no argument"):
        policies.get("approximate", "allow:1")
    with pytest.raises(KeyError, match="no approximate policy named 'blender'"):
        policies.get("approximate", "blender:0.1")


def test_class_order_is_volatile_then_repo_map_then_task_pinned() -> None:
    assert [c.rank for c in (CacheClass.VOLATILE, CacheClass.REPO_MAP, CacheClass.TASK_PINNED)] == [
        0,
        1,
        2,
    ]


@given(block_views())
def test_cold_admission_policies(blocks: list[BlockView]) -> None:
    everything = policies.get("cold_admission", "all")
    skip = policies.get("cold_admission", "skip_small_volatile")
    for b in blocks:
        assert everything.admit(b)
        small_volatile = b.cache_class is CacheClass.VOLATILE and b.n_tokens < skip.min_tokens
        assert skip.admit(b) is not small_volatile


@given(st.integers(1, 4096), st.integers(0, 8192), st.integers(0, 10**8), classes)
def test_restore_policies(n_tokens: int, start: int, n_bytes: int, cache_class: CacheClass) -> None:
    from kvrt._types import RestoreQuery

    query = RestoreQuery(cache_class=cache_class, start=start, n_tokens=n_tokens, n_bytes=n_bytes)
    assert policies.get("restore", "always").restore(query)
    assert not policies.get("restore", "never").restore(query)
    threshold = policies.get("restore", "size_threshold")
    assert threshold.restore(query) is (n_tokens >= threshold.min_tokens)


@given(st.integers(1, 4096), st.integers(0, 8192), st.integers(-8192, 8192), classes)
def test_approximate_policies(
    n_tokens: int, start: int, shift: int, cache_class: CacheClass
) -> None:
    from kvrt._types import ApproximateQuery

    query = ApproximateQuery(
        cache_class=cache_class,
        start=start,
        source_start=max(0, start - shift),
        n_tokens=n_tokens,
        n_bytes=n_tokens * 100,
    )
    assert not policies.get("approximate", "never").accept(query)
    allow = policies.get("approximate", "allow")
    assert allow.accept(query) is (n_tokens >= allow.min_tokens)
    stable = policies.get("approximate", "stable_only")
    assert stable.accept(query) is (
        n_tokens >= stable.min_tokens and cache_class is not CacheClass.VOLATILE
    )


@given(
    overhead=st.floats(1e-5, 5e-2),
    gbps=st.floats(0.2, 30.0),
    per_token=st.floats(1e-5, 1e-2),
    growth=st.floats(0.0, 1e-3),
    sizes=st.lists(st.integers(16, 4096), min_size=4, max_size=20, unique=True).filter(
        lambda sizes: max(sizes) >= 4 * min(sizes)
    ),
)
def test_calibrated_policy_learns_the_measured_costs(
    overhead: float, gbps: float, per_token: float, growth: float, sizes: list[int]
) -> None:
    """Fed exact measurements, the fit converges to them and decides as they say."""
    from kvrt._types import RestoreQuery

    policy = policies.get("restore", "calibrated")
    bpt = 24_000  # bytes per token

    def restore_s(n_bytes: int) -> float:
        return overhead + n_bytes / (gbps * 1e9)

    def prefill_s(start: int, n: int) -> float:
        return n * (per_token + growth * (start + n / 2) / 1e3)

    for _ in range(6):
        for n in sizes:
            policy.observe_restore(n * bpt, restore_s(n * bpt))
            policy.observe_prefill(n, n, prefill_s(n, n))
    assert policy.observations == (6 * len(sizes), 6 * len(sizes))
    for n in (min(sizes), max(sizes), (min(sizes) + max(sizes)) // 2):
        query = RestoreQuery(cache_class=CacheClass.VOLATILE, start=n, n_tokens=n, n_bytes=n * bpt)
        est_restore, est_recompute = policy.estimate(query)
        assert est_restore == pytest.approx(restore_s(n * bpt), rel=0.05, abs=2e-4)
        assert est_recompute == pytest.approx(prefill_s(n, n), rel=0.05, abs=2e-4)
        assert policy.restore(query) is (est_restore <= est_recompute)
    cross = policy.crossover(bpt, start=0)
    if cross is not None:  # the smallest block restoring wins, and every larger one too
        for n in (cross, cross * 2, cross * 8):
            assert policy.restore_seconds(n * bpt) <= policy.recompute_seconds(0, n)
        if cross > 1:
            assert policy.restore_seconds((cross - 1) * bpt) > policy.recompute_seconds(
                0, cross - 1
            )


def test_calibrated_policy_recomputes_when_restoring_is_measured_slow() -> None:
    from kvrt._types import RestoreQuery

    policy = policies.get("restore", "calibrated")
    query = RestoreQuery(cache_class=CacheClass.VOLATILE, start=0, n_tokens=64, n_bytes=64 * 24_000)
    assert policy.restore(query)  # the priors favour restoring
    for n in (16, 64, 256, 1024):
        policy.observe_restore(n * 24_000, 0.5)  # a slow tier: half a second per restore
        policy.observe_prefill(0, n, n * 1e-4)
    assert not policy.restore(query)
    assert policy.crossover(24_000) is not None and policy.crossover(24_000) > 64


@st.composite
def turn_views(draw: st.DrawFn) -> list[kvrt.policy.TurnView]:
    n = draw(st.integers(1, 12))
    arrivals = draw(st.permutations(range(1, n + 1)))
    return [
        kvrt.policy.TurnView(
            id=i + 1,
            served=draw(st.sampled_from([0.0, 0.01, 0.5, 3.0])),
            left=draw(st.sampled_from([0, 1, 8, 4096])),
            arrived=arrivals[i],
            call=draw(st.sampled_from(["step", "prefill", "restore"])),
        )
        for i in range(n)
    ]


@given(turn_views())
def test_engine_turn_policies_pick_by_their_own_keys(waiting: list[kvrt.policy.TurnView]) -> None:
    keys = {
        "least_served": lambda w: (w.served, w.arrived),
        "fewest_left": lambda w: (w.left, w.served, w.arrived),
        "fifo": lambda w: w.arrived,
    }
    for name, key in keys.items():
        policy = policies.get("engine_turn", name)
        assert isinstance(policy, kvrt.policy.EngineTurn)
        chosen = policy.pick(waiting)
        assert chosen == min(waiting, key=key).id, name


def _setting(flash: bool, delta: float, prefill: float, decode: float) -> kvrt.policy.KernelSetting:
    trials = (
        kvrt.policy.KernelTrial(name="pieces", max_delta=delta),
        kvrt.policy.KernelTrial(name="lone", max_delta=0.5, lone=True),
    )
    return kvrt.policy.KernelSetting(
        flash_attention=flash, trials=trials, depth=4096, prefill_tps=prefill, decode_tps=decode
    )


def test_the_kernel_policy_takes_a_speed_up_only_where_exact_and_faster_at_both() -> None:
    pick = policies.get("kernels", "fastest_exact").choose
    off = _setting(False, 0.0, 100.0, 50.0)
    # lone-token trials do not make a configuration inexact: kvrt never prefills one alone
    assert off.exact and not off.lone_exact
    assert pick([off, _setting(True, 0.0, 130.0, 55.0)]) == 1
    assert pick([off, _setting(True, 0.0, 130.0, 45.0)]) == 0  # decodes slower
    assert pick([off, _setting(True, 0.0, 103.0, 60.0)]) == 0  # within the margin
    assert pick([off, _setting(True, 0.1, 300.0, 90.0)]) == 0  # inexact
    assert pick([_setting(False, 0.2, 1, 1), _setting(True, 0.0, 0.5, 0.5)]) == 1
    assert pick([_setting(False, 0.2, 1, 1), _setting(True, 0.1, 9, 9)]) is None
    assert (
        policies.get("kernels", "fastest_exact:0.5").choose([off, _setting(True, 0.0, 130.0, 55.0)])
        == 0
    )
    with pytest.raises(kvrt.ConfigError, match="margin"):
        policies.get("kernels", "fastest_exact:-1")


def test_a_forced_or_unavoidable_inexact_configuration_is_labelled_so() -> None:
    from kvrt.backend import KernelProbe, settle_kernels

    off, on = _setting(False, 0.0, 100.0, 50.0), _setting(True, 0.3, 200.0, 90.0)
    probe = KernelProbe(
        key="k", cpu="cpu", build="b", threads=2, kv_type="f16", settings=(off, on), seconds=1.0
    )
    chosen = settle_kernels(probe, None)
    assert not chosen.flash_attention and chosen.exact
    assert "flash attention on is inexact (pieces differ by 0.3)" in chosen.reason
    forced = settle_kernels(probe, True)
    assert forced.flash_attention and not forced.exact and "labelled approximate" in forced.reason
    worst = KernelProbe(**{**msgspec.structs.asdict(probe), "settings": (on,)})
    assert not settle_kernels(worst, None).exact
    assert "no configuration is exact" in settle_kernels(worst, None).reason
    unprobed = settle_kernels(worst, False)
    assert not unprobed.flash_attention and not unprobed.exact and unprobed.setting is None
