"""How each token's KV was computed is part of what follows it.

A generated token is computed alone; the same text received as an assistant message and
prefilled is computed in a batch, with other bits (on this engine, with the embedded
model, from the first tokens on). A reply the runtime generated, sent back, is placed as
it was generated — restored from the cold copy of the session that generated it, or
computed again token by token — so every session answers as the generating session
would, to the bit; a context whose reply is not known as generated is computed in
batches, and never restores a block computed after the generated one (and the reverse).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvrt
from kvrt.adapters.llama import LlamaEngine

pytestmark = pytest.mark.anyio

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one sentence."}
FIRST = {"role": "user", "content": "Name a river in France and say where it rises."}
SECOND = {"role": "user", "content": "And which sea does it reach?"}


def config(**flags: Any) -> kvrt.Config:
    return kvrt.load_config(flags={"disk.budget": "0", **flags})


def logprobs(done: kvrt.Completion) -> list[tuple[int, float, tuple[float, ...]]]:
    """Each generated token with its log-probability and its alternatives': compared as
    floats, bit for bit."""
    assert done.logprobs is not None
    return [(lp.token, lp.logprob, tuple(t.logprob for t in lp.top)) for lp in done.logprobs]


async def second_turn(session: kvrt.Session, reply: str) -> kvrt.Completion:
    messages = [SYSTEM, FIRST, {"role": "assistant", "content": reply}, SECOND]
    return await session.chat(messages, max_tokens=6, logprobs=3)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_generated_reply_sent_back_answers_as_the_session_that_generated_it(
    engine: LlamaEngine, anyio_backend: str
) -> None:
    async with kvrt.open_runtime(engine=engine, config=config()) as rt:
        async with rt.open_session(hot_tokens=1024) as first:
            reply = await first.chat([SYSTEM, FIRST], max_tokens=24)
            assert reply.tokens and reply.text
            want = await second_turn(first, reply.text)  # its generated KV, resident
            assert want.context.exact
            # Another session while the first holds every block hot (no cold copy of the
            # reply): it computes the reply again token by token, as it was generated.
            async with rt.open_session(hot_tokens=1024) as other:
                got = await second_turn(other, reply.text)
            assert got.usage.prefilled_tokens > len(reply.tokens) and got.context.exact
            assert logprobs(got) == logprobs(want) and got.text == want.text
            # Pushed out to the cold store, the first session's blocks serve another: the
            # reply's blocks (computed alone) come back, nothing after them is mistaken.
            await first.ensure_context([kvrt.Segment("other", "Something else. " * 40)])
        async with rt.open_session(hot_tokens=1024) as later:
            got = await second_turn(later, reply.text)
        assert got.usage.restored_tokens >= len(reply.tokens) and got.context.exact
        assert logprobs(got) == logprobs(want)

    # A runtime that never generated the reply (its text alone) prefills it: other bits.
    async with (
        kvrt.open_runtime(engine=engine, config=config()) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        prefilled = await second_turn(s, reply.text)
    assert logprobs(prefilled) != logprobs(want)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_block_after_a_prefilled_reply_is_never_an_exact_hit_for_a_generated_one(
    engine: LlamaEngine, tmp_path: Any, anyio_backend: str
) -> None:
    """Two runtimes on one disk tier: the first generated the reply and its blocks went to
    disk; the second, which never generated it, prefills it and restores nothing from
    the reply on: what it answers equals a fresh computation of the prefilled context."""
    shared = config(**{"disk.budget": "1GiB", "disk.path": str(tmp_path / "blocks")})
    async with (
        kvrt.open_runtime(engine=engine, config=shared) as rt,
        rt.open_session(hot_tokens=1024) as first,
    ):
        reply = await first.chat([SYSTEM, FIRST], max_tokens=24)
        want = await second_turn(first, reply.text)
        await first.ensure_context([kvrt.Segment("other", "Something else. " * 40)])
    async with kvrt.open_runtime(engine=engine, config=shared) as rt:
        async with rt.open_session(hot_tokens=1024) as s:
            got = await second_turn(s, reply.text)
        # The system prompt and the question come back from disk; the reply and what
        # follows it are computed (in batches), not taken from the generated lineage.
        assert 0 < got.usage.restored_tokens < reply.context.logical_tokens
        assert got.context.exact and logprobs(got) != logprobs(want)
    async with (
        kvrt.open_runtime(engine=engine, config=config()) as rt,
        rt.open_session(hot_tokens=1024) as s,
    ):
        fresh = await second_turn(s, reply.text)
    assert logprobs(got) == logprobs(fresh)


def test_the_engine_tells_a_token_computed_alone_from_one_in_a_batch(
    engine: LlamaEngine,
) -> None:
    """The premise, measured: the same tokens after a reply decoded one at a time and
    after the reply prefilled give other logits (so a test comparing them can fail)."""
    prompt = engine.tokenize("The river Loire rises in the Massif Central and flows west.")
    reply = engine.tokenize(" It reaches the Atlantic at Saint-Nazaire.", add_special=False)
    after = engine.tokenize(" Which sea?", add_special=False)
    alone, batch = engine.open_context(256), engine.open_context(256)
    try:
        alone.prefill(prompt)
        for t in reply:
            alone.step(t)
        batch.prefill(prompt + reply)
        assert not np.array_equal(alone.prefill(after), batch.prefill(after))
    finally:
        alone.close()
        batch.close()
