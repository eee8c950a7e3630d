"""The C allocator's settings, for a process that kvrt owns (``kvrt serve``, ``kvrt run``).

glibc's ``malloc`` serves a request of at least its mmap threshold with a mapping of its
own, returned to the system when freed; smaller ones come from its heaps, which keep freed
memory for reuse. The threshold starts at 128 KiB and, by default, rises to the size of
each mapped chunk freed (up to 32 MiB). kvrt frees many chunks of a few MB: a cold block's
bytes, an exported block, a grown context's buffers. After the first one, every later one
comes from the heaps, whose holes the next sizes seldom fit, and the process holds the
memory it freed. Fixing the threshold keeps each such chunk a mapping of its own: on the
peer benchmark's agents (``--idle-sessions 0``), 340 MiB peak RSS against 401 MiB, at the
same speed. ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment does the same for any
process, an embedding program's included.
"""

from __future__ import annotations

import ctypes
import sys

from ._errors import BridgeArgumentError

__all__ = ["MAX_MMAP_THRESHOLD", "fix_mmap_threshold"]

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit systems (``HEAP_MAX_SIZE / 2``)."""


def fix_mmap_threshold(threshold: int = 128 * 1024) -> bool:
    """Set glibc's mmap threshold to ``threshold`` bytes and stop it from rising; whether
    it was set (False where the C library is not glibc's)."""
    if not 0 < threshold <= MAX_MMAP_THRESHOLD:
        raise BridgeArgumentError(
            f"mmap threshold must be 1 to {MAX_MMAP_THRESHOLD} bytes, got {threshold}"
        )
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  # glibc's own symbol: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold) == 1)
