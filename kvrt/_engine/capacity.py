"""Capacity: how many tokens the hot window holds and how far the planner context reaches.

The derivation, with every quantity that may be unknown degrading to "not a limit" plus a
note instead of an exception::

    reserve = max(reserve asked for (default 5 % of total), floor)
    usable  = min(free - reserve, user cap - reserve) * (1 - headroom)
    hot     = min(trained context, request, hot cap,
                  (usable - cold when hot and cold share host RAM - weights - overhead)
                  / kv bytes per token)
    planner = min(hot + (cold budget + disk budget) / kv bytes per token,
                  trained context, request)

Sliding-window layers cost at most ``window`` tokens each, unless the engine keeps them at
full size. ``effective_context`` is the dense window (the hot window) kept for
compatibility with engines that have no cold store.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_HOST_COLD_FRACTION",
    "DEFAULT_RESERVE_FRACTION",
    "FALLBACK_CONTEXT",
    "RESERVE_FLOOR_BYTES",
    "Capacity",
    "CapacityInputs",
    "LayerProfile",
    "Limit",
    "MemoryPolicy",
    "MemoryReading",
    "planner_context",
    "resolve_capacity",
    "tokens_for_bytes",
]

DEFAULT_HEADROOM = 0.10
DEFAULT_HOST_COLD_FRACTION = 0.25
DEFAULT_RESERVE_FRACTION = 0.05
RESERVE_FLOOR_BYTES = 256 * 1024**2
# Used only when neither the model, the request nor memory bounds the hot window.
FALLBACK_CONTEXT = 4096


class Limit(enum.StrEnum):
    """What bounded a context size."""

    TRAINED_CONTEXT = "trained_context"
    REQUEST = "request"
    HOT_CAP = "hot_cap"
    MEMORY = "memory"
    COLD_BUDGET = "cold_budget"
    FALLBACK = "fallback"


class LayerProfile(msgspec.Struct, frozen=True, kw_only=True):
    """Which layers attend over the whole context and which over a sliding window."""

    n_layers: int
    """All layers."""
    n_swa_layers: int = 0
    """Layers that attend over a sliding window only."""
    sliding_window: int | None = None
    """Their window, in tokens."""
    swa_full: bool = False
    """The engine sizes windowed layers like dense ones, so the window saves no memory.
    kvrt's llama.cpp contexts do: a window-sized cache drops the keys that slid out of the
    window, which a range taken back at the tail (or restored inside the window) needs, and
    its logits differ from a full-size cache's."""

    @property
    def windowed(self) -> bool:
        return (
            self.n_swa_layers > 0
            and self.sliding_window is not None
            and self.sliding_window > 0
            and not self.swa_full
        )


class MemoryReading(msgspec.Struct, frozen=True, kw_only=True):
    """Live memory figures; ``None`` where the source could not be read."""

    free_bytes: int | None = None
    """Free memory where the hot window lives."""
    total_bytes: int | None = None
    """Total memory where the hot window lives."""
    host_free_bytes: int | None = None
    """Free host RAM (where the cold store lives)."""
    host_total_bytes: int | None = None
    """Total host RAM."""
    hot_in_host_memory: bool = True
    """The hot window lives in host RAM (CPU engines): hot and cold draw on one pool."""


class MemoryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """The user's memory policy; ``None`` means "derive from live memory"."""

    max_bytes: int | None = None
    """Cap on the memory kvrt plans for (``memory.max``)."""
    reserve_bytes: int | None = None
    """Memory left for everything else (``memory.reserve``)."""
    headroom: float | None = None
    """Fraction of usable memory kept free (``memory.headroom``)."""
    host_cold_bytes: int | None = None
    """The host cold store's budget (``memory.cold``)."""
    overhead_bytes: int = 0
    """Fixed per-context overhead planned for (``memory.overhead``)."""


class CapacityInputs(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the derivation reads; any model figure may be unknown."""

    trained_context: int | None = None
    """The model's trained context."""
    kv_bytes_per_token: int | None = None
    """KV bytes one token costs."""
    cold_bytes_per_token: int | None = None
    """Bytes one token takes in a cold block, where that differs from the hot cache (an
    OpenVINO u8 cache reads back as f32); ``None``: as ``kv_bytes_per_token``."""
    weight_bytes: int | None = None
    """Bytes of weights."""
    layers: LayerProfile | None = None
    """Which layers are windowed."""
    request_context: int | None = None
    """The context asked for (``engine.context``)."""
    hot_cap_tokens: int | None = None
    """A cap on the hot window (``engine.hot_tokens``)."""
    # Model-native sparse attention that can attend past the trained context.
    sparse_beyond_trained: bool = False
    """The model's own sparse attention reaches past its trained context."""
    memory: MemoryReading = msgspec.field(default_factory=MemoryReading)
    """Live memory figures."""
    policy: MemoryPolicy = msgspec.field(default_factory=MemoryPolicy)
    """The user's memory policy."""
    disk_bytes: int = 0
    """The disk tier's budget (0: no disk tier)."""
    disk_path: str | None = None
    """Where the disk tier keeps its blocks."""


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """The resolved sizes, with what limited each of them and why."""

    hot_context_tokens: int
    """Tokens the hot window may hold: what the model attends to at once."""
    planner_effective_context: int
    """Tokens a session's context may span: hot plus what the cold budget parks, within the trained context."""
    effective_context: int
    """The dense window (equal to the hot window), for engines with no cold store."""
    cold_store_tokens: int
    """Tokens of KV the host cold budget holds."""
    host_cold_budget_bytes: int
    """The cold store's budget in host RAM."""
    disk_budget_bytes: int = 0
    """The disk tier's budget (0: off)."""
    disk_store_tokens: int = 0
    """Tokens of KV the disk budget holds."""
    disk_path: str | None = None
    """Where the disk tier keeps its blocks."""
    usable_bytes: int | None
    """Memory kvrt may plan for: free less reserve, capped, less headroom."""
    reserve_bytes: int | None
    """Memory left for everything else."""
    headroom: float
    """Fraction of usable memory kept free."""
    kv_bytes_per_token: int | None
    """KV bytes one token costs."""
    hot_limited_by: tuple[Limit, ...]
    """What bounded the hot window."""
    planner_limited_by: tuple[Limit, ...]
    """What bounded the planner context."""
    notes: tuple[str, ...] = ()
    """How unknown figures were treated, in words."""


def tokens_for_bytes(budget: int, kv_bytes_per_token: int, layers: LayerProfile | None) -> int:
    """How many tokens of KV fit in ``budget`` bytes, honouring sliding-window layers."""
    if budget <= 0 or kv_bytes_per_token <= 0:
        return 0
    if layers is None or not layers.windowed or layers.n_layers <= 0:
        return budget // kv_bytes_per_token
    assert layers.sliding_window is not None
    per_layer = kv_bytes_per_token / layers.n_layers
    swa = min(layers.n_swa_layers, layers.n_layers)
    dense = layers.n_layers - swa
    window = layers.sliding_window
    full_window_cost = kv_bytes_per_token * window
    if budget < full_window_cost:
        return budget // kv_bytes_per_token
    if dense == 0:
        # Every layer is windowed: memory stops growing once the window is full.
        return 2**62
    return window + int((budget - full_window_cost) // (per_layer * dense))


def _reserve(policy: MemoryPolicy, total: int | None, notes: list[str]) -> int:
    asked = policy.reserve_bytes
    if asked is None:
        asked = int(total * DEFAULT_RESERVE_FRACTION) if total is not None else 0
    floor = RESERVE_FLOOR_BYTES if total is None else min(RESERVE_FLOOR_BYTES, total // 4)
    if asked < floor:
        notes.append(f"reserve raised to its floor of {floor} bytes")
        return floor
    return asked


def _headroom(policy: MemoryPolicy) -> float:
    return DEFAULT_HEADROOM if policy.headroom is None else policy.headroom


def _usable(inputs: CapacityInputs, reserve: int, notes: list[str]) -> int | None:
    mem, policy = inputs.memory, inputs.policy
    bounds: list[int] = []
    if mem.free_bytes is not None:
        bounds.append(mem.free_bytes - reserve)
    if policy.max_bytes is not None:
        bounds.append(policy.max_bytes - reserve)
    if not bounds:
        notes.append(
            "free memory unknown and no memory cap set: memory does not bound the hot window"
        )
        return None
    return max(0, int(min(bounds) * (1.0 - _headroom(policy))))


def _host_cold(inputs: CapacityInputs, notes: list[str]) -> int:
    asked = inputs.policy.host_cold_bytes
    if asked is not None:
        return asked
    free = inputs.memory.host_free_bytes
    if free is None:
        notes.append("free host memory unknown: no host cold budget by default")
        return 0
    return int(free * DEFAULT_HOST_COLD_FRACTION)


def _minimum(candidates: dict[Limit, int | None]) -> tuple[int | None, tuple[Limit, ...]]:
    known = {k: v for k, v in candidates.items() if v is not None}
    if not known:
        return None, ()
    low = min(known.values())
    return low, tuple(k for k, v in known.items() if v == low)


def planner_context(
    hot: int, cold_tokens: int, *, trained: int | None, request: int | None
) -> tuple[int, tuple[Limit, ...]]:
    """How far a context over a hot window of ``hot`` tokens may reach, and what bounds
    it: hot plus what the cold store parks, within the trained context and the request
    (never below the hot window itself). The one rule for the runtime and every session.
    """
    planner, limited_by = _minimum(
        {
            Limit.COLD_BUDGET: hot + cold_tokens,
            Limit.TRAINED_CONTEXT: trained,
            Limit.REQUEST: request,
        }
    )
    assert planner is not None  # the cold-budget candidate is always known
    return max(planner, hot), limited_by


def resolve_capacity(inputs: CapacityInputs) -> Capacity:
    """Derive the hot window and the planner context from model, memory and policy."""
    notes: list[str] = []
    mem, policy = inputs.memory, inputs.policy
    kvpt = inputs.kv_bytes_per_token if inputs.kv_bytes_per_token else None
    reserve = _reserve(policy, mem.total_bytes, notes)
    usable = _usable(inputs, reserve, notes)
    cold_bytes = _host_cold(inputs, notes)
    if usable is not None and cold_bytes > usable:
        notes.append(
            f"host cold budget of {cold_bytes} bytes is more than the {usable} usable bytes: "
            "capped there"
        )
        cold_bytes = usable

    layers = inputs.layers
    if layers is not None and layers.n_swa_layers and layers.sliding_window and layers.swa_full:
        notes.append(
            f"{layers.n_swa_layers} of {layers.n_layers} layers attend over a "
            f"{layers.sliding_window}-token window but are kept at full size (exact restores "
            "and tail rollbacks need every key), so they cost as much as the global layers"
        )

    memory_tokens: int | None = None
    if usable is not None and kvpt is not None:
        budget = usable - (inputs.weight_bytes or 0) - policy.overhead_bytes
        if inputs.weight_bytes is None:
            notes.append("weight size unknown: counted as zero")
        if mem.hot_in_host_memory and cold_bytes:
            budget -= cold_bytes
        memory_tokens = tokens_for_bytes(budget, kvpt, inputs.layers)
        if memory_tokens == 0:
            notes.append("memory leaves no room for a hot window")
    elif inputs.kv_bytes_per_token == 0:
        notes.append(
            "the model keeps no KV (a recurrent state of one size whatever the context): "
            "memory does not bound the hot window, and nothing is paged out of it"
        )
    elif kvpt is None:
        notes.append("KV bytes per token unknown: memory does not bound the hot window")

    hot, hot_by = _minimum(
        {
            Limit.TRAINED_CONTEXT: inputs.trained_context,
            Limit.REQUEST: inputs.request_context,
            Limit.HOT_CAP: inputs.hot_cap_tokens,
            Limit.MEMORY: memory_tokens,
        }
    )
    if hot is None:
        hot, hot_by = FALLBACK_CONTEXT, (Limit.FALLBACK,)
        notes.append(f"no model, request or memory bound known: hot window falls back to {hot}")
    hot = max(0, hot)

    cold_bpt = inputs.cold_bytes_per_token or kvpt
    cold_tokens = cold_bytes // cold_bpt if cold_bpt is not None else 0
    if cold_bpt is None and cold_bytes and inputs.kv_bytes_per_token != 0:
        notes.append("KV bytes per token unknown: the cold budget cannot be counted in tokens")
    disk_tokens = inputs.disk_bytes // cold_bpt if cold_bpt is not None else 0
    if cold_bpt is not None and kvpt is not None and cold_bpt != kvpt:
        notes.append(
            f"cold blocks take {cold_bpt:,} bytes a token against {kvpt:,} in the hot cache "
            "(the engine reads this KV type back wider than it stores it)"
        )
    trained = None if inputs.sparse_beyond_trained else inputs.trained_context
    planner, planner_by = planner_context(
        hot, cold_tokens + disk_tokens, trained=trained, request=inputs.request_context
    )

    return Capacity(
        hot_context_tokens=hot,
        planner_effective_context=planner,
        effective_context=hot,
        cold_store_tokens=cold_tokens,
        host_cold_budget_bytes=cold_bytes,
        disk_budget_bytes=inputs.disk_bytes,
        disk_store_tokens=disk_tokens,
        disk_path=inputs.disk_path,
        usable_bytes=usable,
        reserve_bytes=reserve,
        headroom=_headroom(policy),
        kv_bytes_per_token=kvpt,
        hot_limited_by=hot_by,
        planner_limited_by=planner_by,
        notes=tuple(notes),
    )
