"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._engine.contract import SamplingParams
from .._errors import InvalidArgumentError

__all__ = ["Sampler", "log_softmax"]


def log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Log-probabilities of ``logits`` (``-inf`` stays ``-inf``: a masked token)."""
    x = logits.astype(np.float64)
    top = float(np.max(x))
    return x - (top + float(np.log(np.sum(np.exp(x - top)))))


class Sampler:
    """Stateful token chooser; the same seed and logits give the same tokens.

    >>> Sampler(SamplingParams()).choose(np.array([0.1, 2.0, -1.0], dtype=np.float32))
    1
    """

    def __init__(self, params: SamplingParams, n_vocab: int | None = None) -> None:
        self.params = params  # checked when it was built
        self._rng = np.random.default_rng(params.seed)
        bias = params.logit_bias or {}
        if n_vocab is not None and bias and max(bias) >= n_vocab:
            raise InvalidArgumentError(
                f"logit_bias names token {max(bias)}, past this model's vocabulary "
                f"({n_vocab:,} tokens)",
                param="sampling.logit_bias",
            )
        self._biased = np.fromiter(bias, dtype=np.int64, count=len(bias))
        self._bias = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))

    def choose(self, logits: npt.NDArray[np.float32]) -> int:
        p = self.params
        if self._bias.size:
            logits = logits.copy()
            logits[self._biased] += self._bias
        if p.temperature == 0.0 or p.top_k == 1:
            return int(np.argmax(logits))
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = logits.astype(np.float64) / p.temperature
        if not np.all(np.isfinite(scaled) | np.isneginf(logits)):
            # So small a temperature that the scaled logits overflow: greedy, its limit.
            return int(np.argmax(logits))
        order = np.argsort(-scaled, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        kept = scaled[order]
        probs = np.exp(kept - kept[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            cutoff = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            order, probs = order[:cutoff], probs[:cutoff] / probs[:cutoff].sum()
        return int(order[self._rng.choice(len(order), p=probs)])
