"""``describe``: a model's KV shape and the capacity kvrt resolves for it."""

from __future__ import annotations

import msgspec

from ._cold.disk import disk_location
from ._config import Config
from ._engine.capacity import (
    Capacity,
    CapacityInputs,
    LayerProfile,
    Limit,
    MemoryPolicy,
    MemoryReading,
    resolve_capacity,
)
from ._engine.contract import Engine, ModelFacts, StepsTogether
from ._engine.memory import read_memory
from ._engine.registry import open_engine
from ._errors import ConfigError
from ._units import format_size

__all__ = [
    "ModelInfo",
    "capacity_inputs",
    "check_limits",
    "describe_model",
    "model_info",
    "together",
]


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A loaded model's facts with the capacity resolved for it."""

    model: ModelFacts
    """What the engine reports of the model."""
    capacity: Capacity
    """The sizes resolved from model, memory and policy."""
    memory: MemoryReading
    """The live memory reading they were resolved from."""
    together: int = 1
    """Sessions whose steps may run in one engine call (1: each steps alone), as the
    engine offers it here (where the kernel probe found it exact) and ``engine.together``
    bounds it."""
    together_bytes: int = 0
    """The most memory the engine holds for sessions stepping together, beside their own
    windows, where each window is as large as the hot window (0 where each steps alone):
    a stream per session that may join, counted by no budget above."""

    @property
    def hot_context_tokens(self) -> int:
        return self.capacity.hot_context_tokens

    @property
    def planner_effective_context(self) -> int:
        return self.capacity.planner_effective_context


def capacity_inputs(facts: ModelFacts, config: Config, memory: MemoryReading) -> CapacityInputs:
    """The capacity derivation's inputs for a model under a configuration."""
    mem = config.memory
    disk_path, disk_bytes = disk_location(config.disk.path, config.disk.budget)
    return CapacityInputs(
        trained_context=facts.trained_context,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        cold_bytes_per_token=facts.cold_bytes_per_token,
        weight_bytes=facts.weight_bytes,
        layers=LayerProfile(
            n_layers=facts.n_layers,
            n_swa_layers=facts.n_swa_layers if facts.sliding_window_live else 0,
            sliding_window=facts.sliding_window_live,
            swa_full=facts.swa_full,
        ),
        request_context=config.engine.context,
        hot_cap_tokens=config.engine.hot_tokens,
        memory=memory,
        policy=MemoryPolicy(
            max_bytes=mem.max,
            reserve_bytes=mem.reserve,
            headroom=mem.headroom,
            host_cold_bytes=mem.cold,
            overhead_bytes=mem.overhead,
        ),
        disk_bytes=disk_bytes,
        disk_path=str(disk_path),
    )


def describe_model(config: Config | None = None) -> ModelInfo:
    """Load the configured model (default: the embedded SmolLM2) and resolve its capacity.

    >>> info = describe_model()
    >>> info.model.kv_bytes_per_token, info.hot_context_tokens <= info.model.trained_context
    (23040, True)
    """
    config = config or Config()
    engine = open_engine(config.engine)
    try:
        return model_info(engine.facts, config, engine=engine)
    finally:
        engine.close()


def together(engine: Engine) -> int:
    """Sessions whose steps ``engine`` runs in one call (1: each alone)."""
    return engine.streams if isinstance(engine, StepsTogether) else 1


def model_info(facts: ModelFacts, config: Config, *, engine: Engine | None = None) -> ModelInfo:
    """Facts of a loaded model with the capacity resolved from live memory now, and what
    ``engine`` (where given) does for sessions generating at once."""
    memory = read_memory()
    capacity = resolve_capacity(capacity_inputs(facts, config, memory))
    joined = together(engine) if engine is not None else 1
    return ModelInfo(
        model=facts,
        capacity=capacity,
        memory=memory,
        together=joined,
        together_bytes=(
            engine.stream_bytes_at(capacity.hot_context_tokens)
            if joined > 1 and isinstance(engine, StepsTogether)
            else 0
        ),
    )


_LIMIT_SETTING = {
    Limit.MEMORY: "memory (memory.max, memory.reserve, memory.headroom, memory.cold)",
    Limit.REQUEST: "engine.context",
    Limit.HOT_CAP: "engine.hot_tokens",
    Limit.TRAINED_CONTEXT: "the model's trained context",
}


def check_limits(info: ModelInfo, cfg: Config) -> None:
    """Refuse limits that leave no session room, or a cold budget beyond usable memory."""
    cap = info.capacity
    asked = cfg.memory.cold
    if asked is not None and cap.usable_bytes is not None and asked > cap.usable_bytes:
        raise ConfigError(
            f"memory.cold of {format_size(asked)} is more than the {format_size(cap.usable_bytes)} "
            "kvrt may use (free memory less memory.reserve and memory.headroom, capped by "
            "memory.max); lower memory.cold or raise memory.max"
        )
    most = info.model.max_block_tokens
    if most is not None and cfg.session.block_tokens > most:
        raise ConfigError(
            f"session.block_tokens of {cfg.session.block_tokens} is more than this model's "
            f"{most}-token sliding window: the engine keeps a windowed layer's KV only for the "
            f"last {most} positions of a block, so a block holds at most {most} tokens"
        )
    least = 4 * cfg.session.block_tokens
    if cap.hot_context_tokens < least:
        by = ", ".join(_LIMIT_SETTING.get(limit, str(limit)) for limit in cap.hot_limited_by)
        usable = "unknown" if cap.usable_bytes is None else format_size(cap.usable_bytes)
        raise ConfigError(
            f"the limits leave a hot window of {cap.hot_context_tokens} tokens, less than the "
            f"smallest session's {least} (four blocks of {cfg.session.block_tokens}); limited by "
            f"{by} (usable memory {usable}, weights {format_size(info.model.weight_bytes)})"
        )
