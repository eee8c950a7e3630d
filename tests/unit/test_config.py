"""Configuration: file < environment < flags, and one clear error per bad value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrt import Config, ConfigError, DiskConfig, load_config, parse_size
from kvrt._config import check_config

pytestmark = pytest.mark.model

GiB = 1024**3
MiB = 1024**2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MiB),
        ("8GiB", 8 * GiB),
        ("1.5GiB", int(1.5 * GiB)),
        ("2GB", 2 * 10**9),
        ("1024", 1024),
        (" 3 KiB ", 3072),
        (0, 0),
        (4096, 4096),
    ],
)
def test_sizes(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "8XB", "-1", "1.2.3GiB", "", True, -5])
def test_bad_sizes(bad: str | int) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_defaults_need_nothing() -> None:
    assert load_config(env={}) == Config()


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "kvrt.toml"
    path.write_text(
        '[memory]\ncold = "2GiB"\nheadroom = "20%"\n[engine]\nkv_type = "q8_0"\nthreads = 2\n'
    )
    cfg = load_config(path, env={})
    assert cfg.memory.cold == 2 * GiB
    assert cfg.memory.headroom == pytest.approx(0.2)
    assert cfg.engine.kv_type == "q8_0"
    assert cfg.engine.threads == 2


def test_json_file_through_env_variable(tmp_path: Path) -> None:
    path = tmp_path / "kvrt.json"
    path.write_text('{"memory": {"max": 1073741824, "reserve": "256MiB"}}')
    cfg = load_config(env={"KVRT_CONFIG": str(path)})
    assert cfg.memory.max == GiB
    assert cfg.memory.reserve == 256 * MiB


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvrt.toml"
    path.write_text('[memory]\ncold = "1GiB"\nmax = "8GiB"\nreserve = "1GiB"\n')
    env = {"KVRT_MEM_COLD": "2GiB", "KVRT_MEM_MAX": "4GiB"}
    cfg = load_config(path, env=env, flags={"cold": "3GiB"})
    assert cfg.memory.cold == 3 * GiB  # flag wins
    assert cfg.memory.max == 4 * GiB  # env beats file
    assert cfg.memory.reserve == GiB  # file alone
    assert load_config(path, env=env, flags={"cold": None}).memory.cold == 2 * GiB


def test_every_memory_env_variable() -> None:
    env = {
        "KVRT_MEM_COLD": "1GiB",
        "KVRT_MEM_MAX": "2GiB",
        "KVRT_MEM_RESERVE": "512MiB",
        "KVRT_MEM_HEADROOM": "0.15",
        "KVRT_HOT_TOKENS": "1024",
        "KVRT_CONTEXT": "4096",
    }
    cfg = load_config(env=env)
    assert (cfg.memory.cold, cfg.memory.max, cfg.memory.reserve) == (GiB, 2 * GiB, 512 * MiB)
    assert cfg.memory.headroom == pytest.approx(0.15)
    assert (cfg.engine.hot_tokens, cfg.engine.context) == (1024, 4096)


def test_empty_env_variable_is_unset() -> None:
    assert load_config(env={"KVRT_MEM_COLD": "  "}).memory.cold is None


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        (
            {"KVRT_MEM_COLD": "lots"},
            {},
            "invalid memory.cold from environment variable KVRT_MEM_COLD: expected a size",
        ),
        ({}, {"cold": "8XB"}, "invalid memory.cold from flag --mem-cold: unknown size unit 'XB'"),
        (
            {"KVRT_MEM_HEADROOM": "1.5"},
            {},
            "invalid memory.headroom from environment variable KVRT_MEM_HEADROOM: Expected `float` < 1.0",
        ),
        (
            {},
            {"headroom": "ten%"},
            "invalid memory.headroom from flag --mem-headroom: expected a fraction",
        ),
        (
            {"KVRT_THREADS": "0"},
            {},
            "invalid engine.threads from environment variable KVRT_THREADS: Expected `int` >= 1",
        ),
        (
            {},
            {"kv_type": "q9"},
            "invalid engine.kv_type from flag --kv-type: Invalid enum value 'q9' (expected one of: f32, f16, bf16, q8_0",
        ),
        (
            {"KVRT_BACKEND": "cuda"},
            {},
            "invalid engine.backend from environment variable KVRT_BACKEND",
        ),
        (
            {},
            {"threads": "two"},
            "invalid engine.threads from flag --threads: Expected `int | null`, got `str`",
        ),
    ],
)
def test_bad_values_name_field_and_source(
    env: dict[str, str], flags: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env, flags=flags)
    assert str(info.value).startswith(message), str(info.value)


def test_bad_value_in_file_names_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[memory]\ncold = "much"\n')
    with pytest.raises(
        ConfigError, match=rf"invalid memory.cold from config file {path}: expected a size"
    ):
        load_config(path, env={})


def test_unknown_field_in_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[memory]\ncolde = 1\n")
    with pytest.raises(
        ConfigError, match=r"invalid memory from config file .*unknown field `colde`"
    ):
        load_config(path, env={})


def test_broken_and_missing_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[memory\n")
    with pytest.raises(ConfigError, match="is not valid toml"):
        load_config(broken, env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml", env={})
    other = tmp_path / "kvrt.yaml"
    other.write_text("memory: {}")
    with pytest.raises(ConfigError, match=r"must end in \.toml or \.json"):
        load_config(other, env={})


def test_cli_bad_value_is_one_line_not_a_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", "--mem-cold", "lots"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "kvrt: error: invalid memory.cold from flag --mem-cold: expected a size such as "
        "'512MiB', '8GiB' or a byte count, got 'lots'"
    )


def test_a_nul_in_a_path_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"invalid disk\.path from flag --disk-path: .*NUL"):
        load_config(env={}, flags={"disk.path": "blocks\x00x"})
    with pytest.raises(ConfigError, match=r"invalid disk\.path from the Config passed in: .*NUL"):
        check_config(Config(disk=DiskConfig(path="a\x00b")))
    path = tmp_path / "nul.toml"
    path.write_text('[disk]\npath = "a\\u0000b"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"kvrt: error: invalid disk.path from config file {path}: it holds a NUL character"
    )


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_engine_threads_default_to_the_cpus_the_process_may_run_on() -> None:
    """Pinned to one core (``taskset -c 0``, a benchmark's server), an engine runs one
    thread, not one per core of the machine spinning on that one."""
    from kvrt._util import physical_cores

    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert physical_cores() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert physical_cores() >= 1
