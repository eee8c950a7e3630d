"""``describe``: model facts from two independent readers, and the resolved capacity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import msgspec
import pytest

from kvrt import (
    Config,
    EngineConfig,
    MemoryConfig,
    describe_model,
    embedded_model_path,
    load_config,
)
from kvrt._engine.model_files import read_gguf_metadata

pytestmark = pytest.mark.model

GiB = 1024**3


def test_embedded_model_facts() -> None:
    info = describe_model(Config())
    m = info.model
    assert (m.architecture, m.n_layers, m.n_head_kv, m.head_dim, m.trained_context) == (
        "llama",
        30,
        3,
        64,
        8192,
    )
    assert m.sliding_window is None and m.sliding_window_live is None
    # K and V rows of 3 heads x 64 dims in f16, for 30 layers.
    assert m.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2 == 23040
    assert m.weight_bytes > 50 * 1024**2 and m.file_bytes >= m.weight_bytes
    assert m.path == str(embedded_model_path())


def test_gguf_header_agrees_with_llama_cpp() -> None:
    meta = read_gguf_metadata(embedded_model_path())
    m = describe_model().model
    assert meta.n_layers == m.n_layers
    assert meta.n_head_kv == m.n_head_kv
    assert meta.head_dim_k == m.head_dim
    assert meta.trained_context == m.trained_context


def test_quantized_kv_bytes_per_token() -> None:
    m = describe_model(Config(engine=EngineConfig(kv_type="q8_0"))).model
    # q8_0 packs 32 values in 34 bytes: 192-value rows take 204 bytes.
    assert m.kv_bytes_per_token == 30 * 2 * (3 * 64 // 32) * 34 == 12240
    assert m.fingerprint != describe_model().model.fingerprint


def test_capacity_follows_config() -> None:
    info = describe_model(
        Config(memory=MemoryConfig(cold=GiB), engine=EngineConfig(hot_tokens=1024))
    )
    c = info.capacity
    assert c.hot_context_tokens == 1024
    assert c.cold_store_tokens == GiB // 23040
    assert c.planner_effective_context == min(8192, 1024 + GiB // 23040)
    assert info.memory.host_free_bytes is not None and info.memory.host_free_bytes > 0


def test_sliding_window_metadata(tmp_path: Path) -> None:
    path = tmp_path / "swa.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(18)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_embedding_length(640)
    writer.add_key_length(256)
    writer.add_value_length(256)
    writer.add_context_length(32768)
    writer.add_sliding_window(512)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    meta = read_gguf_metadata(path)
    assert (meta.architecture, meta.sliding_window, meta.head_dim_k, meta.n_head_kv) == (
        "gemma3",
        512,
        256,
        1,
    )
    assert meta.trained_context == 32768


def _kvrt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_cli_json() -> None:
    proc = _kvrt("describe", "--json", "--hot-tokens", "1024", env={"KVRT_MEM_COLD": "1GiB"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["model"]["kv_bytes_per_token"] == 23040
    assert data["capacity"]["hot_context_tokens"] == 1024
    assert data["capacity"]["host_cold_budget_bytes"] == GiB
    assert data["capacity"]["hot_limited_by"] == ["hot_cap"]


def test_the_disk_tier_in_capacity_and_on_the_command_line(tmp_path: Path) -> None:
    """Default: a tenth of the free space where the folder lives, under $KVRT_CACHE_DIR;
    ``disk.budget`` sets it, ``0`` turns the tier off; the planner counts it."""
    c = describe_model(Config()).capacity
    assert c.disk_path == str(Path(os.environ["KVRT_CACHE_DIR"]) / "blocks")
    free = shutil.disk_usage(os.environ["KVRT_CACHE_DIR"]).free
    assert abs(c.disk_budget_bytes - free // 10) < free // 100  # free space moves a little
    assert c.disk_store_tokens == c.disk_budget_bytes // 23040

    small = Config(memory=MemoryConfig(cold=GiB // 64), engine=EngineConfig(hot_tokens=1024))
    cfg = load_config(flags={"disk.budget": "0"})
    off = describe_model(msgspec.structs.replace(small, disk=cfg.disk)).capacity
    assert off.disk_budget_bytes == off.disk_store_tokens == 0
    cfg = load_config(flags={"disk.budget": "64MiB", "disk.path": str(tmp_path)})
    on = describe_model(msgspec.structs.replace(small, disk=cfg.disk)).capacity
    assert on.disk_store_tokens == 64 * 1024**2 // 23040 and on.disk_path == str(tmp_path)
    assert on.planner_effective_context == off.planner_effective_context + on.disk_store_tokens

    proc = _kvrt("describe", "--disk-path", str(tmp_path), "--disk-budget", "1GiB")
    assert proc.returncode == 0, proc.stderr
    assert "disk tier" in proc.stdout and "1.00 GiB" in proc.stdout
    proc = _kvrt("describe", "--json", env={"KVRT_DISK_BUDGET": "0"})
    assert json.loads(proc.stdout)["capacity"]["disk_budget_bytes"] == 0


def test_cli_table() -> None:
    proc = _kvrt("describe", str(embedded_model_path()))
    assert proc.returncode == 0, proc.stderr
    for expected in (
        "KV bytes per token",
        "23,040",
        "trained context",
        "8192 tokens",
        "planner context",
    ):
        assert expected in proc.stdout


@pytest.mark.parametrize("argv", [["describe", "--kv-type", "q3"], ["frobnicate"]])
def test_cli_usage_errors(argv: list[str]) -> None:
    proc = _kvrt(*argv)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["mamba2", "granitehybrid", "falcon-h1"])
def test_cli_table_of_a_model_with_recurrent_layers(name: str) -> None:
    """What a checkpoint costs and what a restore is, in the table; a recurrent model's
    cold budgets in checkpoints (it keeps no KV to count in tokens)."""
    from tests.support.models import zoo_path

    args = ("describe", "--model", zoo_path(name), "--mem-cold", "64MiB")
    proc = _kvrt(*args, env={"COLUMNS": "400"})  # wide enough that no cell folds
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "recurrent state" in out and "a checkpoint is 39,756 bytes" in out
    if name == "mamba2":
        assert "2: 2 recurrent" in out and f"({64 * 2**20 // 39756:,} checkpoints)" in out
        assert "nothing is paged out of the window" in out
        assert "the model keeps no KV" in out
    elif name == "falcon-h1":
        assert "2: 2 attention beside a recurrent mixer" in out
    else:
        assert "3: 1 global, 2 recurrent (rgr)" in out and "hybrid model: 2 of 3" in out
