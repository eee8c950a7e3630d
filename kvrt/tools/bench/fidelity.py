"""``kvrt bench --fidelity``: how much of a long context the model can still use.

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

import msgspec

from kvrt import Config, Runtime, Segment, open_runtime

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
