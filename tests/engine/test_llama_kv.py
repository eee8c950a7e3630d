"""Evict, export and admit on real llama.cpp with the embedded model: exact where promised."""

from __future__ import annotations

import numpy as np
import pytest

from kvrt import AdmitMode, EngineError, EvictMode
from kvrt.adapters.llama import LlamaEngine
from tests.support.text import STORY, slide_then_tail_admit, words

pytestmark = pytest.mark.model


def _prompt(engine: LlamaEngine) -> list[int]:
    return engine.tokenize(STORY * 2)


@pytest.mark.parametrize("engine_name", ["engine", "engine_q8", "engine_q4"])
def test_gap_evict_then_in_place_admit_is_bit_exact(
    engine_name: str, request: pytest.FixtureRequest
) -> None:
    engine: LlamaEngine = request.getfixturevalue(engine_name)
    tokens = _prompt(engine)
    probe = words(engine, " She")
    n = len(tokens)
    a, b = 30, 70

    ref = engine.open_context(512)
    ref.prefill(tokens)
    expected = ref.prefill(probe)
    ref.close()

    ctx = engine.open_context(512)
    ctx.prefill(tokens)
    block = ctx.export(a, b)
    assert block.meta.tokens == tuple(tokens[a:b]) and block.meta.start == a
    assert ctx.evict(a, b, EvictMode.GAP) == b - a
    assert list(ctx.positions) == [*range(a), *range(b, n)]

    while_evicted = ctx.prefill(probe)
    ctx.evict(n, n + 1)  # take the probe back out
    assert ctx.admit(block, AdmitMode.IN_PLACE) == a
    assert list(ctx.positions) == list(range(n)) and list(ctx.tokens) == tokens
    restored = ctx.prefill(probe)
    ctx.close()

    assert not np.array_equal(while_evicted, expected), "evicting must change the logits"
    assert np.array_equal(restored, expected), f"max |Δ| {np.abs(restored - expected).max()}"


def test_tail_evict_then_admit_keeps_greedy_continuation(engine: LlamaEngine) -> None:
    """A tail evicted and admitted back holds the same KV, so computing its last token again
    gives the logits, and the continuation, of a context that never evicted and computed
    that token the same way: alone, after the rest. (Against one prefill of all the
    tokens it is not bit-identical on every CPU: without AVX-512, llama.cpp runs one-token
    batches through other kernels than longer ones. Sessions therefore keep the logits
    with the block, or compute such a token with the one before it.)"""
    tokens = _prompt(engine)
    n = len(tokens)
    ref = engine.open_context(512)
    ref.prefill(tokens[:-1])
    expected_logits = ref.prefill(tokens[-1:])
    expected = ref.generate(24, stop_at_end=False)
    ref.close()

    ctx = engine.open_context(512)
    ctx.prefill(tokens)
    block = ctx.export(n - 40, n)
    ctx.evict(n - 40, n)
    assert ctx.next_position == n - 40
    ctx.admit(block, AdmitMode.IN_PLACE)
    # Restoring computes nothing, so no logits follow the restored last token: compute that
    # one token again, as the reference did.
    ctx.evict(n - 1, n)
    logits = ctx.prefill(tokens[-1:])
    assert np.array_equal(logits, expected_logits)
    assert ctx.generate(24, stop_at_end=False) == expected
    # Two tokens or more at once agree with one prefill of everything, on every CPU.
    ctx.evict(n - 2, ctx.next_position)
    assert np.array_equal(ctx.prefill(tokens[-2:]), ref_logits(engine, tokens))
    ctx.close()


def ref_logits(engine: LlamaEngine, tokens: list[int]) -> np.ndarray:
    ctx = engine.open_context(512)
    try:
        return ctx.prefill(tokens)
    finally:
        ctx.close()


def test_slide_evict_then_tail_admit_matches_fresh_prefill_argmax(engine: LlamaEngine) -> None:
    got, fresh = slide_then_tail_admit(engine, _prompt(engine), " The", 512)
    delta = float(np.abs(got - fresh).max())
    print(f"\nslide evict + tail admit vs fresh prefill: max |Δlogit| = {delta:.4f}")
    assert int(got.argmax()) == int(fresh.argmax())
    ctx = engine.open_context(64)
    assert ctx.capabilities.exact_tail is False  # reported honestly: not bit-exact
    ctx.close()


@pytest.mark.parametrize("engine_name", ["engine", "engine_q8", "engine_q4"])
def test_export_leaves_window_unchanged_and_counts(
    engine_name: str, request: pytest.FixtureRequest
) -> None:
    """Cold bytes are the cache's own rows (quantized ones stay quantized): about the
    model's KV bytes per token at the cache's type, which the planner counts."""
    engine: LlamaEngine = request.getfixturevalue(engine_name)
    assert (
        engine.facts.kv_bytes_per_token
        == {"f16": 23040, "q8_0": 12240, "q4_0": 6480}[engine.facts.kv_type]
    )
    tokens = _prompt(engine)
    ctx = engine.open_context(512)
    before = ctx.prefill(tokens)
    block = ctx.export(10, 50)
    assert list(ctx.positions) == list(range(len(tokens)))
    assert np.array_equal(ctx.logits(), before)
    assert not block.data.flags.writeable
    assert block.meta.n_bytes == block.data.size
    # One KV row per token per layer plus a small header: close to the model's figure.
    per_token = block.meta.n_bytes / 40
    assert engine.facts.kv_bytes_per_token <= per_token < engine.facts.kv_bytes_per_token * 1.05
    c = ctx.counters
    assert (c.prefill_tokens, c.exported_tokens, c.exported_bytes) == (
        len(tokens),
        40,
        block.meta.n_bytes,
    )
    ctx.evict(10, 50)
    ctx.admit(block)
    assert (ctx.counters.evicted_tokens, ctx.counters.admitted_tokens) == (40, 40)
    assert ctx.counters.prefill_tokens == len(tokens)  # restoring computed nothing
    ctx.close()


def test_block_serves_another_context_on_the_same_model(engine: LlamaEngine) -> None:
    tokens = _prompt(engine)
    probe = words(engine, " She")
    one = engine.open_context(512)
    one.prefill(tokens)
    block = one.export(0, len(tokens))
    expected = one.prefill(probe)
    one.close()

    two = engine.open_context(512)
    two.admit(block, AdmitMode.IN_PLACE)
    assert np.array_equal(two.prefill(probe), expected)
    assert two.counters.prefill_tokens == len(probe)
    two.close()


def test_capabilities(engine: LlamaEngine) -> None:
    ctx = engine.open_context(64)
    caps = ctx.capabilities
    ctx.close()
    assert caps.remove_middle and caps.position_shift and caps.exact_in_place
    assert caps.kv_type == "f16" and caps.sliding_window is None


def test_a_context_that_grows_computes_what_a_full_size_one_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 4,096-token window starts in a 1,024-cell context and grows as it fills (its
    cells laid out again in position order): every logit computed on a context laid out
    as a fresh one equals a full-size context's doing the same, bit for bit, a gap
    restored in between included, and the last logits survive a growth that no compute
    follows. (With a gap, neither layout is a fresh context's: kvrt lays the window out
    again before computing on it whole.)"""
    from kvrt.adapters.llama import _sizing
    from tests.support.models import tiny

    engine = tiny()
    assert isinstance(engine, LlamaEngine)
    tokens = engine.tokenize(STORY * 50)[:2600]
    assert len(tokens) == 2600
    probe = words(engine, " She")

    def run() -> tuple[list[np.ndarray], list[int]]:
        ctx = engine.open_context(4096)
        sizes = [ctx._ctx.n_ctx]
        out = [ctx.prefill(tokens[:900]), ctx.prefill(tokens[900:1200])]  # grows, in order
        sizes.append(ctx._ctx.n_ctx)
        block = ctx.export(100, 300)
        ctx.evict(100, 300, EvictMode.GAP)
        last = ctx.prefill(tokens[1200:])  # grows with a gap: [0, 100) + [300, 2600)
        ctx.admit(block, AdmitMode.IN_PLACE)  # grows again
        sizes.append(ctx._ctx.n_ctx)
        out.append(ctx.logits())  # carried over the growth
        assert np.array_equal(out[-1], last)
        out.append(ctx.prefill(probe))  # lays the whole context out first
        assert list(ctx.positions) == list(range(len(tokens) + len(probe)))
        ctx.close()
        return out, sizes

    grown, sizes = run()
    monkeypatch.setattr(_sizing, "FIRST_CELLS", 1 << 20)  # every context full size
    full, full_sizes = run()
    assert sizes[0] == 1024 and sizes[0] < sizes[1] < sizes[2] and full_sizes == [4096] * 3
    for i, (a, b) in enumerate(zip(grown, full, strict=True)):
        if i != 2:  # the logits after the prefill with a gap (each context's own layout)
            assert np.array_equal(a, b), f"step {i}: max |Δ| {np.abs(a - b).max()}"


def test_a_context_filled_to_its_last_cell_by_a_turned_block_still_grows(
    engine: LlamaEngine,
) -> None:
    """A block brought to the tail with its keys turned leaves a shift for llama.cpp to
    apply, which costs a free cell; the context grows before the block would take its
    last one, so the next compute (which grows it) can still read the window's bytes."""
    tokens = engine.tokenize(STORY * 50)[:1100]
    ctx = engine.open_context(4096)
    cells = ctx._ctx.n_ctx
    assert cells < 4096
    ctx.prefill(tokens[: cells - 200])
    block = ctx.export(0, 200)
    ctx.admit(block, AdmitMode.TAIL)  # [0, 200) again at the tail: cells - 200 onwards
    assert ctx.next_position == cells
    ctx.prefill(tokens[cells - 200 : cells - 190])
    assert ctx._ctx.n_ctx > cells
    assert list(ctx.positions) == list(range(cells + 10))
    ctx.close()


def test_a_window_starts_in_the_last_closed_window_s_context_wiped_and_exact(
    engine: LlamaEngine,
) -> None:
    """A closed window's context waits, as one spare, for the next window: it comes back
    empty with its bytes zeroed, unreachable from the window that closed it, and computes
    what a new context does, bit for bit."""
    tokens = _prompt(engine)
    probe = words(engine, " She")

    other = engine.open_context(2048)
    other.prefill(list(reversed(tokens)))  # another conversation's KV in the buffer
    native = other._ctx._ptr
    other.close()
    assert other.closed
    with pytest.raises(EngineError, match="closed"):
        other.prefill(probe)  # the closed window can no longer reach what it held

    reused = engine.open_context(2048)
    assert reused._ctx._ptr == native and not list(reused.positions)
    reused.prefill(tokens)
    got = reused.prefill(probe)
    fresh = engine.open_context(2048)  # no spare now: a context of its own
    assert fresh._ctx._ptr != native
    fresh.prefill(tokens)
    expected = fresh.prefill(probe)
    fresh.close()
    reused.close()
    assert np.array_equal(got, expected), f"max |Δ| {np.abs(got - expected).max()}"

    small = engine.open_context(256)  # a spare of another size is freed, not used
    assert small._ctx.n_ctx == 256 and not engine.holds_spare
    small.close()
