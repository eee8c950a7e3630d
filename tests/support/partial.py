"""Contexts and checks for KV computed under a partial window."""

from __future__ import annotations

import itertools
import random
from typing import Any, cast

import numpy as np

import kvrt
from kvrt import Segment
from kvrt._paging.tokens import context_tokens
from tests.support.models import next_logits

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "seven",
    "orange",
    "quiet",
    "tiger",
    "lamp",
    "window",
    "forest",
    "silver",
    "honey",
    "brick",
    "yellow",
    "candle",
    "harbor",
    "mirror",
    "pencil",
    "garden",
]


SYSTEM = "You are a helpful assistant who answers about the files below."


QUESTION = "\nQuestion: which word appears most often in the files? Answer:"


def files_context(seed: int = 7, n_files: int = 3, words: int = 260) -> list[Segment]:
    """A system prompt, files of random words and a question: about 800 tokens."""
    rng = random.Random(seed)
    files = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n_files)]
    return [
        Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
        *(Segment(f"file{i}", text) for i, text in enumerate(files)),
        Segment("user", QUESTION),
    ]


def in_pieces(
    engine: kvrt.backend.Engine, segments: list[Segment], cuts: list[int], n: int = 8
) -> tuple[np.ndarray, list[int]]:
    """The context computed in a fresh engine context that never evicts, one prefill per
    piece between ``cuts``: its next-token logits and greedy continuation."""
    tokens = context_tokens(engine, segments)
    ctx = engine.open_context(len(tokens) + n + 16)
    try:
        for start, end in itertools.pairwise([0, *cuts, len(tokens)]):
            logits = ctx.prefill(tokens[start:end])
        return logits, cast(Any, ctx).generate(n, stop_at_end=False)  # the adapters' own loop
    finally:
        ctx.close()


async def check_exact(s: kvrt.Session, want: tuple[np.ndarray, list[int]]) -> None:
    logits = await next_logits(s)
    assert np.array_equal(logits, want[0]), f"max |Δlogit| {np.abs(logits - want[0]).max()}"
    assert list((await s.generate(len(want[1]), stop_at_end=False)).tokens) == want[1]


def partial_blocks(report: kvrt.SessionReport) -> list[kvrt.BlockReport]:
    return [b for b in report.blocks if b.partial_window]
