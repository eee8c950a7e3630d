"""Random contexts and operations, with random cancellation, for the fuzz tests."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

import kvrt
from tests.support.models import FILE_A, FILE_B, REPO_MAP, SYSTEM

SMALL: dict[str, Any] = dict(block_tokens=16, sink_tokens=4, recent_tokens=16)


PIECES = {
    "repo_map": REPO_MAP[:160],
    "file:a.py": FILE_A[:180],
    "file:b.py": FILE_B[:180],
    "file:c.py": FILE_A[300:420],
    "notes": "Notes: keep functions short; name things plainly.",
}


QUESTIONS = ["Explain add_1.", "What does mul_2 do?", "Compare the files.", "Summarize."]


def random_context(rng: random.Random) -> list[kvrt.Segment]:
    # Pieces keep one order, as an agent's context does: later contexts hit earlier blocks.
    names = sorted(rng.sample(sorted(PIECES), rng.randint(0, 3)), key=list(PIECES).index)
    return [
        kvrt.Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
        *(kvrt.Segment(n, PIECES[n]) for n in names),
        kvrt.Segment("user", rng.choice(QUESTIONS)),
    ]


RECENT: deque[str] = deque(maxlen=8)
"""The last operations, for failure messages."""


async def one_op(s: kvrt.Session, rng: random.Random, current: list[kvrt.Segment]) -> None:
    """One random operation; the errors it may meet are kvrt's own, for bad targets."""
    kind = rng.choice(["ensure", "ensure", "generate", "evict", "admit", "prefetch"])
    names = [seg.name for seg in current]
    RECENT.append(kind)
    try:
        if kind == "ensure":
            current[:] = random_context(rng)
            await s.ensure_context(current)
        elif kind == "generate":
            async for _ in s.generate(rng.randint(1, 6), stop_at_end=False):
                pass
        elif kind == "prefetch":
            job = s.prefetch(random_context(rng))
            if rng.random() < 0.5:
                job.cancel()
            else:
                await job.wait()
        elif kind == "evict":
            await s.evict(rng.choice(names))
        else:
            await s.admit(rng.choice(names))
    except (kvrt.InvalidRangeError, kvrt.UnknownSegmentError) as exc:
        assert kind in ("evict", "admit"), exc
    except kvrt.HotWindowFullError as exc:
        assert kind == "admit", exc  # a whole segment larger than the unprotected room
    except kvrt.NotInColdStoreError as exc:
        assert kind == "admit" and "no KV bytes left" in str(exc), exc


def canceller(s: kvrt.Session, scope: anyio.CancelScope, at: int) -> Callable[[str], None]:
    """A fault hook that cancels the caller and its call at the ``at``-th await point."""
    seen: list[str] = []

    def hook(label: str) -> None:
        seen.append(label)
        if len(seen) == at + 1:
            scope.cancel()
            if s._actor.current is not None:
                s._actor.current.abandon()

    return hook
