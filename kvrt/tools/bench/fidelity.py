"""``kvrt bench --fidelity``: how much of a long context the model can still use.

Passkey retrieval, generated in code: a five-digit key hidden in filler text at a depth
(10/50/90 %), contexts of 1k and 2k tokens (``--sizes``), the question at the end. Plain
text, no chat template. Each prompt is asked under every condition, with the same keys:

- ``full``: the hot window holds everything;
- ``discard``: a 512-token window kept by recency (``class_lru``): the sinks and the most
  recent tokens, what llama.cpp's context shift leaves;
- ``class_lru@1024``, ``relevance@512``, ``relevance@1024``.

Per cell: greedy exact match, the teacher-forced log-prob of the gold answer (its tokens
fed one at a time through the session), the agreement of the first answer token's argmax
with ``full``, and wall time. The first condition computes each prompt; the others restore
its blocks from the cold store (exact hits), so they cost little besides the scoring.
Figures to read, not assertions.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from kvrt import Segment
from kvrt._config import Config
from kvrt._runtime import Runtime, open_runtime
from kvrt._session import Session

__all__ = ["CONDITIONS", "FidelityBench", "FidelityCell", "run_fidelity_bench"]

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there. "
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "What is the pass key? The pass key is"

CONDITIONS: tuple[tuple[str, int | None, str], ...] = (
    ("full", None, "class_lru"),
    ("discard", 512, "class_lru"),
    ("class_lru@1024", 1024, "class_lru"),
    ("relevance@512", 512, "relevance"),
    ("relevance@1024", 1024, "relevance"),
)
"""Name, hot window (None: the whole context), hot-eviction policy."""


class FidelityCell(msgspec.Struct, frozen=True, kw_only=True):
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
    seconds: float


def haystack(key: str, n_filler: int, depth: float) -> str:
    at = round(n_filler * depth)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return INTRO + FILLER * at + needle + FILLER * (n_filler - at)


def _next_logits(session: Session) -> np.ndarray:
    """The logits the session's next token would be drawn from."""
    actor = session._actor
    held = actor._override
    return np.asarray(held if held is not None else actor.ctx.logits(), dtype=np.float64)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    top = float(np.max(logits))
    return logits - (top + math.log(float(np.sum(np.exp(logits - top)))))


async def _ask(
    session: Session, context: list[Segment], gold: Sequence[int], text: Callable[[list[int]], str]
) -> tuple[bool, float, int]:
    """Greedy answer contains the key, teacher-forced log-prob of ``gold``, first argmax."""
    await session.ensure_context(context)
    first = _next_logits(session)
    argmax = int(np.argmax(first))
    answer = (await session.generate(max_tokens=len(gold) + 1)).text
    logprob = 0.0
    for k, token in enumerate(gold):
        await session.ensure_context([*context, Segment("gold", text(list(gold[:k])))])
        logits = first if k == 0 else _next_logits(session)
        logprob += float(_log_softmax(logits)[token])
    key = text(list(gold)).strip()
    return key in answer, logprob, argmax


async def run_fidelity_bench(
    config: Config,
    *,
    sizes: Sequence[int] = (1024, 2048),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    keys: int = 10,
    seed: int = 7,
    progress: Callable[[str], None] | None = None,
) -> FidelityBench:
    began = time.perf_counter()
    rng = random.Random(seed)
    cells = []
    async with open_runtime(config=config) as rt:
        engine = rt.engine
        per_filler = len(engine.tokenize(FILLER, add_special=False))
        for size in sizes:
            n_filler = max(1, (size - 60) // per_filler)
            for depth in depths:
                if progress is not None:
                    progress(f"{size} tokens, needle at {depth:.0%}")
                chosen = [str(rng.randrange(10_000, 100_000)) for _ in range(keys)]
                cells += await _cell(rt, size, depth, n_filler, chosen)
    return FidelityBench(cells=cells, seconds=time.perf_counter() - began)


async def _cell(
    rt: Runtime, size: int, depth: float, n_filler: int, chosen: list[str]
) -> list[FidelityCell]:
    engine = rt.engine

    def text(tokens: list[int]) -> str:
        return engine.detokenize(tokens) if tokens else ""

    results: dict[str, list[tuple[bool, float, int]]] = {name: [] for name, _, _ in CONDITIONS}
    seconds: dict[str, float] = dict.fromkeys(results, 0.0)
    for key in chosen:
        context = [Segment("haystack", haystack(key, n_filler, depth)), Segment("q", QUESTION)]
        gold = engine.tokenize(" " + key, add_special=False)
        for name, hot, policy in CONDITIONS:
            window = hot if hot is not None else size + 512
            t = time.perf_counter()
            async with rt.open_session(hot_tokens=window, hot_eviction=policy) as s:
                results[name].append(await _ask(s, context, gold, text))
            seconds[name] += time.perf_counter() - t
    full = [argmax for _, _, argmax in results["full"]]
    return [
        FidelityCell(
            condition=name,
            context_tokens=size,
            depth=depth,
            keys=len(chosen),
            exact_match=statistics.fmean(ok for ok, _, _ in rows),
            gold_logprob=statistics.fmean(lp for _, lp, _ in rows),
            top1_agreement=statistics.fmean(
                a == f for (_, _, a), f in zip(rows, full, strict=True)
            ),
            seconds=seconds[name],
        )
        for name, rows in results.items()
    ]


def print_fidelity(f: FidelityBench) -> None:
    print("passkey retrieval: exact match / gold log-prob (nats) / top-1 agreement with full")
    names = [name for name, _, _ in CONDITIONS]
    print("tokens depth  " + "  ".join(f"{n:>22}" for n in names))
    rows: dict[tuple[int, float], dict[str, FidelityCell]] = {}
    for c in f.cells:
        rows.setdefault((c.context_tokens, c.depth), {})[c.condition] = c
    for (size, depth), by in rows.items():
        line = "  ".join(
            f"{by[n].exact_match:4.0%} {by[n].gold_logprob:7.2f} {by[n].top1_agreement:4.0%}      "
            for n in names
        )
        print(f"{size:6d} {depth:4.0%}  {line}")
    print(f"wall time {f.seconds:.0f} s")
