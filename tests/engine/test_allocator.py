"""What kvrt frees goes back to the system in the processes it owns: glibc's mmap threshold
fixed (``kvrt.native_bridge.memory``), measured in child processes (the setting is the
whole process's)."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from kvrt.native_bridge import BridgeArgumentError
from kvrt.native_bridge.memory import MAX_MMAP_THRESHOLD, fix_mmap_threshold

pytestmark = pytest.mark.subprocess

# A cold block's worth of bytes freed once (glibc raises its threshold to its size), then
# forty more kept and freed but the last: how much the process still holds, in MiB.
HELD_AFTER_FREEING = """
import sys
from kvrt.native_bridge.memory import fix_mmap_threshold

if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

block = 3 * 1024 * 1024
first = bytearray(block)
del first
before = rss_mib()
kept = [bytearray(block) for _ in range(40)]
last = kept.pop()
del kept
print(rss_mib() - before)
"""


def held_mib(mode: str) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(HELD_AFTER_FREEING), mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_freed_blocks_go_back_to_the_system_with_the_threshold_fixed() -> None:
    default, fixed = held_mib("default"), held_mib("fixed")
    assert default > 60  # the heap's top is held by the one block still alive
    assert fixed < 10  # only that block: every other one was a mapping, unmapped


def test_a_threshold_glibc_would_refuse_is_refused_before_the_call() -> None:
    for bad in (0, -1, MAX_MMAP_THRESHOLD + 1):
        with pytest.raises(BridgeArgumentError, match="mmap threshold"):
            fix_mmap_threshold(bad)
