"""``kvrt bench`` (quick and full, with its plot) and the engine-layer figures, each
printing figures measured side by side in one run; the research benchmarks live in the
repository's ``benchmarks/``, outside the wheel.

    kvrt bench [--quick]
    python -m kvrt.bench.engine_figures [--backend openvino]

The modules: the PNG of ``kvrt bench`` (:mod:`.plot`), the full set of figures
(:mod:`.full`), the cold tiers' parts timed one by one (:mod:`.tiers`), the quick
session-level figures (:mod:`.quick`), the engine-layer figures (:mod:`.engine_figures`)
and the engine's own way of doing the work without kvrt (:mod:`.reference`). Dependencies
run one way, in the order of :data:`LAYERS`; the architecture test holds it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from kvrt import context_tokens

__all__ = ["context_tokens", "own_disk_tier"]


@contextmanager
def own_disk_tier() -> Iterator[str]:
    """Point the disk tier's default folder (``$KVRT_CACHE_DIR``) at a temporary one for a
    benchmark's run, removed afterwards, so the run measures what it computed itself, not
    blocks an earlier run left on disk. An explicit ``disk.path`` still wins."""
    before = os.environ.get("KVRT_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="kvrt-bench-") as folder:
        os.environ["KVRT_CACHE_DIR"] = folder
        try:
            yield folder
        finally:
            if before is None:
                os.environ.pop("KVRT_CACHE_DIR", None)
            else:
                os.environ["KVRT_CACHE_DIR"] = before


LAYERS = (
    "plot",
    "full",
    "tiers",
    "quick",
    "engine_figures",
    "reference",
)
"""The modules from the top down: each imports only those after it."""
