"""``llama-server``, the C++ server of the llama.cpp that llama-cpp-python vendors: found
or built once, for the benchmarks that run it beside ``kvrt serve``.

Found: ``$KVRT_LLAMA_SERVER`` (a path), else the build cached under
``~/.cache/kvrt/peer/`` for the installed llama-cpp-python's version. Built: the
llama-cpp-python source distribution of that version, from the package index (its
``vendor/llama.cpp``), configured with nothing that reaches the network (no prebuilt web
UI, no HTTPS), linked statically, ``llama-server`` alone. About five minutes on two cores,
once; builds started at once by several processes wait on one lock and build once.

    python -m benchmarks._peer     # build (or find) it; prints its path
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["PeerUnavailable", "llama_server"]

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build downloads the web UI
]


class PeerUnavailable(RuntimeError):
    """``llama-server`` could not be found or built here (the reason says why)."""


def version() -> str:
    """The installed llama-cpp-python's version: the llama.cpp kvrt runs."""
    return importlib.metadata.version("llama-cpp-python")


def cached_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvrt" / "peer" / f"llama-server-{version()}"


def llama_server(*, build: bool = True) -> Path:
    """The ``llama-server`` binary: ``$KVRT_LLAMA_SERVER``, else the cached build, else
    (when ``build``) built now, its log beside it. Raises :class:`PeerUnavailable` with
    the reason."""
    given = os.environ.get("KVRT_LLAMA_SERVER")
    if given:
        path = Path(given)
        if not os.access(path, os.X_OK):
            raise PeerUnavailable(f"KVRT_LLAMA_SERVER={given} is not an executable file")
        return path
    binary = cached_path()
    if binary.exists():
        return binary
    if not build:
        raise PeerUnavailable(f"llama-server is not built ({binary} is missing)")
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it
        if not binary.exists():
            _build(binary, binary.parent / "build.log")
    return binary


def _build(binary: Path, log: Path) -> None:
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise PeerUnavailable(f"building llama-server needs {tool}, which is not installed")
    with tempfile.TemporaryDirectory(prefix="kvrt-peer-") as work_dir:
        work = Path(work_dir)
        out = open(log, "w")  # noqa: SIM115 (closed below)
        try:
            _run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                 "--no-binary", ":all:", f"llama-cpp-python=={version()}", "-d", str(work)],
                out, log, "downloading llama-cpp-python's source",
            )  # fmt: skip
            (archive,) = work.glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(archive) as tar:
                members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
                tar.extractall(work, members=members, filter="data")
            (source,) = work.glob("llama_cpp_python-*/vendor/llama.cpp")
            build = work / "build"
            _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], out, log, "cmake")
            jobs = str(len(os.sched_getaffinity(0)))
            _run(
                ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
                out, log, "building llama-server",
            )  # fmt: skip
            built = build / "bin" / "llama-server"
            staged = binary.with_name(binary.name + ".partial")
            shutil.copy2(built, staged)
            staged.replace(binary)  # whole or not at all
        finally:
            out.close()


def _run(command: list[str], out: IO[str], log: Path, what: str) -> None:
    done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise PeerUnavailable(f"{what} failed (exit {done.returncode}); its output: {log}")


if __name__ == "__main__":
    print(llama_server())
