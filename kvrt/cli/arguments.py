"""What every ``kvrt`` command shares: the settings flags, the config they load, argparse
types, and the one-line error."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from kvrt import (
    CONFIG_ENV,
    SETTINGS,
    Config,
    ConfigError,
    KvrtError,
    format_size,
    load_config,
    parse_size,
)

__all__ = [
    "LOCAL_CONFIG",
    "Parser",
    "check_writable",
    "common",
    "config_from",
    "count",
    "int_list",
    "kvrt_error",
    "seconds",
    "size",
]

LOCAL_CONFIG = "kvrt.toml"
"""Read from the working directory when neither --config nor $KVRT_CONFIG names a file."""

HELP = {
    "cold": "host-RAM cold store budget, e.g. 2GiB (default: 25%% of free RAM)",
    "max": "cap on memory kvrt plans for, e.g. 8GiB",
    "reserve": "memory left for everything else, e.g. 1GiB",
    "headroom": "fraction of usable memory kept free, e.g. 0.1 or 10%%",
    "overhead": "fixed per-context overhead to plan for",
    "backend": "engine backend: llama or openvino",
    "openvino_profile": "OpenVINO compile settings: deterministic or default",
    "require_exact": "refuse a KV precision whose restores cannot be bit-exact (true/false)",
    "long_context": "serve contexts past the model's trained one, approximately (true/false)",
    "model": "path of a GGUF model (default: the embedded SmolLM2-135M-Instruct)",
    "kv_type": "KV cache type: f32, f16, bf16, q8_0, ... (OpenVINO: f32, f16, bf16, u8)",
    "flash_attention": "llama.cpp flash attention: auto (the kernel probe's choice), on or off",
    "kernel_policy": "kernel policy choosing among the probed configurations (fastest_exact)",
    "chat_template": "a Jinja chat template file (or tokenizer_config.json) to use instead "
    "of the model's own",
    "threads": "engine threads (default: the physical cores this process may run on)",
    "context": "logical context a request asks for (caps hot and planner context)",
    "hot_tokens": "cap on the hot window in tokens",
    "batch": "prefill batch size in tokens",
    "parallel": "engine calls that may run at once across sessions",
    "together": "sessions whose steps may run in one engine call, where exact (1: alone)",
    "block_tokens": "tokens per cold-store block",
    "sink_tokens": "leading tokens that never leave the hot window",
    "recent_tokens": "trailing tokens that never leave the hot window",
    "hot_eviction": "hot eviction policy by name (class_lru, relevance, score_lru)",
    "cold_victim": "cold victim policy by name (class_lru)",
    "cold_admission": "which evicted blocks keep KV bytes (all, skip_small_volatile)",
    "restore": "restore-vs-recompute policy (always, never, size_threshold, calibrated)",
    "approximate": "approximate-hit policy (never, allow, stable_only, blend:R)",
    "partial_window": "partial-window KV once its prefix fits hot (recompute, keep)",
    "write_through": "blocks copied to the cold store once computed (stable, none, all)",
    "message_class": "a chat message's cache class by role (system_pinned, volatile)",
    "engine_turn": "which session's engine call runs next (least_served, fewest_left, fifo)",
    "checkpoint": "after which blocks a hybrid model keeps its recurrent state "
    "(every_block, kv_sized)",
    "path": "the disk tier's folder (default: $KVRT_CACHE_DIR/blocks)",
    "budget": "the disk tier's budget, e.g. 20GiB (default: 10%% of the free space; 0: off)",
    "flush_timeout": "seconds closing waits for queued disk writes",
    "url": "a Redis/Valkey server shared by replicas, e.g. redis://host:6379/0",
    "timeout": "seconds a call to the remote server may take",
    "secret_file": "a file holding the replicas' shared secret (or $KVRT_REMOTE_SECRET)",
    "ca_file": "a CA bundle for the remote server's TLS certificate",
    "cold_wait": "seconds an eviction waits for room in a full cold store",
}


def common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML or JSON config file (default: $KVRT_CONFIG, else ./{LOCAL_CONFIG} if there is one)",
    )
    group = parser.add_argument_group("settings (override the config file and KVRT_* variables)")
    for s in SETTINGS:
        group.add_argument(s.flag, dest=f"set_{s.name}", metavar="VALUE", help=HELP[s.name])


def config_from(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
    flags = {s.name: getattr(args, f"set_{s.name}") for s in SETTINGS}
    flags.update({k: v for k, v in (extra or {}).items() if v is not None})
    path = args.config
    if path is None and not os.environ.get(CONFIG_ENV) and Path(LOCAL_CONFIG).is_file():
        path = LOCAL_CONFIG
    return load_config(path, flags=flags)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit 2 (``--help`` shows usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvrt: error: {message} (see {self.prog} --help)\n")


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0 (at most a day)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, at most 86400, got {text}")
    return value


def size(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a byte size as people write it (``64MiB``) in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a size from {format_size(low)} to {format_size(high)}, got {text}"
            )
        return value

    return parse


def count(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"expected a number {bounds}, got {value}")
        return value

    return parse


def check_writable(path: str) -> None:
    """Refuse a --plot path that cannot be written (the file is made, or left, as it was)."""
    target = Path(path)
    existed = target.exists()
    try:
        with target.open("ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
    if not existed:
        target.unlink(missing_ok=True)


def kvrt_error(exc: BaseException) -> KvrtError | None:
    """The kvrt error behind ``exc`` (groups from concurrent sessions unwrapped), or None
    when something else went wrong too."""
    if isinstance(exc, KvrtError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [kvrt_error(e) for e in exc.exceptions]
        if found and all(e is not None for e in found):
            return found[0]
    return None
