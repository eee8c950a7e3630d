"""A fresh virtual environment with kvrt (editable) and the frameworks that pin what the
test environment's others cannot share (LlamaIndex's OpenAI integration: ``openai<3``;
Instructor: ``jiter<0.15``)."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINNING_FRAMEWORKS = ("llama-index-llms-openai", "llama-index-core", "instructor")
PINNING_IMPORTS = ("llama_index", "instructor")
"""What a program imports that runs in that environment only."""


def run(*args: str, timeout: float = 900) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-4000:])
    return done.stdout


def fresh_environment(folder: Path) -> str:
    """A new environment in ``folder`` holding kvrt and :data:`PINNING_FRAMEWORKS`, as
    pip resolves them with nothing else installed: its Python's path."""
    venv.EnvBuilder(with_pip=True).create(folder)
    python = str(folder / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    run(*pip, "install", "-e", str(ROOT), *PINNING_FRAMEWORKS)
    return python
