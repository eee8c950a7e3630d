"""A fresh virtual environment with kvrt (editable) and the frameworks that pin what the
test environment's others cannot share (LlamaIndex's OpenAI integration: ``openai<3``;
Instructor: ``jiter<0.15``)."""

from __future__ import annotations

import fcntl
import subprocess
import threading
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
    venv.EnvBuilder(with_pip=True, clear=True).create(folder)  # a half build's remains go
    python = str(folder / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    # --no-compile: a program compiles what it imports (a third of the 50 s install is
    # compiling 400 MB of packages the tests never import)
    run(*pip, "install", "--no-compile", "-e", str(ROOT), *PINNING_FRAMEWORKS)
    return python


class Background:
    """:func:`fresh_environment` in ``folder``, built in a thread from the start of a test
    run (pip's work overlaps the tests before the first that needs it), once for all the
    processes that ask for that folder (a run's workers)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._python: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, name="pinning-env", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            lock = self.folder.with_name(self.folder.name + ".lock")
            with lock.open("w") as held:
                fcntl.flock(held, fcntl.LOCK_EX)  # the run's other workers wait here
                built = self.folder / ".built"
                if not built.exists():
                    fresh_environment(self.folder)
                    built.touch()
            self._python = str(self.folder / "bin" / "python")
        except BaseException as exc:  # handed to the test that asks for the environment
            self._error = exc

    def python(self) -> str:
        """The environment's Python, once built (the build's error if it failed)."""
        self.join()
        if self._error is not None:
            raise self._error
        assert self._python is not None
        return self._python

    def join(self) -> None:
        self._thread.join()
