"""Whether a cold block computed after a different prefix may stand in for recomputing it."""

from __future__ import annotations

import math

from kvrt.policy import ApproximateQuery, CacheClass, register

from ._knobs import share

__all__ = ["AllowApproximate", "AllowStableApproximate", "BlendApproximate", "NeverApproximate"]

KIND = "approximate"


@register(KIND, "never")
class NeverApproximate:
    """Only exact hits are restored: the context always equals a fresh prefill."""

    def accept(self, query: ApproximateQuery) -> bool:
        return False


@register(KIND, "allow")
class AllowApproximate:
    """Every approximate hit of at least ``min_tokens`` is restored with a RoPE fix-up."""

    min_tokens = 16

    def accept(self, query: ApproximateQuery) -> bool:
        return query.n_tokens >= self.min_tokens


@register(KIND, "stable_only")
class AllowStableApproximate:
    """Approximate hits only for blocks of stable content (repo maps, pinned task text).

    Files and turns (volatile) are recomputed; a repo map or a system prompt after a
    changed history is restored with a RoPE fix-up.
    """

    min_tokens = 16

    def accept(self, query: ApproximateQuery) -> bool:
        return query.cache_class is not CacheClass.VOLATILE and query.n_tokens >= self.min_tokens


@register(KIND, "blend")
class BlendApproximate:
    """Every approximate hit of at least ``min_tokens``, with the first ``ratio`` of each
    run of hits computed afresh and the rest restored (``approximate="blend:0.3"`` sets the
    ratio; 0 restores everything like ``allow``, 1 computes everything).

    The tokens right after a changed prefix are the ones that attended to the old prefix
    most directly; computing them afresh gives the restored rest fresh KV to attend to
    where it matters most (CacheBlend's selective recompute, chosen by position: kvrt
    cannot read the engine's intermediate layers on CPU to pick the tokens whose KV
    deviates most).

    Measured (``kvrt bench --fidelity``, a haystack first computed after another pass key):
    ratios 0.05 to 0.3 left the gold answer's log-prob where ratio 0 had it; only 1 (all
    computed) matched a fresh computation. Hence the default ratio 0, the cheapest.
    """

    min_tokens = 16
    DEFAULT_RATIO = 0.0

    def __init__(self, ratio: str | float = DEFAULT_RATIO) -> None:
        self.ratio = share(ratio, "blend ratio")

    def accept(self, query: ApproximateQuery) -> bool:
        return query.n_tokens >= self.min_tokens

    def recompute_tokens(self, query: ApproximateQuery) -> int:
        run_start = query.start if query.run_start is None else query.run_start
        run_tokens = query.n_tokens if query.run_tokens is None else query.run_tokens
        fresh_until = run_start + math.ceil(self.ratio * run_tokens)
        return max(0, min(query.n_tokens, fresh_until - query.start))
