"""Whether restoring a cold block beats recomputing it."""

from __future__ import annotations

from kvrt.policy import RestoreQuery, register

__all__ = ["AlwaysRestore", "CalibratedCost", "NeverRestore", "SizeThreshold"]

KIND = "restore"


@register(KIND, "always")
class AlwaysRestore:
    """Restore every exact hit: on these machines a restore is orders of magnitude cheaper."""

    def restore(self, query: RestoreQuery) -> bool:
        return True


@register(KIND, "never")
class NeverRestore:
    """Recompute every cold block: the baseline a benchmark measures restoring against."""

    def restore(self, query: RestoreQuery) -> bool:
        return False


@register(KIND, "size_threshold")
class SizeThreshold:
    """Recompute blocks below ``min_tokens`` (fixed per-restore overhead dominates there)."""

    min_tokens = 16

    def restore(self, query: RestoreQuery) -> bool:
        return query.n_tokens >= self.min_tokens


class _LineFit:
    """``y ≈ a + b·x`` by weighted least squares over observations, old ones fading.

    Starts at the prior ``(a, b)``. While the observed ``x`` barely vary (every restore the
    same size, say), only ``a`` is fitted and the slope is kept; neither coefficient goes
    below zero (costs never fall as blocks grow).
    """

    def __init__(self, a: float, b: float, *, decay: float) -> None:
        self.decay = decay
        self._s = [0.0] * 5  # Σw, Σwx, Σwxx, Σwy, Σwxy
        self.a, self.b = a, b
        self.n = 0

    def add(self, x: float, y: float, w: float = 1.0) -> None:
        s = [v * self.decay for v in self._s]
        s[0] += w
        s[1] += w * x
        s[2] += w * x * x
        s[3] += w * y
        s[4] += w * x * y
        self._s = s
        self.n += 1
        self._solve()

    def _solve(self) -> None:
        sw, sx, sxx, sy, sxy = self._s
        mean_x, mean_y = sx / sw, sy / sw
        var = max(sxx / sw - mean_x * mean_x, 0.0)
        if var > (0.1 * abs(mean_x)) ** 2 and var > 0.0:
            b = (sxy / sw - mean_x * mean_y) / var
            a = mean_y - b * mean_x
            if b < 0.0:
                a, b = mean_y, 0.0
            elif a < 0.0:
                a, b = 0.0, sxy / sxx
        else:
            b = self.b
            a = max(mean_y - b * mean_x, 0.0)
        self.a, self.b = a, b

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


@register(KIND, "calibrated")
class CalibratedCost:
    """Restore when the measured cost of restoring beats the measured cost of recomputing.

    Restore time is modelled as a fixed overhead plus bytes over bandwidth; prefill time per
    token grows linearly with the position (attention reads every earlier token). Both are
    fitted online from the runtime's real transfers and prefills (:meth:`observe_restore`,
    :meth:`observe_prefill`), recent ones weighing most. Until measurements arrive, the
    estimates start from deliberately neutral priors (0.5 ms + 2 GB/s; 1 ms per token), which
    favour restoring every block but the smallest.
    """

    MB = 1e6
    KPOS = 1e3

    def __init__(self) -> None:
        # seconds = overhead + MB · seconds_per_MB
        self.restore_fit = _LineFit(5e-4, 5e-4, decay=0.97)
        # seconds per token = base + (mid position / 1000) · growth
        self.prefill_fit = _LineFit(1e-3, 0.0, decay=0.97)

    # -- measurements --

    def observe_restore(self, n_bytes: int, seconds: float) -> None:
        if n_bytes > 0 and seconds > 0:
            self.restore_fit.add(n_bytes / self.MB, seconds)

    def observe_prefill(self, start: int, n_tokens: int, seconds: float) -> None:
        if n_tokens > 0 and seconds > 0:
            mid = (start + n_tokens / 2) / self.KPOS
            self.prefill_fit.add(mid, seconds / n_tokens, w=min(n_tokens / 64, 8.0))

    @property
    def observations(self) -> tuple[int, int]:
        """How many restores and prefills the estimates rest on."""
        return self.restore_fit.n, self.prefill_fit.n

    # -- estimates --

    def restore_seconds(self, n_bytes: int) -> float:
        return self.restore_fit(n_bytes / self.MB)

    def recompute_seconds(self, start: int, n_tokens: int) -> float:
        return n_tokens * self.prefill_fit((start + n_tokens / 2) / self.KPOS)

    def estimate(self, query: RestoreQuery) -> tuple[float, float]:
        """Estimated seconds to restore and to recompute the block."""
        return (
            self.restore_seconds(query.n_bytes),
            self.recompute_seconds(query.start, query.n_tokens),
        )

    def restore(self, query: RestoreQuery) -> bool:
        restore_s, recompute_s = self.estimate(query)
        return restore_s <= recompute_s

    def crossover(self, bytes_per_token: int, start: int = 0, limit: int = 65536) -> int | None:
        """The smallest block (tokens) at ``start`` that restoring wins; None if none up to ``limit``."""
        lo, hi = 1, limit
        if not self._wins(hi, bytes_per_token, start):
            return None
        while lo < hi:  # restoring gains on recomputing as blocks grow
            mid = (lo + hi) // 2
            if self._wins(mid, bytes_per_token, start):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _wins(self, n: int, bytes_per_token: int, start: int) -> bool:
        return self.restore_seconds(n * bytes_per_token) <= self.recompute_seconds(start, n)
