"""Live memory readings for capacity planning."""

from __future__ import annotations

from .capacity import MemoryReading

__all__ = ["read_memory"]


def read_memory(*, hot_in_host_memory: bool = True) -> MemoryReading:
    """Free and total host RAM now; ``None`` fields where psutil cannot tell."""
    free: int | None
    total: int | None
    try:
        import psutil

        vm = psutil.virtual_memory()
        free, total = int(vm.available), int(vm.total)
    except Exception:  # no psutil support on this platform: degrade, don't fail
        free = total = None
    return MemoryReading(
        free_bytes=free if hot_in_host_memory else None,
        total_bytes=total if hot_in_host_memory else None,
        host_free_bytes=free,
        host_total_bytes=total,
        hot_in_host_memory=hot_in_host_memory,
    )
