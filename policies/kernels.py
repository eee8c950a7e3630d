"""Which kernel configuration an engine runs, among those the kernel probe measured.

The probe (run once per CPU, build, model, KV type and thread count, and cached) computes
the same tokens cut several ways under each configuration the engine offers, and times
each. A configuration whose cuts disagree would make a restore differ from computing
again, and kvrt's output from the engine's own: it is never chosen here.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrt.policy import KernelSetting, register

__all__ = ["FastestExact"]

KIND = "kernels"


@register(KIND, "fastest_exact")
class FastestExact:
    """The default unless another exact configuration is faster at both computing a
    batch and decoding one token at a time, by ``margin`` (5 %) or more: a speed-up that
    costs decoding speed (flash attention over thousands of cells, on some CPUs) is not
    taken. Among several such, the one whose slower gain is largest. None when no
    configuration is exact (``fastest_exact:0.2`` asks for 20 %)."""

    def __init__(self, margin: float | str = 0.05) -> None:
        self.margin = float(margin)
        if not 0 <= self.margin < 10:
            raise ValueError(f"the margin is a fraction in [0, 10), got {margin!r}")

    def choose(self, settings: Sequence[KernelSetting]) -> int | None:
        exact = [i for i, s in enumerate(settings) if s.exact]
        if not exact:
            return None
        base = settings[exact[0]]
        best, gain = exact[0], 1.0 + self.margin
        for i in exact[1:]:
            s = settings[i]
            slower = min(
                s.prefill_tps / max(base.prefill_tps, 1e-9),
                s.decode_tps / max(base.decode_tps, 1e-9),
            )
            if slower >= gain:
                best, gain = i, slower
        return best
