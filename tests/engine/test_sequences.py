"""Windows moved into a context of several KV streams and back.

A window of a context of its own moves into one stream of a context of several and back
whole: the same cells at the same positions, so its next logits are its own context's,
bit for bit. Decoded beside other windows in one step, a window's logits are those of its
own context wherever the kernel probe found the kernels batch-invariant (SmolLM2 on this
kind of machine); bytes of another layout are refused whole.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvrt.adapters.llama import LlamaEngine
from kvrt.adapters.llama._context import LlamaEngineContext
from kvrt.native_bridge import BridgeArgumentError
from kvrt.native_bridge.llama import LlamaModel
from kvrt.native_bridge.llama_batch import LlamaSequences
from kvrt.native_bridge.llama_context import MAIN_SEQ, LlamaContext
from tests.support.models import zoo_path

TEXTS = [
    "The harbour master logs every ship that comes in at dawn. " * 4,
    "Seven lanterns hang over the north gate of the old city. " * 5,
    "A recipe for bread needs flour, water, salt and patience. " * 6,
]


def _own(model: LlamaModel, tokens: list[int], threads: int) -> LlamaContext:
    ctx = LlamaContext(model, n_ctx=512, n_threads=threads)
    for a in range(0, len(tokens), 64):
        ctx.decode(tokens[a : a + 64], a)
    return ctx


def test_a_window_moves_into_a_stream_and_back_whole() -> None:
    model = LlamaModel(zoo_path("llama"))
    tokens = model.tokenize(TEXTS[0], add_special=True, parse_special=False)
    own = _own(model, tokens, threads=1)
    pool = LlamaSequences(model, n_seq=3, cells=512, n_threads=1)
    try:
        pool.load_window(2, own.state_get(MAIN_SEQ))
        assert [pool.next_position(s) for s in range(3)] == [0, 0, len(tokens)]
        with pytest.raises(BridgeArgumentError, match="empty"):
            pool.load_window(2, own.state_get(MAIN_SEQ))  # a stream is loaded into empty
        with pytest.raises(BridgeArgumentError):
            pool.load_window(0, np.frombuffer(b"not a window at all", dtype=np.uint8).copy())
        assert pool.next_position(0) == 0  # refused whole
        back = LlamaContext(model, n_ctx=512, n_threads=1)
        back.state_set(MAIN_SEQ, pool.window(2))
        assert back.pos_max(MAIN_SEQ) == len(tokens) - 1
        step = tokens[-1]
        own.decode([step], len(tokens))
        back.decode([step], len(tokens))
        assert np.array_equal(own.logits(), back.logits())
        back.close()
    finally:
        pool.close()
        own.close()
        model.close()


def test_windows_decoded_together_give_their_own_contexts_logits(engine: LlamaEngine) -> None:
    verdict = engine.facts.kernels
    assert verdict is not None
    threads = verdict.probe.threads if verdict.probe is not None else 2
    model = LlamaModel(engine.facts.path)
    prompts = [model.tokenize(t, add_special=True, parse_special=False) for t in TEXTS]
    owns = [_own(model, p, threads) for p in prompts]
    pool = LlamaSequences(model, n_seq=len(prompts), cells=512, n_threads=threads)
    try:
        for s, own in enumerate(owns):
            pool.load_window(s, own.state_get(MAIN_SEQ))
        alone: list[list[np.ndarray]] = [[] for _ in prompts]
        chosen = [[int(np.argmax(own.logits()))] for own in owns]
        for k in range(4):
            for s, own in enumerate(owns):
                own.decode([chosen[s][-1]], len(prompts[s]) + k)
                alone[s].append(own.logits())
                chosen[s].append(int(np.argmax(alone[s][-1])))
        together: list[list[np.ndarray]] = [[] for _ in prompts]
        for k in range(4):
            rows = pool.decode(
                [chosen[s][k] for s in range(len(prompts))], list(range(len(prompts)))
            )
            for s in range(len(prompts)):
                together[s].append(rows[s])
        same = all(
            np.array_equal(a, b)
            for s in range(len(prompts))
            for a, b in zip(alone[s], together[s], strict=True)
        )
        assert same == verdict.batch_exact  # as the probe measured it here
    finally:
        pool.close()
        for own in owns:
            own.close()
        model.close()


def _logits(got: np.ndarray | Exception) -> np.ndarray:
    assert isinstance(got, np.ndarray), got
    return got


def _prefilled(engine: LlamaEngine, tokens: list[int]) -> LlamaEngineContext:
    ctx = engine.open_context(1024)
    ctx.prefill(tokens)
    return ctx


def test_windows_stepping_together_get_their_logits_alone(engine: LlamaEngine) -> None:
    """Through the engine: windows moved into its streams and stepped together give, bit
    for bit, what the same windows give stepped alone; one comes home for its next
    prefill, one closes away, and each goes on as its reference does."""
    verdict = engine.facts.kernels
    assert verdict is not None
    prompts = [engine.tokenize(t) for t in TEXTS]
    mine = [_prefilled(engine, p) for p in prompts]
    refs = [_prefilled(engine, p) for p in prompts]
    try:
        assert all(engine.joins(c) for c in mine) == verdict.batch_exact
        if not verdict.batch_exact:
            pytest.skip("the kernel probe found sequences decoded together inexact here")
        for _ in range(5):
            tokens = [int(np.argmax(r.logits())) for r in refs]
            got = engine.step_together(list(zip(mine, tokens, strict=True)))
            for r, t, g in zip(refs, tokens, got, strict=True):
                assert isinstance(g, np.ndarray)
                assert np.array_equal(g, r.step(t))
        assert engine.joint_steps >= 5 and all(c.away for c in mine)
        assert engine.stream_bytes > 0
        # a lone step of a window away runs in its stream
        t = int(np.argmax(refs[1].logits()))
        (alone,) = engine.step_together([(mine[1], t)])
        assert mine[1].away and np.array_equal(_logits(alone), refs[1].step(t))
        # a refused step leaves the window as it was; the others step
        t = int(np.argmax(refs[1].logits()))
        bad = engine.step_together([(mine[0], -1), (mine[1], t)])
        assert isinstance(bad[0], Exception)
        assert np.array_equal(_logits(bad[1]), refs[1].step(t))
        assert mine[0].tokens == refs[0].tokens
        # a prefill brings the window home first
        more = engine.tokenize(" And then the tide turned.", add_special=False)
        assert np.array_equal(mine[0].prefill(more), refs[0].prefill(more))
        assert not mine[0].away and mine[0].tokens == refs[0].tokens
        assert np.array_equal(mine[1].prefill(more), refs[1].prefill(more))
        mine[2].close()  # its stream is freed unread
        again = _prefilled(engine, prompts[2])
        ref = engine.open_context(1024)
        ref.prefill(prompts[2])
        steps = engine.step_together([(mine[0], 7), (again, 7)])
        assert np.array_equal(_logits(steps[0]), refs[0].step(7))
        assert np.array_equal(_logits(steps[1]), ref.step(7))
        again.close()
        ref.close()
    finally:
        for c in mine + refs:
            c.close()
