"""The examples run as they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.subprocess
def test_evict_and_restore_example() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "evict_and_restore.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "logits while evicted equal the reference: False" in proc.stdout
    assert "logits after restore equal the reference bit for bit: True" in proc.stdout


@pytest.mark.subprocess
def test_describe_example() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "describe_model.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "KV bytes per token: 23,040" in proc.stdout


@pytest.mark.subprocess
def test_concurrent_sessions_example() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "concurrent_sessions.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("consistent: True") == 3
    assert "exact hits" in proc.stdout


@pytest.mark.subprocess
def test_trio_sessions_example() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trio_sessions.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("consistent True") == 2


@pytest.mark.subprocess
def test_kvrt_run_restores_the_resent_file() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "run", "--sessions", "2", "--max-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["combined_logical_tokens"] > 2 * report["hot_tokens"]
    for session in report["sessions"]:
        first, _, third = session["turns"]
        assert first["file"] == third["file"]
        assert third["status"]["restored_tokens"] > 0
        # Only the question (and the one token recomputed for logits) is computed again.
        assert third["status"]["prefilled_tokens"] < 40
        assert all(t["status"]["hot_tokens"] <= session["hot_budget"] for t in session["turns"])
        assert all(t["text"] for t in session["turns"])
