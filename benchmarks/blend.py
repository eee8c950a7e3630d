"""What approximate hits cost in quality, and what blending buys back (part of
``python -m benchmarks.fidelity``).

The distractor task: a haystack with the pass key K is first computed after a lead that
states another pass key D (the *prime*); the context asked then has a neutral lead of its
own before the same haystack, so every haystack block is an approximate hit — the same
tokens, whose KV attended to D. Under ``approximate="blend:R"`` each hit's first
``ceil(R * n)`` tokens are computed afresh and the rest restored; ``full`` computes the
context. Per ratio: exact match, teacher-forced gold log-prob, top-1 agreement with
``full`` (as in the passkey table), and the agent trace of ``kvrt bench`` served with that
ratio (total time to first token; tokens restored approximately and computed).

Ratio 1 computes every token, so it runs after the others (its blocks, stored exact at
close, would otherwise be exact hits for them); ``full`` runs last and restores those.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import partial

import msgspec

from kvrt import Config, Engine, Segment, open_runtime
from kvrt.bench import context_tokens
from kvrt.bench.full import serve_trace, trace_contexts

from .passkey import QUESTIONS, Answer, ask, haystack, per_filler, summarize

__all__ = ["RATIOS", "TRACE_TURNS", "BlendRow", "print_blend", "run_blend_bench"]

RATIOS: tuple[float, ...] = (0.0, 0.05, 0.15, 0.3, 1.0)
TRACE_TURNS = 10
NEUTRAL_LEAD = "Read the following text carefully. "


def distractor_lead(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


class BlendRow(msgspec.Struct, frozen=True, kw_only=True):
    condition: str
    """``blend:R`` or ``full``."""
    ratio: float | None
    """Share of each approximate hit computed afresh (None for ``full``)."""
    keys: int
    exact_match: float
    gold_logprob: float
    top1_agreement: float
    trace_seconds: float | None
    """The agent trace served with this ratio: total time to first token, seconds."""
    trace_approximate_tokens: int | None
    trace_prefilled_tokens: int | None


async def run_blend_bench(
    config: Config,
    *,
    size: int = 1024,
    depth: float = 0.5,
    keys: int = 10,
    ratios: Sequence[float] = RATIOS,
    trace_turns: int = TRACE_TURNS,
    seed: int = 11,
    progress: Callable[[str], None] | None = None,
) -> list[BlendRow]:
    rng = random.Random(seed)
    chosen = [
        (str(rng.randrange(10_000, 100_000)), str(rng.randrange(10_000, 100_000)))
        for _ in range(keys)
    ]
    ordered = sorted(ratios, key=lambda r: r >= 1.0)  # full recompute after the others
    names = [f"blend:{r:g}" for r in ordered] + ["full"]
    results: dict[str, list[Answer]] = {n: [] for n in names}
    question = QUESTIONS["passkey"]
    alone = _without_disk(config)
    for i, (key, other) in enumerate(chosen):
        if progress is not None:
            progress(f"distractor, key {i + 1} of {len(chosen)}")
        # A runtime per key, without a disk tier: no exact copy from another key's runs.
        async with open_runtime(config=alone) as rt:
            engine = rt.engine
            text = partial(_text, engine)
            hay = haystack(key, max(1, (size - 80) // per_filler(engine)), depth)
            gold = engine.tokenize(" " + key, add_special=False)
            prime = [Segment("lead", distractor_lead(other)), Segment("haystack", hay)]
            async with rt.open_session(hot_tokens=size + 512) as s:
                await s.ensure_context([*prime, Segment("q", question)])
            body = [Segment("lead", NEUTRAL_LEAD), Segment("haystack", hay)]
            for name in names:
                policy = "never" if name == "full" else name
                async with rt.open_session(hot_tokens=size + 512, approximate=policy) as s:
                    results[name].append(await ask(s, body, question, gold, text))
    traces = await _traces(config, ordered, trace_turns, progress)
    rows = []
    for name, got in results.items():
        ratio = None if name == "full" else float(name.partition(":")[2])
        trace = traces.get(name)
        rows.append(
            BlendRow(
                condition=name,
                ratio=ratio,
                keys=len(chosen),
                **summarize(got, results["full"]),
                trace_seconds=None if trace is None else trace[0],
                trace_approximate_tokens=None if trace is None else trace[1],
                trace_prefilled_tokens=None if trace is None else trace[2],
            )
        )
    return rows


async def _traces(
    config: Config, ratios: Sequence[float], turns: int, progress: Callable[[str], None] | None
) -> dict[str, tuple[float, int, int]]:
    """The agent trace per ratio, each in a runtime of its own (no exact copy of another
    run's blocks to find)."""
    out = {}
    contexts = trace_contexts(turns, 300)
    for ratio in ratios:
        name = f"blend:{ratio:g}"
        async with open_runtime(config=_without_disk(config)) as rt:
            hot = max(len(context_tokens(rt.engine, c)) for c in contexts) + 64
            hot = max(hot, 4 * config.session.block_tokens)
            turns_s, _, approximated, prefilled = await serve_trace(
                rt, contexts, hot, name, progress or (lambda _: None)
            )
            out[name] = (sum(t for t, _ in turns_s), approximated, prefilled)
    return out


def _text(engine: Engine, tokens: list[int]) -> str:
    return engine.detokenize(tokens) if tokens else ""


def _without_disk(config: Config) -> Config:
    return msgspec.structs.replace(config, disk=msgspec.structs.replace(config.disk, budget=0))


def print_blend(rows: Sequence[BlendRow]) -> None:
    print(
        "approximate hits after a distractor: exact match / gold log-prob / top-1 with full; "
        "agent trace time to first token (s), tokens restored approximately / computed"
    )
    for r in rows:
        trace = (
            f"{r.trace_seconds:6.1f} s {r.trace_approximate_tokens:6d} / {r.trace_prefilled_tokens:6d}"
            if r.trace_seconds is not None
            else ""
        )
        print(
            f"{r.condition:<11} {r.exact_match:4.0%} {r.gold_logprob:7.2f} {r.top1_agreement:4.0%}  {trace}"
        )
