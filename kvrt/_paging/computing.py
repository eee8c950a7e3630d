"""Computing blocks at the window's tail: each token the way its block says it was
computed — the tokens of a reply the runtime generated one at a time, as they were
generated, the rest in batches — so the KV, and everything computed after it, has the
bits the key promises (see :mod:`.provenance`).
"""

from __future__ import annotations

import time
from collections.abc import Container, Mapping, Sequence

import anyio

from .gate import EngineGate, Tally, Written
from .moves import PARTIAL_KV, Paging
from .provenance import APPROXIMATE, is_approximate
from .window import Block

__all__ = ["Computing", "lineage_runs"]


def lineage_runs(start: int, end: int, lone: Container[int]) -> list[tuple[int, int, bool]]:
    """``[start, end)`` cut into runs of positions computed alone (``lone``) or in a batch:
    ``(start, end, alone)`` each.

    >>> lineage_runs(0, 6, {2, 3})
    [(0, 2, False), (2, 4, True), (4, 6, False)]
    """
    runs: list[tuple[int, int, bool]] = []
    for p in range(start, end):
        alone = p in lone
        if runs and runs[-1][2] == alone:
            runs[-1] = (runs[-1][0], p + 1, alone)
        else:
            runs.append((p, p + 1, alone))
    return runs


class Computing:
    """Computes blocks and tokens at the window's tail, through the session's engine
    gate, making room with :class:`.Paging`."""

    def __init__(self, gate: EngineGate, paging: Paging) -> None:
        self.gate, self.paging = gate, paging
        self.ctx, self.window, self.cold = gate.ctx, gate.window, gate.cold
        self.policies = gate.policies

    async def prefill(
        self,
        blocks: list[Block],
        keep: set[int],
        earlier: Mapping[int, str],
        why: Mapping[int, str] | None = None,
    ) -> Tally:
        """Compute adjacent blocks in one engine call (batched: many small segments cost
        one call, not one each). ``earlier``: where the command computing them got the KV
        of the positions it wrote before (:attr:`.Tally.sources`), to tell leading tokens
        it restored from ones it reused; ``why``: block id -> why a block with a cold copy
        is computed again, for ``explain()``.

        Blocks the write-through policy picks (by default the stable classes,
        ``task_pinned`` and ``repo_map``) are written through to the cold store as soon as
        they are computed, so a session sending the same prefix restores them; while they
        are being computed, such a session waits for them.
        """
        ids = {b.id for b in blocks}
        through = self.policies.write_through
        stable = [b for b in blocks if through.write_through(self.window.view(b))]
        fingerprint = self.window.fingerprint
        # Announced before the first await: a session checking for these blocks now waits.
        release = self.cold.claim(b.key(fingerprint) for b in stable)
        try:
            # The first block may already hold its leading tokens at the window's tail (a
            # block that grew): computing resumes after them.
            first = blocks[0]
            done = self.window.resident_prefix(first, self.gate.resident())
            if first.start + done != self.ctx.next_position:
                done = 0
            tokens, at = [t for b in blocks for t in b.tokens][done:], first.start + done
            states = self.policies.checkpointed(blocks, self.ctx.facts)
            label, missing, moved = await self.compute(tokens, at, keep | ids, states=states)
            if stable:
                await self.paging.write_back(stable, spare=True)
        finally:
            release()
        # Leading tokens already resident were reused, or restored from a block that
        # diverges from this one later on (counted as restored when they came back).
        leading = sum(earlier.get(p) == "restored" for p in range(first.start, first.start + done))
        moved.reused += done - leading
        moved.prefilled += sum(b.n_tokens for b in blocks) - done
        why = why or {}
        for block in blocks:
            if block.id in why:
                choice = why[block.id]
            elif block is first and leading:
                choice = (
                    f"{leading} leading tokens restored from a cold block that diverges after "
                    "them, the rest prefilled"
                )
            else:
                choice = "prefilled"
            if label == APPROXIMATE:
                choice += " (after approximate KV: not exact)"
            elif label is not None:
                choice += (
                    f" under a partial window ({missing} earlier tokens not hot): {PARTIAL_KV}"
                )
            self.gate.choices[block.id] = choice
        return moved

    async def compute(
        self, tokens: list[int], at: int, keep: set[int], *, states: Sequence[int] = ()
    ) -> tuple[str | None, int, Tally]:
        """Compute ``tokens`` from position ``at``, the window's tail, within the budget
        (never evicting ``keep``); the provenance label the KV got, how many earlier
        context tokens were not hot (see :meth:`.EngineGate.label_at`) and what it did
        besides computing ``tokens`` (room made; a token before them computed again).

        Each token is computed the way its block says (:attr:`.Block.lone`): the tokens
        of a reply the runtime generated one at a time, as they were generated, so their
        KV, and everything computed after it, has the bits the generating session's had;
        the rest in batches (all in one after approximate KV in a long context's window:
        no bits to keep there). Never as a one-token batch when it can be helped: such a
        token is computed together with the resident token before it (llama.cpp runs
        one-token batches through other kernels than longer ones, and their logits differ
        from what computing the context in any other cut gives; batches of two tokens or
        more agree with each other bit for bit). One that cannot be helped (between
        tokens computed alone) is marked inexact.
        """
        resident = self.gate.resident()
        moved = Tally()
        alone = self.window.lone_positions(at - 1, at + len(tokens))
        if (
            len(tokens) == 1
            and at > 0
            and not alone
            and self.ctx.next_position == at
            and (before := self.window.token_at(at - 1)) is not None
            and resident.get(at - 1) == before
            and self.paging.drops_alone(at - 1)
        ):
            holder = next(b for b in self.window.blocks if b.start <= at - 1 < b.end)
            keep = keep | {holder.id}
            moved += await self.gate.drop(at - 1, at)
            tokens, at = [before, *tokens], at - 1
            moved.prefilled += 1
        moved += await self.paging.make_room(len(tokens), keep)
        label, missing = self.gate.label_at(at)
        runs = lineage_runs(at, at + len(tokens), alone)
        if self.window.virtual and label is not None and is_approximate(label):
            # After approximate KV in a long context's window there are no bits to keep:
            # one batch, its replies' tokens still marked as theirs so their blocks match
            # (the mark is approximate: no exact claim rides on it).
            runs, batched = [(at, at + len(tokens), False)], frozenset(alone)
        else:
            batched = frozenset()
        for a, b, lone in runs:
            piece = tokens[a - at : b - at]
            if lone:
                for p, token in zip(range(a, b), piece, strict=True):
                    marks = [Written(p, p + 1, label, "prefilled", lone=frozenset({p}))]
                    await self.gate.call("replay", self.ctx.step, token, writes=marks)
                    moved.wrote(marks)
                continue
            mark = label
            if b - a == 1 and alone and mark is None:
                mark = self.gate.provenance.new_label()  # a one-token batch after lone ones
            began = time.perf_counter()
            marks = [Written(a, b, mark, "prefilled", lone=batched)]
            await self.gate.call(
                "prefill",
                self.ctx.prefill,
                piece,
                start=a,
                checkpoint=anyio.from_thread.check_cancelled,
                keep_state_at=[q for q in states if a < q <= b],
                writes=marks,
            )
            self.gate.observed_prefill(began, a, b - a)
            moved.wrote(marks)
        return label, missing, moved
