"""kvrt installs under one import root, and a user's packages with generic names
(``policies``, ``adapters``, ``native_bridge``) never reach it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_only_kvrt(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("kvrt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kvrt", wheel.name.split("-py3")[0] + ".dist-info"}
    # Every package of the source tree is in the wheel (a package left out of pyproject's
    # list would import from a checkout and fail once installed).
    sources = {
        str(p.relative_to(ROOT)).replace("adapters/", "kvrt/adapters/", 1)
        for p in (ROOT / "kvrt").rglob("*.py")
        if "__pycache__" not in p.parts and not p.is_symlink()
    }
    assert {"kvrt/_session/actor.py", "kvrt/_cold/store.py"} <= sources <= set(names)
    for package in ("adapters/llama", "adapters/openvino", "native_bridge", "policies"):
        assert f"kvrt/{package}/__init__.py" in names
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).split() == [b"kvrt"]


USER_PROJECT = textwrap.dedent(
    """
    import anyio, kvrt, policies, adapters, native_bridge
    assert policies.MINE and adapters.MINE and native_bridge.MINE

    async def main():
        async with kvrt.open_runtime("llama") as rt, rt.open_session(hot_tokens=512) as s:
            await s.ensure_context([kvrt.Segment("user", "Once upon a time")])
            print("GENERATED", len(await s.generate_text(4, stop_at_end=False)) > 0)

    anyio.run(main)
    """
)


def test_a_user_project_with_generic_package_names(tmp_path: Path) -> None:
    for name in ("policies", "adapters", "native_bridge"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("MINE = True\n")
    proc = subprocess.run(
        [sys.executable, "-c", USER_PROJECT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # the user's project comes first on sys.path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["GENERATED", "True"]
