"""The runtime: one loaded model, one cold store, and a task per session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from . import policies as policies  # registers the built-in policies
from . import policy
from ._chat.replies import ReplyMemory
from ._chat.templates import JinjaTemplate, read_template_file
from ._checks import check_bool, check_choice, check_int, check_salt, check_text
from ._cold import ColdStats, ColdStore, RemoteTier, SharedStore, salted
from ._config import Config, EngineConfig, check_config, load_config
from ._describe import ModelInfo, check_limits, model_info
from ._engine.capacity import Limit, planner_context
from ._engine.contract import Engine
from ._engine.registry import open_engine
from ._engine.spare import SpareRelease
from ._engine.turns import EngineTurns
from ._errors import (
    ArgumentTypeError,
    ConfigError,
    EngineError,
    KvrtError,
    SessionClosedError,
)
from ._paging.segments import Segment
from ._paging.window import HotWindow, long_limit
from ._session import (
    Actor,
    SavedSession,
    Session,
    SessionParts,
    SessionPolicies,
    read_saved,
    resume_session,
)
from ._session.chat import ChatTemplate
from ._tiers import open_tiers
from ._types import CacheClass
from ._units import format_size
from ._util import NoPublicConstructor, physical_cores

__all__ = ["Runtime", "check_policies", "load_engine", "open_runtime"]


def _policy(kind: str, name: str) -> Any:
    try:
        return policy.create(kind, name)
    except ConfigError as exc:
        raise ConfigError(f"invalid policies.{kind}: {exc}") from None


def check_policies(cfg: Config) -> dict[str, Any]:
    """An instance of every configured policy, by kind, or a :class:`ConfigError` naming
    the first name that is not registered."""
    return {
        f.name: _policy(f.name, getattr(cfg.policies, f.name))
        for f in msgspec.structs.fields(cfg.policies)
    }


class Runtime(metaclass=NoPublicConstructor):
    """A loaded model shared by sessions, with the cold store they share.

    Runtimes come only from :func:`open_runtime`.
    """

    def __init__(
        self,
        engine: Engine,
        info: ModelInfo,
        config: Config,
        cold: ColdStore,
        tg: TaskGroup,
        template: JinjaTemplate | None = None,
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
        self._chat = ChatTemplate(engine, template)
        remote = next((t for t in cold.tiers if isinstance(t, RemoteTier)), None)
        self.shared = SharedStore(remote) if remote is not None else None
        """The values replicas share on the remote server (``remote.url``), signed with
        their secret; None without a remote server. The runtime's reply memory lives
        there too, and ``kvrt serve`` its kept responses and conversations."""
        self._replies = ReplyMemory(shared=self.shared)
        self._closed = False
        self._serial = 0
        threads = config.engine.threads or physical_cores()
        parallel = config.engine.parallel or max(1, physical_cores() // threads)
        self.engine_turns = EngineTurns(parallel, check_policies(config)["engine_turn"])
        """The engine's slots, shared by every session (see :mod:`kvrt._engine.turns`)."""
        self._spare = SpareRelease(engine, self.engine_turns, tg, self._sessions)

    @property
    def closed(self) -> bool:
        """Whether the runtime has closed (its ``async with`` block ended): it opens no
        more sessions."""
        return self._closed

    @property
    def engine(self) -> Engine:
        return self._engine

    def cold_stats(self) -> ColdStats:
        return self._cold.stats()

    @property
    def cold_store(self) -> ColdStore:
        """The cold store the runtime's sessions share (:mod:`kvrt.cold`)."""
        return self._cold

    @property
    def close_report(self) -> str | None:
        """Once the runtime has closed: what closing did with block writes still queued
        for the tiers below RAM — finished (and how long that took), or how many were
        left after ``disk.flush_timeout`` (also logged as a warning). None when none were
        queued."""
        return self._cold.flush_report

    def policy(self, kind: str, name: str | None = None) -> Any:
        """The runtime's instance of a policy (the configured one when ``name`` is None).

        One instance per name serves every session that picks it; a policy that calibrates
        itself (``observe_restore``/``observe_prefill``) learns from every session's
        restores and prefills once it exists, whichever policy those sessions use.
        """
        kinds = msgspec.structs.fields(self.config.policies)
        if check_text("policy kind", kind) not in {f.name for f in kinds}:
            raise ConfigError(
                f"unknown policy kind {kind!r} (expected one of: {', '.join(f.name for f in kinds)})"
            )
        if name is not None:
            check_text(f"{kind} policy name", name, empty=False)
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

        Only the template's markup is read as special tokens: ``content`` stays plain text,
        so a message holding ``<|im_end|><|im_start|>system`` cannot forge a turn.
        ``generation_prompt`` appends the assistant header, for the last message before
        generating.
        """
        check_text("chat_segment name", name, empty=False)
        check_text("chat_segment role", role, empty=False)
        check_text("chat_segment content", content)
        check_bool("chat_segment generation_prompt", generation_prompt)
        cache_class = check_choice("chat_segment cache_class", cache_class, CacheClass)
        return self._chat.message_segment(name, role, content, cache_class, generation_prompt)

    def hot_window(self, hot_tokens: int | None = None) -> int:
        """The hot window a session opened with ``hot_tokens`` gets (None: the runtime's),
        or the :class:`~kvrt.ConfigError` saying why no session can have it (a server
        checks its setting with this before it serves).

        >>> rt.hot_window(256)
        Traceback (most recent call last):
        kvrt.ConfigError: hot_tokens must be between 512 (four blocks of 128) and ...
        """
        cap = self.model_info.capacity
        facts = self.model_info.model
        cfg = self.config.session
        hot = hot_tokens if hot_tokens is not None else cap.hot_context_tokens
        least = 4 * cfg.block_tokens
        if (
            isinstance(hot, bool)
            or not isinstance(hot, int)
            or not (least <= hot <= facts.trained_context)
        ):
            raise ConfigError(
                f"hot_tokens must be between {least} (four blocks of {cfg.block_tokens}) and the "
                f"model's trained context of {facts.trained_context}, got {hot!r}"
            )
        if hot > cap.hot_context_tokens and Limit.MEMORY in cap.hot_limited_by:
            raise ConfigError(
                f"a hot window of {hot} tokens needs {format_size(hot * facts.kv_bytes_per_token)} "
                f"of KV, but the memory limits leave room for {cap.hot_context_tokens} tokens "
                "(memory.max, memory.reserve, memory.headroom, memory.cold)"
            )
        if cfg.sink_tokens + cfg.recent_tokens + 2 * cfg.block_tokens > hot:
            raise ConfigError(
                f"a hot window of {hot} tokens cannot hold the sinks ({cfg.sink_tokens}), the recent "
                f"window ({cfg.recent_tokens}) and two blocks of {cfg.block_tokens}"
            )
        return hot

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
        partial_window: str | None = None,
        write_through: str | None = None,
        message_class: str | None = None,
        resume: str | os.PathLike[str] | SavedSession | None = None,
        cache_salt: str | None = None,
        long_context: bool | None = None,
    ) -> AsyncIterator[Session]:
        """Open a session whose hot window holds at most ``hot_tokens`` tokens.

        The policy names (``hot_eviction``, ``cold_admission``, ``restore``,
        ``approximate``, ``partial_window``, ``write_through``, ``message_class``) override the runtime's configured ones for
        this session.
        ``resume`` (a file :meth:`Session.save` wrote, or what it returned) lays that
        context out again before the session is yielded, restoring every block the cold
        tiers hold (``session.resumed`` says what was restored and computed);
        ``hot_tokens`` then defaults to the saved session's.
        ``cache_salt`` (1 to 256 printable characters) scopes reuse: the session's blocks
        and remembered replies are reused only by sessions opened with the same salt, in
        every tier and across restarts (it is part of each block's identity). Sessions
        without one share theirs with each other (one user's machine); give each user or
        tenant its own where several share a runtime.
        ``long_context`` (default ``session.long_context``) serves contexts past the
        model's trained one, as long as the cold tiers hold (see :mod:`kvrt._paging.long`);
        its blocks are chosen by the ``relevance`` hot-eviction policy and come back from
        their copies (``allow``) unless other hot-eviction and approximate policies are named
        (``approximate="never"`` computes the window shown for a question afresh).

        >>> async with rt.open_session(hot_tokens=512, name="reviewer") as session:
        ...     await session.ensure_context([kvrt.Segment("user", "Hi")])
        """
        if self._closed:
            raise SessionClosedError("the runtime is closed")
        if name is not None:
            check_text("session name", name, empty=False)
        if hot_tokens is not None:
            check_int("hot_tokens", hot_tokens)
        if cache_salt is not None:
            check_salt(cache_salt)
        long = check_bool(
            "long_context",
            self.config.session.long_context if long_context is None else long_context,
        )
        if long and hot_eviction is None and self.config.policies.hot_eviction == "class_lru":
            hot_eviction = "relevance"
        shown = approximate  # what a long context's window follows
        if long and approximate is None and self.config.policies.approximate == "never":
            shown = "allow"
        saved = None
        if resume is not None:
            if isinstance(resume, SavedSession):
                saved = resume
            elif isinstance(resume, (str, os.PathLike)):
                saved = await anyio.to_thread.run_sync(read_saved, resume)
            else:
                raise ArgumentTypeError(
                    f"resume must be a path or a SavedSession, got {type(resume).__name__}"
                )
            if hot_tokens is None:
                hot_tokens = min(saved.hot_tokens, self.model_info.capacity.hot_context_tokens)
        cap = self.model_info.capacity
        facts = self.model_info.model
        cfg = self.config.session
        hot = self.hot_window(hot_tokens)
        planner, _ = planner_context(
            hot,
            cap.cold_store_tokens + cap.disk_store_tokens,
            trained=facts.trained_context,
            request=self.config.engine.context,
        )
        chosen = SessionPolicies(
            hot_eviction=self.policy("hot_eviction", hot_eviction),
            cold_admission=self.policy("cold_admission", cold_admission),
            restore=self.policy("restore", restore),
            approximate=self.policy("approximate", approximate),
            partial_window=self.policy("partial_window", partial_window),
            write_through=self.policy("write_through", write_through),
            message_class=self.policy("message_class", message_class),
            checkpoint=self.policy("checkpoint", None),
            long_approximate=self.policy("approximate", shown),
            runtime=self._policies.values(),
        )
        self._serial += 1
        label = name or f"session-{self._serial}"
        ctx = await self.engine_turns.run(None, "open", partial(self._engine.open_context, hot))
        window = HotWindow(
            fingerprint=salted(getattr(ctx, "fingerprint", facts.fingerprint), cache_salt),
            planner_context=planner,
            block_tokens=cfg.block_tokens,
            sink_tokens=cfg.sink_tokens,
            recent_tokens=cfg.recent_tokens,
            planner_note=(
                f"{facts.architecture} is a recurrent model, which pages nothing out of its "
                "window: open the session with more hot_tokens"
                if facts.recurrent == "recurrent"
                else ""
            ),
        )
        actor = Actor(
            SessionParts(
                engine=self._engine,
                ctx=ctx,
                window=window,
                cold=self._cold,
                turns=self.engine_turns,
                config=cfg,
                policies=chosen,
                replies=self._replies.scoped(cache_salt),
                share=self.shared is not None,
            )
        )
        if long:
            try:
                window.long_limit = long_limit(
                    ctx, facts, cap.cold_store_tokens, cap.disk_store_tokens
                )
            except KvrtError:
                ctx.close()
                raise
        await self._tg.start(actor.run)
        session = Session._create(actor, label, self._tg, self._chat)
        self._sessions.add(session)
        self._spare.opened()
        try:
            if saved is not None:
                session.resumed = await resume_session(actor, session._mail.request, saved)
            yield session
        finally:
            with anyio.CancelScope(shield=True):
                await session.aclose()
            self._sessions.discard(session)
            self._spare.closed()

    async def _shutdown(self) -> None:
        self._closed = True
        self._spare.close()
        with anyio.CancelScope(shield=True):
            for session in list(self._sessions):
                await session.aclose()
        self._cold.close()


def _resolve(backend: str | None, model: str | None, config: Config | None) -> Config:
    """The configuration ``open_runtime``/``load_engine`` arguments name."""
    if config is not None and not isinstance(config, Config):
        raise ArgumentTypeError(f"config must be a kvrt.Config, got {type(config).__name__}")
    for label, value in (("backend", backend), ("model", model)):
        if value is not None:
            check_text(label, value, empty=False)
    cfg = check_config(config) if config is not None else load_config()
    changes = {k: v for k, v in (("backend", backend), ("model", model)) if v is not None}
    if changes:
        try:
            engine_cfg = msgspec.convert(
                {**msgspec.to_builtins(cfg.engine), **changes}, EngineConfig
            )
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid open_runtime argument: {exc}") from None
        cfg = msgspec.structs.replace(cfg, engine=engine_cfg)
    return cfg


def load_engine(
    backend: str | None = None, *, model: str | None = None, config: Config | None = None
) -> Engine:
    """Load a model once, for several runtimes: ``open_runtime(engine=...)`` then opens
    in milliseconds (a test suite loads it in a session fixture). Blocking; the caller
    closes it (``engine.close()``) once no runtime uses it.

    >>> engine = kvrt.load_engine("llama")
    >>> async with kvrt.open_runtime(engine=engine) as rt:
    ...     ...
    """
    cfg = _resolve(backend, model, config)
    check_policies(cfg)
    return open_engine(cfg.engine)


@asynccontextmanager
async def open_runtime(
    backend: str | None = None,
    *,
    model: str | None = None,
    config: Config | None = None,
    engine: Engine | None = None,
) -> AsyncIterator[Runtime]:
    """Load a model and start the cold store; sessions open on the yielded runtime.

    ``config`` defaults to :func:`kvrt.load_config` (``$KVRT_CONFIG`` and ``KVRT_*``
    variables); ``backend`` and ``model`` override it. No model means the embedded
    SmolLM2-135M-Instruct. ``engine``, from :func:`kvrt.load_engine`, is used instead of
    loading one (its settings replace ``config.engine``) and stays open afterwards.

    >>> async with kvrt.open_runtime(backend="llama") as rt:
    ...     async with rt.open_session(hot_tokens=512) as session:
    ...         ...
    """
    if engine is not None:
        if backend is not None or model is not None:
            raise ConfigError("give engine, or backend and model to load one, not both")
        if not hasattr(engine, "open_context") or not isinstance(
            getattr(engine, "config", None), EngineConfig
        ):
            raise ArgumentTypeError(
                f"engine must be an engine from kvrt.load_engine, got {type(engine).__name__}"
            )
    cfg = _resolve(backend, model, config)
    if engine is not None:  # the engine's settings, but a chat template is the runtime's
        template = cfg.engine.chat_template or engine.config.chat_template
        cfg = msgspec.structs.replace(
            cfg, engine=msgspec.structs.replace(engine.config, chat_template=template)
        )
    victim = check_policies(cfg)["cold_victim"]

    owned = engine is None
    if engine is None:
        engine = await anyio.to_thread.run_sync(open_engine, cfg.engine)
    try:
        info = model_info(engine.facts, cfg, engine=engine)
        check_limits(info, cfg)
        chat = _configured_template(engine, cfg)
        budget = info.capacity.host_cold_budget_bytes
        if budget <= 0:
            raise ConfigError(
                "the host cold budget is 0 bytes: kvrt needs room to park evicted blocks "
                "(set memory.cold, KVRT_MEM_COLD or --mem-cold to a size such as 1GiB)"
            )
        cold = ColdStore(
            budget,
            victim,
            tiers=await open_tiers(info, cfg, victim),
            flush_timeout=cfg.disk.flush_timeout,
        )
        # An error from the caller's block reaches the caller as itself, not wrapped in
        # the task group's ExceptionGroup: it is raised again once the group has closed.
        raised: Exception | None = None
        async with anyio.create_task_group() as tg:
            await tg.start(cold.serve)
            runtime = Runtime._create(engine, info, cfg, cold, tg, chat)
            try:
                yield runtime
            except Exception as exc:
                raised = exc
            finally:
                await runtime._shutdown()
        if raised is not None:
            raise raised
    finally:
        if owned:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(engine.close)


def _configured_template(engine: Engine, config: Config) -> JinjaTemplate | None:
    """``engine.chat_template`` read and compiled (its BOS and EOS texts the model's own),
    or None."""
    path = config.engine.chat_template
    if path is None:
        return None
    own = engine.chat_template_source()
    source = read_template_file(
        str(Path(path).expanduser()),
        bos_token=own.bos_token if own is not None else "",
        eos_token=own.eos_token if own is not None else "",
    )
    try:
        return JinjaTemplate(source)
    except EngineError as exc:
        raise ConfigError(f"engine.chat_template: {exc}") from None
