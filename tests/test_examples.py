"""The examples run as they are."""

from __future__ import annotations

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
