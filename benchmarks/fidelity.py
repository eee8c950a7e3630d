"""``python -m benchmarks.fidelity``: how much of a long context the model can still use.

RULER-style tasks (:mod:`.ruler`: passkey, multi-key, multi-value, variable tracking, QA
among distractors) at context sizes given in tokens (``--sizes``), each prompt asked under
every condition:

- ``full``: the hot window holds everything;
- ``relevance@512`` and ``relevance@1024``: windows kept by key-vector relevance to the
  question (the ``relevance`` policy);
- ``class_lru@1024``, and ``recency@512`` (``class_lru`` at 512: the sinks and the most
  recent tokens, what llama.cpp's context shift leaves).

Windowed conditions run in two cases:

- ``whole``: the body was computed once with the whole context in view (a full-window
  session computed it, without the question, and closed); the windowed session restores
  the body's blocks and computes the question itself;
- ``never``: the context never fitted: the windowed session computes all of it, in a
  runtime of its own.

Nothing leaks between conditions: every runtime has a RAM cold store of its own and no
disk tier; in the ``whole`` runtime no session computes the question with the whole
context in view before the windowed ones have answered (``full`` answers last). Each
answer records what its session computed, so the report shows it.

Per cell: accuracy (the greedy answer holds everything asked), the mean teacher-forced
log-prob of the gold answer (nats, summed over its tokens), the share of prompts whose
asked needles were all hot when the question was answered, and the share of the context
the answering session computed itself. Then approximate hits after a distractor, per blend
ratio (:mod:`.blend`). Figures to read, not assertions.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import msgspec
import numpy as np

import kvrt
from kvrt import Config, Engine, Runtime, Segment, load_engine, open_runtime
from kvrt.bench.plot import pyplot, save_figure

from ._common import config_of, count, int_list, parser, run_main, section
from .blend import RATIOS, TRACE_TURNS, BlendRow, print_blend, run_blend_bench
from .passkey import log_softmax
from .ruler import TASKS, Prompt, make_prompt, needle_positions

__all__ = [
    "CASES",
    "CONDITIONS",
    "Answer",
    "FidelityBench",
    "FidelityCell",
    "answer",
    "fidelity_steps",
    "print_fidelity",
    "run_fidelity_bench",
]

CONDITIONS: tuple[tuple[str, int | None, str], ...] = (
    ("full", None, "class_lru"),
    ("relevance@512", 512, "relevance"),
    ("relevance@1024", 1024, "relevance"),
    ("class_lru@1024", 1024, "class_lru"),
    ("recency@512", 512, "class_lru"),
)
"""Name, hot window (None: the whole context), hot-eviction policy."""
CASES = ("whole", "never")
MIN_SIZE, MAX_SIZE = 1536, 8064
"""Context sizes measured: larger than every window (a window holding the whole context
would compute the question with all of it in view), within SmolLM2's trained context."""


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt answered under one condition."""

    right: bool
    """The greedy answer holds everything asked."""
    gold_logprob: float
    needles_hot: bool
    """Every block holding an asked needle was hot when the question was answered."""
    computed: float
    """Share of the context (body and question) the answering session computed in its
    first call."""
    question_computed: bool
    """The answering session computed the question's tokens itself."""


class FidelityCell(msgspec.Struct, frozen=True, kw_only=True):
    task: str
    case: str
    """``whole`` (the body computed once whole), ``never`` (it never fitted) or ``full``."""
    condition: str
    context_tokens: int
    prompts: int
    accuracy: float
    gold_logprob: float
    """Mean teacher-forced log-prob of the gold answer (nats, summed over its tokens)."""
    needles_hot: float
    """Share of prompts whose asked needles were all hot when the question was answered."""
    computed: float
    """Mean share of the context the answering session computed itself."""
    question_computed: float
    """Share of prompts whose question the answering session computed itself."""
    seconds: float
    """Wall time of the cell (placing, answering, scoring)."""


class FidelityBench(msgspec.Struct, frozen=True, kw_only=True):
    cells: list[FidelityCell]
    blend: list[BlendRow]
    """Approximate hits after a distractor, per blend ratio (empty when not measured)."""
    seconds: float


async def run_fidelity_bench(
    config: Config,
    *,
    sizes: Sequence[int] = (2048, 4096),
    tasks: Sequence[str] = TASKS,
    prompts: int = 5,
    cases: Sequence[str] = CASES,
    seed: int = 7,
    blend: bool = True,
    progress: Callable[[str], None] | None = None,
) -> FidelityBench:
    began = time.perf_counter()
    alone = msgspec.structs.replace(config, disk=msgspec.structs.replace(config.disk, budget=0))
    engine = await _load(alone)
    results: dict[tuple[str, int, str, str], list[tuple[Answer, float]]] = {}
    try:
        for size in sizes:
            for task in tasks:
                rng = random.Random(f"{seed}/{task}/{size}")
                for i in range(prompts):
                    if progress is not None:
                        progress(f"{task}, {size} tokens, prompt {i + 1} of {prompts}")
                    prompt = make_prompt(task, size, rng, _tokenize(engine))
                    for (case, name), got in (await _prompt(engine, alone, prompt, cases)).items():
                        results.setdefault((task, size, case, name), []).append(got)
    finally:
        engine.close()
    cells = [
        FidelityCell(
            task=task,
            case=case,
            condition=name,
            context_tokens=size,
            prompts=len(got),
            accuracy=statistics.fmean(a.right for a, _ in got),
            gold_logprob=statistics.fmean(a.gold_logprob for a, _ in got),
            needles_hot=statistics.fmean(a.needles_hot for a, _ in got),
            computed=statistics.fmean(a.computed for a, _ in got),
            question_computed=statistics.fmean(a.question_computed for a, _ in got),
            seconds=sum(s for _, s in got),
        )
        for (task, size, case, name), got in results.items()
    ]
    rows = await run_blend_bench(config, keys=prompts, progress=progress) if blend else []
    return FidelityBench(cells=cells, blend=rows, seconds=time.perf_counter() - began)


async def _load(config: Config) -> Engine:
    return await anyio.to_thread.run_sync(lambda: load_engine(config=config))


def _tokenize(engine: Engine) -> Callable[[str], list[int]]:
    return lambda text: engine.tokenize(text, add_special=False)


async def _prompt(
    engine: Engine, config: Config, prompt: Prompt, cases: Sequence[str]
) -> dict[tuple[str, str], tuple[Answer, float]]:
    """Every condition's answer to ``prompt``: (case, condition) -> answer, seconds."""
    whole = engine.tokenize(prompt.body, add_special=True)
    if len(whole) <= max(hot or 0 for _, hot, _ in CONDITIONS):
        raise kvrt.ConfigError(
            f"a {len(whole)}-token context fits a window: measure contexts of at least "
            f"{MIN_SIZE} tokens"
        )
    out: dict[tuple[str, str], tuple[Answer, float]] = {}
    windowed = [c for c in CONDITIONS if c[1] is not None]
    # The body computed whole (not the question), then each window answers; full last.
    async with open_runtime(engine=engine, config=config) as rt:
        # Room for the question and the answer, within the model's trained context.
        full_window = min(len(whole) + 512, rt.model_info.model.trained_context)
        async with rt.open_session(hot_tokens=full_window) as s:
            await s.ensure_context([Segment("body", prompt.body)])
        if "whole" in cases:
            for name, hot, policy in windowed:
                assert hot is not None
                out["whole", name] = await _timed(rt, prompt, hot, policy)
        out["full", "full"] = await _timed(rt, prompt, full_window, "class_lru")
    if "never" in cases:
        for name, hot, policy in windowed:
            assert hot is not None
            async with open_runtime(engine=engine, config=config) as rt:
                out["never", name] = await _timed(rt, prompt, hot, policy)
    return out


async def _timed(rt: Runtime, prompt: Prompt, hot: int, policy: str) -> tuple[Answer, float]:
    began = time.perf_counter()
    async with rt.open_session(hot_tokens=hot, hot_eviction=policy) as s:
        got = await answer(s, rt.engine, prompt)
    return got, time.perf_counter() - began


async def answer(session: kvrt.Session, engine: Engine, prompt: Prompt) -> Answer:
    """Ask ``prompt`` in ``session``: whether the greedy answer holds everything asked,
    the teacher-forced log-prob of the gold answer (its tokens appended to the question one
    at a time, so the query a relevance policy scores against stays the question and what
    the model has answered so far), whether the needles were hot, what was computed."""
    body = Segment("body", prompt.body)
    gold = engine.tokenize(prompt.gold, add_special=False)
    asked = engine.tokenize(prompt.question, add_special=False)
    text = [engine.detokenize(gold[:k]) for k in range(len(gold))]  # make_prompt checked them
    status = await session.ensure_context([body, Segment("q", prompt.question)])
    hot = {
        p
        for b in session.explain().blocks
        if b.residency == "hot"
        for p in range(b.start, b.start + b.n_tokens)
    }
    spans = needle_positions(prompt, lambda t: engine.tokenize(t, add_special=True))
    needles_hot = all(p in hot for a, b in spans for p in range(a, b))
    first = np.asarray(await session.next_logits(), dtype=np.float64)
    reply = (await session.generate(max_tokens=len(gold) + 2)).text
    logprob = 0.0
    for k, token in enumerate(gold):
        if k:
            await session.ensure_context([body, Segment("q", prompt.question + text[k])])
        logits = first if k == 0 else np.asarray(await session.next_logits(), dtype=np.float64)
        logprob += float(log_softmax(logits)[token])
    return Answer(
        right=all(e in reply for e in prompt.expected),
        gold_logprob=logprob,
        needles_hot=needles_hot,
        computed=min(1.0, status.prefilled_tokens / status.logical_tokens),
        question_computed=status.prefilled_tokens >= len(asked),
    )


def fidelity_steps(n_sizes: int, n_tasks: int, prompts: int, blend: bool = True) -> int:
    """Progress steps of :func:`run_fidelity_bench`: a prompt per size and task, a prompt
    of the distractor task each, a turn of each ratio's agent trace each."""
    return n_sizes * n_tasks * prompts + (prompts + len(RATIOS) * TRACE_TURNS if blend else 0)


def print_fidelity(f: FidelityBench) -> None:
    print(
        "accuracy / gold log-prob (nats) / asked needles hot, per task, size and case "
        "(whole: the body computed once whole; never: the context never fitted)"
    )
    names = [name for name, _, _ in CONDITIONS]
    print(f"{'task':<18} {'tokens':>6} {'case':<6} " + "  ".join(f"{n:>18}" for n in names))
    rows: dict[tuple[str, int], dict[tuple[str, str], FidelityCell]] = {}
    for c in f.cells:
        rows.setdefault((c.task, c.context_tokens), {})[c.case, c.condition] = c
    for (task, size), by in rows.items():
        for case in [c for c in CASES if any(k[0] == c for k in by)]:
            line = []
            for n in names:
                cell = by.get(("full", n) if n == "full" else (case, n))
                line.append(
                    f"{cell.accuracy:4.0%} {cell.gold_logprob:7.2f} {cell.needles_hot:4.0%}"
                    if cell is not None
                    else " " * 18
                )
            print(f"{task:<18} {size:6d} {case:<6} " + "  ".join(f"{x:>18}" for x in line))
    if f.blend:
        print()
        print_blend(f.blend)
    print(f"wall time {f.seconds:.0f} s")


def plot_fidelity(bench: FidelityBench, path: str | Path) -> Path:
    """Draw ``bench`` into a PNG at ``path``: accuracy per condition and task (contexts
    that never fitted, mean over sizes); quality and agent-trace time per blend ratio."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    fig.suptitle("benchmarks.fidelity")
    tasks = sorted({c.task for c in bench.cells})
    names = [name for name, _, _ in CONDITIONS]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        means = []
        for task in tasks:
            cells = [
                c
                for c in bench.cells
                if c.task == task and c.condition == name and c.case in ("full", "never")
            ]
            means.append(100 * sum(c.accuracy for c in cells) / max(1, len(cells)))
        left.bar([g + k * width for g in range(len(tasks))], means, width, label=name)
    left.set_xticks([g + 0.4 - width / 2 for g in range(len(tasks))])
    left.set_xticklabels(tasks, fontsize=8)
    left.set_ylabel("accuracy (%), mean over context sizes")
    left.set_title("contexts that never fitted, by hot-window condition")
    left.set_ylim(0, 130)
    left.legend(fontsize=8, ncol=3, loc="upper center")
    rows = [r for r in bench.blend if r.ratio is not None and r.trace_seconds is not None]
    if rows:
        ratios = [r.ratio for r in rows]
        right.plot(ratios, [r.gold_logprob for r in rows], "o-", label="gold log-prob (blend)")
        full = [r.gold_logprob for r in bench.blend if r.ratio is None]
        if full:
            right.axhline(full[0], color="grey", linestyle=":", label="gold log-prob (full)")
        right.set_xlabel("blend ratio (share of each run of approximate hits computed)")
        right.set_ylabel("mean gold log-prob (nats)")
        twin = right.twinx()
        twin.plot(ratios, [r.trace_seconds for r in rows], "r^-", label="agent trace")
        twin.set_ylabel("agent trace, total time to first token (s)", color="red")
        right.legend(fontsize=8, loc="lower right")
    right.set_title("approximate hits after a distractor")
    return save_figure(plt, fig, path)


SIZES = (2048, 4096)
PLOT = "kvrt-fidelity.png"


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument(
        "--sizes",
        type=int_list,
        default=SIZES,
        metavar="N,N,...",
        help=f"context sizes in tokens (default 2048,4096; {MIN_SIZE} to {MAX_SIZE})",
    )
    p.add_argument(
        "--tasks",
        type=lambda s: s.split(","),
        default=list(TASKS),
        metavar="T,T,...",
        help=f"tasks (default all: {','.join(TASKS)})",
    )
    p.add_argument(
        "--cases",
        type=lambda s: s.split(","),
        default=list(CASES),
        metavar="C,C",
        help="whole (the body computed once whole), never (it never fitted); default both",
    )
    p.add_argument(
        "--prompts", type=count(1, 100), default=5, metavar="N", help="prompts per cell (default 5)"
    )
    p.add_argument("--no-blend", action="store_true", help="skip the approximate-hit part")
    p.add_argument("--plot", default=PLOT, metavar="PATH", help=f"the PNG (default {PLOT})")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    args = p.parse_args(argv)
    if max(args.sizes) > MAX_SIZE or min(args.sizes) < MIN_SIZE:
        raise kvrt.ConfigError(f"--sizes must stay between {MIN_SIZE} and {MAX_SIZE} tokens")
    if unknown := [t for t in args.tasks if t not in TASKS]:
        raise kvrt.ConfigError(f"unknown task {unknown[0]!r}: one of {', '.join(TASKS)}")
    if unknown := [c for c in args.cases if c not in CASES]:
        raise kvrt.ConfigError(f"unknown case {unknown[0]!r}: whole or never")
    config = config_of(args)
    blend = not args.no_blend
    section(
        args,
        fidelity_steps(len(args.sizes), len(args.tasks), args.prompts, blend),
        lambda step: run_fidelity_bench(
            config,
            sizes=args.sizes,
            tasks=args.tasks,
            prompts=args.prompts,
            cases=args.cases,
            blend=blend,
            progress=step,
        ),
        print_fidelity,
        plot=None if args.no_plot else (args.plot, plot_fidelity),
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
