"""Random churn of a llama.cpp window against never-evicting and fresh contexts."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from kvrt import AdmitMode, EvictMode
from kvrt.backend import ColdBlock, Engine

BLOCK = 64


ROOM = 1800


TEXT = "".join(
    f"Log {i}: at {6 + i % 12}:{i * 7 % 60:02d} the keeper saw the {('north', 'east', 'south', 'west')[i % 4]} "
    f"light flash {i % 5 + 2} times; ship {i * 37 % 101} answered with {i % 3 + 1} horns.\n"
    for i in range(200)
)
"""A long text of varied tokens (its own, so edits elsewhere never change these sequences)."""


class Contexts:
    """A churned context, its never-evicting mirror and a fresh one, opened once per
    engine; every sequence starts from one prompt computed once (its KV loaded into the
    first two)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens = engine.tokenize(TEXT)[:1600]
        self.ctx, self.mirror, self.prompt, self.fresh = (
            engine.open_context(ROOM) for _ in range(4)
        )
        self.prompt.prefill(self.tokens[: 16 * BLOCK])

    def start(self, n: int) -> list[ColdBlock]:
        for c in (self.ctx, self.mirror):
            c.clear()
        step = min(4 * BLOCK, self.engine.facts.max_block_tokens or 4 * BLOCK)
        ends = range(step, n, step)
        if self.engine.facts.checkpoint_bytes:
            # A hybrid's blocks carry the recurrent state after them, taken as computed
            # (the window's tail can come back only with it): the prompt computed to ``n``.
            self.prompt.clear()
            self.prompt.prefill(self.tokens[:n], keep_state_at=ends)
        return [self.prompt.export(s, min(s + step, n)) for s in range(0, n, step)]

    def close(self) -> None:
        for c in (self.ctx, self.mirror, self.prompt, self.fresh):
            c.close()


class Churn:
    """One random sequence on a churned context and its never-evicting mirror."""

    def __init__(self, contexts: Contexts, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tokens = list(contexts.tokens)
        self.ctx, self.mirror = contexts.ctx, contexts.mirror
        self.cold: dict[int, ColdBlock] = {}
        self.n = self.rng.randint(8, 16) * BLOCK
        self.generated = False
        self.n -= 2
        prompt = contexts.start(self.n)
        for c in (self.ctx, self.mirror):
            for block in prompt:
                c.admit(block)
        self.extend(2)

    def compare(self, got: np.ndarray, want: np.ndarray) -> None:
        assert np.array_equal(got, want), float(np.max(np.abs(got - want)))

    def whole(self) -> None:
        for start in sorted(self.cold, key=lambda _: self.rng.random()):
            self.ctx.admit(self.cold.pop(start), AdmitMode.IN_PLACE)
        assert list(self.ctx.positions) == list(range(self.n))

    def evict(self) -> None:
        resident = set(self.ctx.positions)
        whole = [
            s
            for s in range(0, self.n - BLOCK + 1, BLOCK)
            if all(p in resident for p in range(s, s + BLOCK))
        ]
        if self.ctx.facts.checkpoint_bytes:
            # On a hybrid, removing the tail computes from a checkpoint, with the window's
            # gaps missing (partial-window KV, which sessions label): rollbacks do that
            # on a whole window.
            whole = [s for s in whole if s + BLOCK <= self.ctx.positions[-1]]
        if whole:
            s = self.rng.choice(whole)
            self.cold[s] = self.ctx.export(s, s + BLOCK)
            self.ctx.evict(s, s + BLOCK, EvictMode.GAP)

    def restore(self) -> None:
        if self.cold:
            start = self.rng.choice(sorted(self.cold))
            self.ctx.admit(self.cold.pop(start), AdmitMode.IN_PLACE)

    def extend(self, m: int) -> None:
        self.whole()
        new = self.tokens[self.n : self.n + m]
        self.compare(self.ctx.prefill(new), self.mirror.prefill(new))
        # The new tokens' KV too: a layer's keys and values depend on every attention
        # below it, so a difference in the last bits shows even where the logits agree.
        span = (self.n, self.n + len(new))
        assert bytes(self.ctx.export(*span).data) == bytes(self.mirror.export(*span).data)
        self.n += len(new)

    def rollback(self) -> None:
        self.whole()
        k = self.rng.randint(self.n - 100, self.n - 2)
        self.ctx.evict(k, self.n)
        self.mirror.evict(k, self.n)
        self.n = k
        self.extend(self.rng.randint(2, 60))

    def generate(self) -> None:
        self.whole()
        if self.ctx.logits_position != self.n - 1:  # its block went cold and came back
            self.extend(2)
        for _ in range(self.rng.randint(1, 6)):  # greedy, one token at a time
            token = int(np.argmax(self.ctx.logits()))
            self.compare(self.ctx.step(token), self.mirror.step(token))
            self.tokens[self.n : self.n + 1] = [token]
            self.n += 1
        self.generated = True

    def run(self, steps: int, *, generate: bool) -> None:
        ops = ["evict"] * 3 + ["restore", "rollback", "extend"] + ["generate"] * generate
        for _ in range(steps):
            op = self.rng.choice(ops)
            if op == "extend":
                self.extend(self.rng.randint(2, 80))
            else:
                getattr(self, op)()
        self.extend(5)


def churn(
    engine: Engine, seeds: list[int], fresh_seeds: Sequence[int] = (), *, steps: int = 24
) -> None:
    """Run each seed's sequence against the never-evicting context; the ``fresh_seeds``
    ones without generation, and checked at the end against a fresh context computing all
    their tokens at once too. (A token generated alone differs in the last bits from the
    same token computed in a batch, see the README: with generation, the never-evicting
    context, which generated the same tokens the same way, is the reference.)"""
    contexts = Contexts(engine)
    relayouts = 0
    try:
        for seed, fresh in [(s, False) for s in seeds] + [(s, True) for s in fresh_seeds]:
            c = Churn(contexts, seed)
            c.run(steps, generate=not fresh)
            relayouts += c.ctx.counters.relayouts
            if fresh:
                contexts.fresh.clear()
                c.compare(c.ctx.logits(), contexts.fresh.prefill(c.tokens[: c.n]))
    finally:
        contexts.close()
    assert relayouts, "no sequence left the cells out of order: the test checks nothing"
