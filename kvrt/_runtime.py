"""The runtime: one loaded model, one cold store, and a task per session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

import policies

from ._actor import Actor
from ._backend import Engine
from ._cold_store import ColdStats, ColdStore
from ._config import Config, EngineConfig, load_config
from ._describe import ModelInfo, model_info
from ._engines import open_engine
from ._errors import ConfigError, SessionClosedError
from ._residency import HotWindow, Segment
from ._session import Session
from ._types import CacheClass
from ._util import NoPublicConstructor, physical_cores

__all__ = ["Runtime", "open_runtime"]


def _policy(kind: str, name: str) -> Any:
    try:
        return policies.get(kind, name)
    except KeyError as exc:
        raise ConfigError(f"invalid policies.{kind}: {exc.args[0]}") from None


class Runtime(metaclass=NoPublicConstructor):
    """A loaded model shared by sessions, with the cold store they share.

    Runtimes come only from :func:`open_runtime`.
    """

    def __init__(
        self, engine: Engine, info: ModelInfo, config: Config, cold: ColdStore, tg: TaskGroup
    ) -> None:
        self._engine = engine
        self.model_info = info
        self.config = config
        self._cold = cold
        self._tg = tg
        self._sessions: set[Session] = set()
        self._policies: dict[tuple[str, str], Any] = {}
        """One instance per policy name; those that calibrate themselves learn from every
        session's measured work (sessions hold a live view of the values)."""
        self._closed = False
        self._serial = 0
        threads = config.engine.threads or physical_cores()
        parallel = config.engine.parallel or max(1, physical_cores() // threads)
        self.engine_limiter = anyio.CapacityLimiter(parallel)

    @property
    def engine(self) -> Engine:
        return self._engine

    def cold_stats(self) -> ColdStats:
        return self._cold.stats()

    def policy(self, kind: str, name: str | None = None) -> Any:
        """The runtime's instance of a policy (the configured one when ``name`` is None).

        One instance per name serves every session that picks it; a policy that calibrates
        itself (``observe_restore``/``observe_prefill``) learns from every session's
        restores and prefills once it exists, whichever policy those sessions use.
        """
        chosen = name or getattr(self.config.policies, kind)
        found = self._policies.get((kind, chosen))
        if found is None:
            found = self._policies[(kind, chosen)] = _policy(kind, chosen)
        return found

    def chat_segment(
        self,
        name: str,
        role: str,
        content: str,
        *,
        cache_class: CacheClass = CacheClass.VOLATILE,
        generation_prompt: bool = False,
    ) -> Segment:
        """A segment holding one chat message in the model's own chat template.

        ``generation_prompt`` appends the assistant header, for the last message before
        generating.
        """
        render = self._engine.apply_chat_template
        text = render([(role, content)], add_generation_prompt=generation_prompt)
        if role != "system":
            # Some templates insert a default system prompt before a lone user message:
            # render after a stand-in system message and keep only this message's part.
            base = render([("system", "-")], add_generation_prompt=False)
            full = render(
                [("system", "-"), (role, content)], add_generation_prompt=generation_prompt
            )
            if full.startswith(base):
                text = full[len(base) :]
        return Segment(name, text, cache_class=cache_class, parse_special=True)

    @asynccontextmanager
    async def open_session(
        self,
        *,
        hot_tokens: int | None = None,
        name: str | None = None,
        hot_eviction: str | None = None,
        cold_admission: str | None = None,
        restore: str | None = None,
        approximate: str | None = None,
    ) -> AsyncIterator[Session]:
        """Open a session whose hot window holds at most ``hot_tokens`` tokens.

        The policy names (``hot_eviction``, ``cold_admission``, ``restore``,
        ``approximate``) override the runtime's configured ones for this session.

        >>> async with rt.open_session(hot_tokens=512, name="reviewer") as session:
        ...     await session.ensure_context([kvrt.Segment("user", "Hi")])
        """
        if self._closed:
            raise SessionClosedError("the runtime is closed")
        cap = self.model_info.capacity
        facts = self.model_info.model
        cfg = self.config.session
        hot = hot_tokens if hot_tokens is not None else cap.hot_context_tokens
        least = 4 * cfg.block_tokens
        if not isinstance(hot, int) or not least <= hot <= facts.trained_context:
            raise ConfigError(
                f"hot_tokens must be between {least} (four blocks of {cfg.block_tokens}) and the "
                f"model's trained context of {facts.trained_context}, got {hot!r}"
            )
        if cfg.sink_tokens + cfg.recent_tokens + 2 * cfg.block_tokens > hot:
            raise ConfigError(
                f"a hot window of {hot} tokens cannot hold the sinks ({cfg.sink_tokens}), the recent "
                f"window ({cfg.recent_tokens}) and two blocks of {cfg.block_tokens}"
            )
        planner = hot + cap.cold_store_tokens
        for bound in (facts.trained_context, self.config.engine.context):
            if bound is not None:
                planner = min(planner, bound)
        order = self.policy("hot_eviction", hot_eviction)
        admission = self.policy("cold_admission", cold_admission)
        restorer = self.policy("restore", restore)
        approximator = self.policy("approximate", approximate)
        self._serial += 1
        label = name or f"session-{self._serial}"
        ctx = await anyio.to_thread.run_sync(
            self._engine.open_context, hot, limiter=self.engine_limiter
        )
        window = HotWindow(
            fingerprint=facts.fingerprint,
            budget=hot,
            planner_context=max(planner, hot),
            block_tokens=cfg.block_tokens,
            sink_tokens=cfg.sink_tokens,
            recent_tokens=cfg.recent_tokens,
        )
        actor = Actor(
            engine=self._engine,
            ctx=ctx,
            window=window,
            cold=self._cold,
            limiter=self.engine_limiter,
            order=order.order,
            config=cfg,
            admission=admission.admit,
            restore=restorer,
            approximate=approximator.accept,
            observers=self._policies.values(),
        )
        await self._tg.start(actor.run)
        session = Session._create(actor, label, self._tg)
        self._sessions.add(session)
        try:
            yield session
        finally:
            with anyio.CancelScope(shield=True):
                await session.aclose()
            self._sessions.discard(session)

    async def _shutdown(self) -> None:
        self._closed = True
        with anyio.CancelScope(shield=True):
            for session in list(self._sessions):
                await session.aclose()
        self._cold.close()


@asynccontextmanager
async def open_runtime(
    backend: str | None = None,
    *,
    model: str | None = None,
    config: Config | None = None,
) -> AsyncIterator[Runtime]:
    """Load a model and start the cold store; sessions open on the yielded runtime.

    ``config`` defaults to :func:`kvrt.load_config` (``$KVRT_CONFIG`` and ``KVRT_*``
    variables); ``backend`` and ``model`` override it. No model means the embedded
    SmolLM2-135M-Instruct.

    >>> async with kvrt.open_runtime(backend="llama") as rt:
    ...     async with rt.open_session(hot_tokens=512) as session:
    ...         ...
    """
    cfg = config if config is not None else load_config()
    changes = {k: v for k, v in (("backend", backend), ("model", model)) if v is not None}
    if changes:
        try:
            engine_cfg = msgspec.convert(
                {**msgspec.to_builtins(cfg.engine), **changes}, EngineConfig
            )
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid open_runtime argument: {exc}") from None
        cfg = msgspec.structs.replace(cfg, engine=engine_cfg)
    hot_policy = cfg.policies.hot_eviction
    _policy("hot_eviction", hot_policy)
    _policy("cold_admission", cfg.policies.cold_admission)
    _policy("restore", cfg.policies.restore)
    _policy("approximate", cfg.policies.approximate)
    victim = _policy("cold_victim", cfg.policies.cold_victim)

    engine = await anyio.to_thread.run_sync(open_engine, cfg.engine)
    try:
        info = model_info(engine.facts, cfg)
        budget = info.capacity.host_cold_budget_bytes
        if budget <= 0:
            raise ConfigError(
                "the host cold budget is 0 bytes: kvrt needs room to park evicted blocks "
                "(set memory.cold, KVRT_MEM_COLD or --mem-cold to a size such as 1GiB)"
            )
        cold = ColdStore(budget, victim)
        async with anyio.create_task_group() as tg:
            await tg.start(cold.serve)
            runtime = Runtime._create(engine, info, cfg, cold, tg)
            try:
                yield runtime
            finally:
                await runtime._shutdown()
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(engine.close)
