"""Hybrid and recurrent models (attention and recurrent layers; recurrent layers alone)
at the bridge: what llama.cpp allows, measured on the tiny random-weight fixtures the
suite writes (granitehybrid, lfm2, mamba2). The facts kvrt's paging of such models
builds on:

- a range in the middle can be dropped (the attention layers' cells go; the recurrent
  state, which is not kept by position, stays), the tail cannot: the recurrent state has
  integrated it;
- a checkpoint (the recurrent state alone, ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) put back
  lets the tail go, and computing it again gives the logits bit for bit;
- a block restores in another context exactly only with the checkpoint taken after its
  last token: a range exported later carries the recurrent state as it is then.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvrt.native_bridge import BridgeArgumentError, BridgeCallError
from kvrt.native_bridge.llama import LlamaModel
from kvrt.native_bridge.llama_context import LlamaContext
from tests.support.models import tiny, zoo_path

HYBRIDS = ["granitehybrid", "lfm2", "mamba2"]


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 200, n)]


@pytest.fixture(scope="module", params=HYBRIDS)
def model(request: pytest.FixtureRequest) -> LlamaModel:
    loaded = LlamaModel(zoo_path(request.param))
    assert loaded.is_recurrent or loaded.is_hybrid
    return loaded


def context(model: LlamaModel) -> LlamaContext:
    return LlamaContext(model, n_ctx=256, n_batch=64, n_threads=2)


def test_a_checkpoint_rewinds_the_recurrent_state_exactly(model: LlamaModel) -> None:
    ids = tokens(64, seed=1)
    reference = context(model)
    reference.decode(ids[:32], 0)
    reference.decode(ids[32:], 32)
    expected = reference.logits()

    ctx = context(model)
    ctx.decode(ids[:32], 0)
    checkpoint = ctx.checkpoint_get(0)
    ctx.decode(tokens(16, seed=2), 32)  # another continuation, to be taken back
    with pytest.raises(BridgeCallError, match="could not remove"):
        ctx.seq_rm(0, 32, 1 << 30)  # the recurrent state has seen it: no tail removal
    ctx.checkpoint_set(0, checkpoint)
    ctx.seq_rm(0, 32, 1 << 30)
    assert ctx.pos_max(0) == 31
    ctx.decode(ids[32:], 32)
    assert np.array_equal(ctx.logits(), expected)  # bit for bit
    for c in (reference, ctx):
        c.close()


def test_a_range_in_the_middle_can_go_and_the_checkpoint_is_the_recurrent_state(
    model: LlamaModel,
) -> None:
    ctx = context(model)
    ctx.decode(tokens(64, seed=3), 0)
    whole = ctx.state_get(0)
    checkpoint = ctx.checkpoint_get(0)
    assert 0 < checkpoint.size <= whole.size
    if model.is_recurrent:
        assert checkpoint.size == whole.size  # no attention KV at all
    else:
        assert checkpoint.size < whole.size
    ctx.seq_rm(0, 16, 32)  # attention cells go; the recurrent state is not kept by position
    assert ctx.pos_max(0) == 63
    after = ctx.state_get(0).size
    assert after == whole.size if model.is_recurrent else after < whole.size
    ctx.close()


def test_an_attention_model_has_no_checkpoint() -> None:
    plain = LlamaModel(zoo_path("llama"))
    ctx = context(plain)
    ctx.decode(tokens(8, seed=4), 0)
    with pytest.raises(BridgeArgumentError, match="no recurrent layers"):
        ctx.checkpoint_get(0)
    ctx.close()
    plain.close()


@pytest.mark.parametrize("name", ["granitehybrid", "lfm2"])
def test_a_block_with_its_checkpoint_restores_in_another_context(name: str) -> None:
    """A hybrid's block as a cold entry would carry it: its attention cells and the
    recurrent state after its last token (not the state when it is exported, which has
    seen later tokens). Loaded into a new context, the continuation is bit-exact against
    computing it there."""
    model = LlamaModel(zoo_path(name))
    ids = tokens(64, seed=5)
    ctx = context(model)
    ctx.decode(ids[:32], 0)
    checkpoint = ctx.checkpoint_get(0)
    ctx.decode(ids[32:], 32)  # the context goes on: its recurrent state moves on
    block = ctx.range_with_checkpoint(0, 32, checkpoint)
    as_exported = ctx.range_with_checkpoint(0, 32, ctx.checkpoint_get(0))
    reference = context(model)
    reference.decode(ids[:32], 0)
    reference.decode(ids[32:40], 32)
    expected = reference.logits()
    for data, exact in ((block, True), (as_exported, False)):
        other = context(model)
        other.state_set(1, data)
        other.seq_cp(1, 0, 0, 32)
        other.seq_clear(1)
        other.decode(ids[32:40], 32)
        assert np.array_equal(other.logits(), expected) is exact
        other.close()
    with pytest.raises(BridgeArgumentError, match="bytes"):
        ctx.range_with_checkpoint(0, 32, checkpoint[:-1])
    for c in (ctx, reference):
        c.close()
    model.close()


@pytest.mark.parametrize("name", ["granitehybrid", "falcon-h1"])
def test_the_tail_after_a_gap_behind_the_checkpoint_goes_too(name: str) -> None:
    """The window's only checkpoint sits right before a gap (a block evicted after it): a
    tail removed further on cannot be computed again from it (the recurrent state would
    skip the gap's tokens), so everything from the gap on goes, the state is the
    checkpoint's, and the context computed on from there equals a fresh one."""
    engine = tiny(name)
    ids = tokens(300, seed=4)
    ctx = engine.open_context(512)
    try:
        ctx.prefill(ids[:250], keep_state_at=[128])
        ctx.evict(128, 192)  # a gap right after the checkpoint
        redo = ctx.recomputed_by_evict(200, 250)
        assert redo is not None and redo.removed_from == 192 and redo.first == redo.end
        assert ctx.evict(200, 250) == 58  # [192, 250): 8 more than asked
        assert list(ctx.positions) == list(range(128))
        got = ctx.prefill(ids[128:300])
        fresh = engine.open_context(512)
        try:
            assert np.array_equal(got, fresh.prefill(ids[:300]))
        finally:
            fresh.close()
    finally:
        ctx.close()
