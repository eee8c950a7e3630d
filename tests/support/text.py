"""Text and token helpers for the engine tests."""

from __future__ import annotations

import numpy as np
import pytest

import kvrt
from kvrt import AdmitMode, EvictMode
from kvrt.adapters.llama import LlamaEngine

STORY = (
    "The lighthouse keeper of Arden Point kept a logbook. Every evening she wrote down the "
    "colour of the sky, the height of the waves and the names of the ships that passed. "
    "In the winter of the great storm, the lamp failed twice, and twice she climbed the "
    "tower with a lantern in her hand. "
)


def words(engine: LlamaEngine, text: str) -> list[int]:
    """Tokens of ``text`` without BOS, for splicing into a longer sequence."""
    return engine.tokenize(text, add_special=False)


MIDDLE = " The keeper's daughter painted the door of the tower bright red that spring."


TAIL = " Ships from the north saw the red door before they saw the lamp."


def slide_then_tail_admit(
    engine: LlamaEngine, head: list[int], probe: str, n_ctx: int
) -> tuple[np.ndarray, np.ndarray]:
    """Prefill ``head`` + a middle sentence + a tail sentence, slide-evict the middle, admit it
    at the tail (keys re-rotated) and return the probe's logits next to those of computing
    ``head + tail + middle`` afresh."""
    middle, tail, probe_tokens = words(engine, MIDDLE), words(engine, TAIL), words(engine, probe)
    ctx = engine.open_context(n_ctx)
    ctx.prefill(head + middle + tail)
    a, b = len(head), len(head) + len(middle)
    block = ctx.export(a, b)
    ctx.evict(a, b, EvictMode.SLIDE)
    assert list(ctx.positions) == list(range(len(head) + len(tail)))
    assert ctx.admit(block, AdmitMode.TAIL) == len(head) + len(tail)
    assert list(ctx.tokens) == head + tail + middle
    got = ctx.prefill(probe_tokens)
    ctx.close()
    fresh_ctx = engine.open_context(n_ctx)
    fresh = fresh_ctx.prefill(head + tail + middle + probe_tokens)
    fresh_ctx.close()
    return got, fresh


def record_tokenized(monkeypatch: pytest.MonkeyPatch, engine: kvrt.backend.Engine) -> list[str]:
    """The texts ``engine`` tokenizes from now on (the real tokenizer still runs), in order."""
    texts: list[str] = []
    tokenize = engine.tokenize

    def recording(text: str, **kwargs: bool) -> list[int]:
        texts.append(text)
        return tokenize(text, **kwargs)

    monkeypatch.setattr(engine, "tokenize", recording)
    return texts
