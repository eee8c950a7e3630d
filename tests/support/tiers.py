"""What the tier tests share: documents, a first process, references, settling a store."""

from __future__ import annotations

import anyio
import numpy as np

import kvrt
from kvrt import Segment
from kvrt._cold import ColdStore
from kvrt.adapters.llama import LlamaEngine
from tests.support.models import next_logits


async def settled(store: ColdStore) -> None:
    """Wait until the disk writers have nothing queued or in flight."""
    with anyio.fail_after(20):
        while store.pending:
            await anyio.sleep(0.01)


DOC = (
    "The lighthouse keeper of Arden Point kept a logbook. Every evening she wrote down the "
    "colour of the sky, the height of the waves and the names of the ships that passed. "
) * 5


OTHER = (
    "A baker in the valley rose at four each morning to light the ovens, and by six the "
    "whole street smelled of rye, caraway and the sweet buns the children liked best. "
) * 5


FIRST_PROCESS = """
import anyio, kvrt
from kvrt import Segment

async def main():
    async with kvrt.open_runtime() as rt, rt.open_session(hot_tokens=512) as s:
        await s.ensure_context([Segment("doc", {doc!r}), Segment("q", "Who kept the logbook?")])
        # Another context pushes the first one out of the hot window, into the cold store.
        await s.ensure_context([Segment("other", {other!r}), Segment("q", "Who baked?")])
        print(rt.cold_stats().pending_writes, flush=True)

anyio.run(main)
"""


async def references(
    engine: LlamaEngine, context: list[Segment]
) -> tuple[tuple[int, ...], np.ndarray]:
    """With no tier below RAM: the greedy continuation of a session that never evicted,
    and the logits of one that restored the whole context from RAM (its last token then
    computed again, as after any restore that brings back the context's end without the
    logits kept with it: the first session's reply followed that block)."""
    off = kvrt.Config(disk=kvrt.DiskConfig(budget=0))
    async with kvrt.open_runtime(engine=engine, config=off) as rt:
        async with rt.open_session(hot_tokens=512) as ref:
            await ref.ensure_context(context)
            want = (await ref.generate(max_tokens=16)).tokens
        async with rt.open_session(hot_tokens=512) as ref:
            status = await ref.ensure_context(context)
            assert status.restored_tokens > 0
            logits = await next_logits(ref)
    return want, logits
