"""``python -m benchmarks.fidelity``: how much of a long context the model can still use.

Passkey retrieval (:mod:`.passkey`): a five-digit key hidden in filler text at a depth
(10/50/90 %), contexts of 1k and 2k tokens (``--sizes``), the question at the end. Two
questions over the same haystacks:

- ``passkey``: "What is the pass key? The pass key is" (shares the needle's words);
- ``paraphrase``: "What number did I ask you to memorize? The number is" (shares none of
  its rarer words: lexical matching has nothing to hold on to).

Each prompt is asked under every condition, with the same keys:

- ``full``: the hot window holds everything;
- ``discard``: a 512-token window kept by recency (``class_lru``): the sinks and the most
  recent tokens, what llama.cpp's context shift leaves;
- ``class_lru@1024``; ``lexical@512`` (``relevance_lexical``, BM25 over token ids);
  ``relevance@512`` and ``relevance@1024`` (key vectors, the ``relevance`` policy).

Per cell: greedy exact match, the teacher-forced log-prob of the gold answer, the
agreement of the first answer token's argmax with ``full``, and wall time. The first
condition computes each prompt; the others restore its blocks from the cold store (exact
hits), so they cost little besides the scoring. Then approximate hits after a distractor,
per blend ratio (:mod:`.blend`). Figures to read, not assertions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

import kvrt
from kvrt import Config, Runtime, Segment, open_runtime
from kvrt.bench.plot import pyplot, save_figure

from ._common import config_of, count, int_list, parser, run_main, section
from .blend import RATIOS, TRACE_TURNS, BlendRow, print_blend, run_blend_bench
from .passkey import QUESTIONS, Answer, ask, check_answer_tokens, haystack, per_filler, summarize

__all__ = [
    "CONDITIONS",
    "FidelityBench",
    "FidelityCell",
    "fidelity_steps",
    "print_fidelity",
    "run_fidelity_bench",
]

CONDITIONS: tuple[tuple[str, int | None, str], ...] = (
    ("full", None, "class_lru"),
    ("discard", 512, "class_lru"),
    ("class_lru@1024", 1024, "class_lru"),
    ("lexical@512", 512, "relevance_lexical"),
    ("relevance@512", 512, "relevance"),
    ("relevance@1024", 1024, "relevance"),
)
"""Name, hot window (None: the whole context), hot-eviction policy."""


class FidelityCell(msgspec.Struct, frozen=True, kw_only=True):
    task: str
    """``passkey`` or ``paraphrase``."""
    condition: str
    context_tokens: int
    depth: float
    keys: int
    exact_match: float
    """Share of keys the greedy answer contains."""
    gold_logprob: float
    """Mean teacher-forced log-prob of the gold answer's tokens (nats, summed per key)."""
    top1_agreement: float
    """Share of keys whose first answer token's argmax equals ``full``'s."""
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
    sizes: Sequence[int] = (1024, 2048),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    keys: int = 10,
    seed: int = 7,
    blend: bool = True,
    progress: Callable[[str], None] | None = None,
) -> FidelityBench:
    began = time.perf_counter()
    rng = random.Random(seed)
    cells = []
    async with open_runtime(config=config) as rt:
        engine = rt.engine
        for size in sizes:
            n_filler = max(1, (size - 60) // per_filler(engine))
            for depth in depths:
                if progress is not None:
                    progress(f"{size} tokens, needle at {depth:.0%}")
                chosen = [str(rng.randrange(10_000, 100_000)) for _ in range(keys)]
                cells += await _cell(rt, size, depth, n_filler, chosen)
    rows = await run_blend_bench(config, keys=keys, progress=progress) if blend else []
    return FidelityBench(cells=cells, blend=rows, seconds=time.perf_counter() - began)


async def _cell(
    rt: Runtime, size: int, depth: float, n_filler: int, chosen: list[str]
) -> list[FidelityCell]:
    engine = rt.engine

    def text(tokens: list[int]) -> str:
        return engine.detokenize(tokens) if tokens else ""

    names = [name for name, _, _ in CONDITIONS]
    results: dict[tuple[str, str], list[Answer]] = {
        (task, name): [] for task in QUESTIONS for name in names
    }
    seconds = dict.fromkeys(results, 0.0)
    for key in chosen:
        hay = haystack(key, n_filler, depth)
        gold = engine.tokenize(" " + key, add_special=False)
        for task, question in QUESTIONS.items():
            check_answer_tokens(engine.tokenize, question, gold, text)
            for name, hot, policy in CONDITIONS:
                window = hot if hot is not None else size + 512
                t = time.perf_counter()
                async with rt.open_session(hot_tokens=window, hot_eviction=policy) as s:
                    body = [Segment("haystack", hay)]
                    results[task, name].append(await ask(s, body, question, gold, text))
                seconds[task, name] += time.perf_counter() - t
    return [
        FidelityCell(
            task=task,
            condition=name,
            context_tokens=size,
            depth=depth,
            keys=len(chosen),
            **summarize(answers, results[task, "full"]),
            seconds=seconds[task, name],
        )
        for (task, name), answers in results.items()
    ]


def fidelity_steps(n_sizes: int, keys: int) -> int:
    """Progress steps of :func:`run_fidelity_bench`: a cell per size and depth, a key of
    the distractor task each, a turn of each ratio's agent trace each."""
    return 3 * n_sizes + keys + len(RATIOS) * TRACE_TURNS


def print_fidelity(f: FidelityBench) -> None:
    print("passkey retrieval: exact match / gold log-prob (nats) / top-1 agreement with full")
    names = [name for name, _, _ in CONDITIONS]
    print("task       tokens depth  " + "  ".join(f"{n:>20}" for n in names))
    rows: dict[tuple[str, int, float], dict[str, FidelityCell]] = {}
    for c in f.cells:
        rows.setdefault((c.task, c.context_tokens, c.depth), {})[c.condition] = c
    for (task, size, depth), by in rows.items():
        line = "  ".join(
            f"{by[n].exact_match:4.0%} {by[n].gold_logprob:6.2f} {by[n].top1_agreement:4.0%}    "
            for n in names
        )
        print(f"{task:<10} {size:6d} {depth:4.0%}  {line}")
    if f.blend:
        print()
        print_blend(f.blend)
    print(f"wall time {f.seconds:.0f} s")


def plot_fidelity(bench: FidelityBench, path: str | Path) -> Path:
    """Draw ``bench`` into a PNG at ``path``: exact match per condition, task and context
    size (mean over depths); quality and agent-trace time per blend ratio."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    fig.suptitle("benchmarks.fidelity")
    groups = sorted({(c.task, c.context_tokens) for c in bench.cells})
    names = [name for name, _, _ in CONDITIONS]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        means = []
        for task, size in groups:
            cells = [
                c
                for c in bench.cells
                if (c.task, c.context_tokens, c.condition) == (task, size, name)
            ]
            means.append(100 * sum(c.exact_match for c in cells) / max(1, len(cells)))
        left.bar([g + k * width for g in range(len(groups))], means, width, label=name)
    left.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    left.set_xticklabels([f"{task}\n{size} tokens" for task, size in groups])
    left.set_ylabel("exact match (%), mean over needle depths")
    left.set_title("passkey retrieval by hot-window condition")
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


SIZES = (1024, 2048)
PLOT = "kvrt-fidelity.png"


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument(
        "--sizes",
        type=int_list,
        default=SIZES,
        metavar="N,N,...",
        help="context sizes in tokens (default 1024,2048; 256 to 7168)",
    )
    p.add_argument(
        "--keys", type=count(1, 100), default=10, metavar="N", help="passkeys per cell (default 10)"
    )
    p.add_argument("--plot", default=PLOT, metavar="PATH", help=f"the PNG (default {PLOT})")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    args = p.parse_args(argv)
    if max(args.sizes) > 7168 or min(args.sizes) < 256:
        raise kvrt.ConfigError("--sizes must stay between 256 and 7168 tokens")
    config = config_of(args)
    section(
        args,
        fidelity_steps(len(args.sizes), args.keys),
        lambda step: run_fidelity_bench(config, sizes=args.sizes, keys=args.keys, progress=step),
        print_fidelity,
        plot=None if args.no_plot else (args.plot, plot_fidelity),
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
