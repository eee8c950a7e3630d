"""Configuration: a msgspec Struct read from a file, then ``KVRT_*`` variables, then flags.

Later sources win: file < environment < command-line flags. Sizes accept ``512MiB``,
``8GiB`` or a byte count; fractions accept ``0.1`` or ``10%``. A bad value raises one
:class:`~kvrt.ConfigError` that names the field and where the value came from.

>>> cfg = load_config(env={"KVRT_MEM_COLD": "2GiB"}, flags={"kv_type": "q8_0"})
>>> cfg.memory.cold, cfg.engine.kv_type
(2147483648, 'q8_0')
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from ._checks import read_small_file
from ._errors import ArgumentTypeError, ConfigError
from ._units import parse_size

__all__ = [
    "CONFIG_ENV",
    "SETTINGS",
    "Config",
    "DiskConfig",
    "EngineConfig",
    "KvType",
    "MemoryConfig",
    "PolicyConfig",
    "RemoteConfig",
    "SessionConfig",
    "Setting",
    "check_config",
    "load_config",
]

Size = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
KvType = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "u8"]
BackendName = Literal["llama", "openvino"]

CONFIG_ENV = "KVRT_CONFIG"
"""The environment variable naming a config file."""
MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read."""


class MemoryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Memory policy. ``None`` derives the value from live memory."""

    cold: Size | None = None
    """Host-RAM cold store budget (default: 25 % of free host RAM)."""
    max: Size | None = None
    """Cap on the memory kvrt may plan for (default: no cap beyond free memory)."""
    reserve: Size | None = None
    """Memory left for everything else (default: 5 % of total, with a floor)."""
    headroom: Fraction | None = None
    """Fraction of usable memory kept free (default: 0.10)."""
    overhead: Size = 0
    """Fixed per-context overhead to plan for besides weights and KV."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which engine and model, and how the engine's contexts are built."""

    backend: BackendName = "llama"
    """The engine: ``llama`` (llama.cpp) or ``openvino``."""
    model: str | None = None
    """Path of a GGUF model or a name from :mod:`kvrt.models` (``gemma3-270m``); ``None``
    means the embedded SmolLM2-135M-Instruct."""
    kv_type: KvType = "f16"
    """KV cache precision (OpenVINO: ``f32``, ``f16``, ``bf16``, ``u8``)."""
    threads: Positive | None = None
    """Engine threads (default: the physical cores this process may run on)."""
    context: Positive | None = None
    """The logical context a request asks for (caps both hot and planner context)."""
    hot_tokens: Positive | None = None
    """A cap on the hot window, below what memory allows."""
    batch: Annotated[int, msgspec.Meta(ge=1, le=8192)] | None = None
    """Prefill batch size in tokens (default: 128 on llama.cpp, where it prefilled fastest
    on one and two cores and needs a quarter of 512's attention scratch; 512 on
    OpenVINO)."""
    require_exact: bool = False
    """Refuse a KV precision whose restores cannot be bit-exact (OpenVINO's ``u8``)."""
    openvino_profile: Literal["deterministic", "default"] = "deterministic"
    """OpenVINO compile settings: ``deterministic`` (f32 inference, exact KV round trips) or
    the CPU plugin's ``default`` (faster, bf16 on some CPUs)."""
    parallel: Positive | None = None
    """Engine calls that may run at once across sessions (default: cores / threads)."""
    together: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    """Sessions whose steps may run in one engine call (llama.cpp, where the kernel probe
    found sequences decoded together exact: each session's tokens and logits are those it
    gets alone); 1: every session steps alone."""
    chat_template: str | None = None
    """A chat template to render conversations with instead of the model's own: a Jinja
    file, or a ``tokenizer_config.json`` holding one (for a model whose own template
    knows no tools, or has none)."""
    flash_attention: Literal["auto", "on", "off"] = "auto"
    """llama.cpp's flash attention: ``on`` (V rows stored untransposed), ``off`` (f16,
    bf16 and f32 caches only), or ``auto``: as the kernel policy chooses among what the
    kernel probe measured on this machine (on for a quantized V cache, which needs it).
    Set on or off where the probe found it inexact, nothing is labelled exact. Only
    ``auto`` on OpenVINO."""
    kernel_policy: str = "fastest_exact"
    """The ``kernels`` policy (:class:`kvrt.policy.Kernels`) that picks the engine's
    kernel configuration among those the kernel probe measured: ``fastest_exact`` takes a
    configuration over the default only where it is exact and faster at both prefill and
    decode."""


class SessionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How sessions cut context into blocks and which tokens never leave the hot window."""

    block_tokens: Annotated[int, msgspec.Meta(ge=8, le=4096)] = 128
    """Segments are split into blocks of at most this many tokens."""
    sink_tokens: Annotated[int, msgspec.Meta(ge=0)] = 16
    """Blocks overlapping the first ``sink_tokens`` stay hot (attention sinks)."""
    recent_tokens: Annotated[int, msgspec.Meta(ge=1)] = 128
    """Blocks overlapping the last ``recent_tokens`` stay hot."""
    long_context: bool = False
    """Serve contexts past the model's trained one, as long as the cold tiers hold: shown
    to the engine a window at a time, at window positions, the blocks chosen by relevance
    to the query; never exact, and labelled so. Contexts that fit are placed as without."""
    mailbox: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8
    """Commands a session queues before callers wait."""
    stream_buffer: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    """Generated pieces buffered before generation waits for the reader."""
    cold_wait: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 5.0
    """Seconds an eviction waits for room in a full cold store (entries in use by a
    restore or a prefetch cannot be dropped) before it keeps tokens only, or, for an
    explicit ``evict``, fails with ``ColdStoreFullError``."""


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Policies by registered name (see ``policies.names(kind)``)."""

    hot_eviction: str = "class_lru"
    """Which resident blocks leave the hot window first."""
    cold_victim: str = "class_lru"
    """Which cold-store entries are dropped first when it is full."""
    cold_admission: str = "all"
    """Which evicted blocks keep their KV bytes."""
    restore: str = "always"
    """Whether an exact cold hit is restored or computed again."""
    approximate: str = "never"
    """Whether same tokens after a different prefix may be restored (with a RoPE fix-up)."""
    partial_window: str = "recompute"
    """Whether KV computed while earlier blocks were not hot is computed again once its
    whole prefix fits hot."""
    write_through: str = "stable"
    """Which blocks are copied to the cold store as soon as they are computed."""
    message_class: str = "system_pinned"
    """Which cache class a chat message's segment gets from its role."""
    checkpoint: str = "every_block"
    """After which blocks a model with recurrent layers keeps a checkpoint of its
    recurrent state (``every_block``; ``kv_sized``: where the block's KV bytes are at least
    the checkpoint's, and after stable classes)."""
    engine_turn: str = "least_served"
    """Which session's waiting engine call runs next (``least_served``: the command that
    has had the least engine time, so short requests are not queued behind long ones;
    ``fifo``: arrival order)."""


class DiskConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The disk tier under the RAM cold store: blocks that survive restarts and crashes."""

    path: str | None = None
    """Folder of the block files (default: ``$KVRT_CACHE_DIR/blocks``, else
    ``~/.cache/kvrt/blocks``). Processes may share it."""
    budget: Size | None = None
    """Bytes the tier may hold (default: 10 % of the free space where ``path`` lives;
    ``0`` turns the tier off)."""
    flush_timeout: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 30.0
    """Seconds closing the runtime waits for queued block writes to reach the disk."""


class RemoteConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A Redis/Valkey tier below disk, shared by many hosts."""

    url: str | None = None
    """The server, e.g. ``redis://127.0.0.1:6379/0`` (default: none, the tier is off)."""
    timeout: Annotated[float, msgspec.Meta(gt=0.0, le=60.0)] = 2.0
    """Seconds one call to the server may take before the tier counts as down."""
    secret_file: str | None = None
    """A file holding the secret the replicas sharing the server sign and name their
    values with (at least 16 bytes; or the secret itself in ``KVRT_REMOTE_SECRET``, never
    a flag). Without one the tier trusts every writer of the server."""
    ca_file: str | None = None
    """The CA certificate a ``rediss://`` server's certificate is checked against
    (default: the system's)."""


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """kvrt's whole configuration."""

    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    """Memory policy (``[memory]``)."""
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    """Engine and model (``[engine]``)."""
    session: SessionConfig = msgspec.field(default_factory=SessionConfig)
    """How sessions cut and keep context (``[session]``)."""
    policies: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    """Policies by registered name (``[policies]``)."""
    disk: DiskConfig = msgspec.field(default_factory=DiskConfig)
    """The disk tier (``[disk]``)."""
    remote: RemoteConfig = msgspec.field(default_factory=RemoteConfig)
    """The remote tier (``[remote]``)."""


class Setting(msgspec.Struct, frozen=True):
    """One configurable field, its environment variable and its command-line flag
    (:data:`SETTINGS` lists them all)."""

    section: str
    """The config file's section (``memory``)."""
    name: str
    """The field in that section (``cold``)."""
    env: str
    """The environment variable that sets it (``KVRT_MEM_COLD``)."""
    kind: Literal["size", "fraction", "value"] = "value"
    """How its text is read: a size (``512MiB``), a fraction of 1, or as the field is."""

    @property
    def flag(self) -> str:
        return "--" + self.env.removeprefix("KVRT_").lower().replace("_", "-")

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"


SETTINGS: tuple[Setting, ...] = (
    Setting("memory", "cold", "KVRT_MEM_COLD", "size"),
    Setting("memory", "max", "KVRT_MEM_MAX", "size"),
    Setting("memory", "reserve", "KVRT_MEM_RESERVE", "size"),
    Setting("memory", "headroom", "KVRT_MEM_HEADROOM", "fraction"),
    Setting("memory", "overhead", "KVRT_MEM_OVERHEAD", "size"),
    Setting("engine", "backend", "KVRT_BACKEND"),
    Setting("engine", "model", "KVRT_MODEL"),
    Setting("engine", "kv_type", "KVRT_KV_TYPE"),
    Setting("engine", "threads", "KVRT_THREADS"),
    Setting("engine", "context", "KVRT_CONTEXT"),
    Setting("engine", "hot_tokens", "KVRT_HOT_TOKENS"),
    Setting("engine", "batch", "KVRT_BATCH"),
    Setting("engine", "parallel", "KVRT_PARALLEL"),
    Setting("engine", "together", "KVRT_TOGETHER"),
    Setting("engine", "openvino_profile", "KVRT_OPENVINO_PROFILE"),
    Setting("engine", "require_exact", "KVRT_REQUIRE_EXACT"),
    Setting("engine", "flash_attention", "KVRT_FLASH_ATTENTION"),
    Setting("engine", "kernel_policy", "KVRT_KERNEL_POLICY"),
    Setting("engine", "chat_template", "KVRT_CHAT_TEMPLATE"),
    Setting("session", "block_tokens", "KVRT_BLOCK_TOKENS"),
    Setting("session", "sink_tokens", "KVRT_SINK_TOKENS"),
    Setting("session", "recent_tokens", "KVRT_RECENT_TOKENS"),
    Setting("session", "long_context", "KVRT_LONG_CONTEXT"),
    Setting("session", "cold_wait", "KVRT_COLD_WAIT"),
    Setting("disk", "path", "KVRT_DISK_PATH"),
    Setting("disk", "budget", "KVRT_DISK_BUDGET", "size"),
    Setting("disk", "flush_timeout", "KVRT_DISK_FLUSH_TIMEOUT"),
    Setting("remote", "url", "KVRT_REMOTE_URL"),
    Setting("remote", "timeout", "KVRT_REMOTE_TIMEOUT"),
    Setting("remote", "secret_file", "KVRT_REMOTE_SECRET_FILE"),
    Setting("remote", "ca_file", "KVRT_REMOTE_CA_FILE"),
    Setting("policies", "hot_eviction", "KVRT_HOT_EVICTION"),
    Setting("policies", "cold_victim", "KVRT_COLD_VICTIM"),
    Setting("policies", "cold_admission", "KVRT_COLD_ADMISSION"),
    Setting("policies", "restore", "KVRT_RESTORE_POLICY"),
    Setting("policies", "approximate", "KVRT_APPROXIMATE_POLICY"),
    Setting("policies", "partial_window", "KVRT_PARTIAL_WINDOW_POLICY"),
    Setting("policies", "write_through", "KVRT_WRITE_THROUGH_POLICY"),
    Setting("policies", "checkpoint", "KVRT_CHECKPOINT_POLICY"),
    Setting("policies", "message_class", "KVRT_MESSAGE_CLASS_POLICY"),
    Setting("policies", "engine_turn", "KVRT_ENGINE_TURN_POLICY"),
)
"""Every setting a config file, an environment variable and a command-line flag can make."""
_BY_PATH = {s.path: s for s in SETTINGS}
_BY_NAME = {s.name: s for s in SETTINGS}


def _fraction(value: Any) -> Any:
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return float(value.strip()[:-1]) / 100.0
        except ValueError:
            raise ValueError(f"expected a fraction such as 0.1 or '10%', got {value!r}") from None
    return value


def _normalize(layer: dict[str, Any], source: Mapping[str, str]) -> None:
    """Turn size and percent strings into numbers in place, naming the source on error."""
    for path, setting in _BY_PATH.items():
        section = layer.get(setting.section)
        if not isinstance(section, dict) or setting.name not in section:
            continue
        value = section[setting.name]
        try:
            if setting.kind == "size" and isinstance(value, (str, int)) and value is not None:
                section[setting.name] = parse_size(value)
            elif setting.kind == "fraction":
                section[setting.name] = _fraction(value)
        except ValueError as exc:
            raise ConfigError(f"invalid {path} from {source.get(path, 'config')}: {exc}") from None


def _validate(layer: dict[str, Any], source: Mapping[str, str], default: str) -> None:
    _normalize(layer, source)
    for section, fields in layer.items():
        for name, value in fields.items() if isinstance(fields, dict) else ():
            if isinstance(value, str) and "\x00" in value:  # no path or name can hold one
                path = f"{section}.{name}"
                raise ConfigError(
                    f"invalid {path} from {source.get(path, default)}: it holds a NUL character"
                )
    try:
        msgspec.convert(layer, Config, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        where = default
        head, sep, at = message.rpartition(" - at `$.")
        if sep:
            path = at.rstrip("`")
            where = source.get(path, default)
            message = f"invalid {path} from {where}: {head}{_choices(path)}"
        else:
            message = f"invalid configuration from {where}: {message}"
        raise ConfigError(message) from None


def _choices(path: str) -> str:
    section, _, name = path.partition(".")
    struct = {
        "memory": MemoryConfig,
        "engine": EngineConfig,
        "session": SessionConfig,
        "disk": DiskConfig,
        "remote": RemoteConfig,
    }.get(section)
    if struct is None or not name:
        return ""
    hint = typing.get_type_hints(struct).get(name)
    allowed = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
    return f" (expected one of: {', '.join(map(str, allowed))})" if allowed else ""


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value


def _read_file(path: Path) -> dict[str, Any]:
    raw = read_small_file(path, MAX_CONFIG_BYTES, "config file")
    try:
        if path.suffix.lower() == ".toml":
            data: Any = tomllib.loads(raw.decode("utf-8"))
        elif path.suffix.lower() == ".json":
            data = msgspec.json.decode(raw)
        else:
            raise ConfigError(f"config file {path} must end in .toml or .json")
    except (tomllib.TOMLDecodeError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of sections")
    return data


def _layer(values: Mapping[str, Any], describe: Any) -> tuple[dict[str, Any], dict[str, str]]:
    layer: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, value in values.items():
        setting = _BY_NAME.get(key) or _BY_PATH.get(key)
        if setting is None:
            raise ConfigError(f"unknown setting {key!r}")
        layer.setdefault(setting.section, {})[setting.name] = value
        source[setting.path] = describe(setting)
    return layer, source


def check_config(config: Config) -> Config:
    """``config`` checked against every field's constraints (a Struct built in code skips
    them), or a :class:`ConfigError` naming the field."""
    try:
        raw = msgspec.to_builtins(config)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid configuration from the Config passed in: {exc}") from None
    _validate(raw, {}, "the Config passed in")
    return msgspec.convert(raw, Config, strict=False)


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration from a file, the environment and flags, later winning.

    ``path`` defaults to ``$KVRT_CONFIG``; ``env`` defaults to ``os.environ``; ``flags``
    maps setting names (``"cold"``, ``"kv_type"``) or paths (``"memory.cold"``) to values,
    ``None`` values being ignored.
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"path must be a str or a path, got {type(path).__name__}")
    for label, given in (("env", env), ("flags", flags)):
        if given is not None and not isinstance(given, Mapping):
            raise ArgumentTypeError(f"{label} must be a mapping, got {type(given).__name__}")
    env = os.environ if env is None else env
    if bad := [k for k, v in env.items() if str(k).startswith("KVRT_") and not isinstance(v, str)]:
        raise ArgumentTypeError(f"environment values must be str, {bad[0]} is not")
    merged: dict[str, Any] = {}

    file_path = path if path is not None else (env.get(CONFIG_ENV) or None)
    if file_path is not None:
        file_layer = _read_file(Path(file_path))
        file_source = {p: f"config file {file_path}" for p in _BY_PATH}
        _validate(file_layer, file_source, f"config file {file_path}")
        _merge(merged, file_layer)

    env_values = {s.path: env[s.env] for s in SETTINGS if env.get(s.env, "").strip()}
    env_layer, env_source = _layer(env_values, lambda s: f"environment variable {s.env}")
    _validate(env_layer, env_source, "the environment")
    _merge(merged, env_layer)

    flag_values = {k: v for k, v in (flags or {}).items() if v is not None}
    flag_layer, flag_source = _layer(flag_values, lambda s: f"flag {s.flag}")
    _validate(flag_layer, flag_source, "the command line")
    _merge(merged, flag_layer)

    return msgspec.convert(merged, Config, strict=False)
