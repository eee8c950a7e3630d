"""``python -m benchmarks.long_context``: contexts past the model's trained one.

RULER-style tasks (:mod:`.ruler`: passkey, multi-key, multi-value, variable tracking) at
lengths past the trained context (``--lengths``, in tokens), each prompt asked of:

- ``kvrt@W``: a session opened with ``long_context=True`` and a hot window of ``W``
  tokens (``--windows``): the context computed a window at a time, the blocks shown for
  the question chosen by relevance, at window positions (labelled approximate);
- ``full``: the same task at the model's trained length, in a window holding all of it
  — the best the dense model does, and what the long lengths are compared with;
- ``yarn``: ``llama_cpp.Llama`` with its own RoPE scaling (YaRN) stretched from the
  trained length to the prompt's (``--yarn-lengths``; slow: full attention over all of it).

A session answers its prompts one after another, each prompt's body sharing the filler
before its first needle with the one before it (prompts go deepest needle first): those
blocks are restored, bit for bit what computing them again gives, so ingest figures count
only the tokens computed. Per cell: accuracy (the greedy answer holds everything asked),
whether the blocks holding the asked needles were in the window at the question, the
mean teacher-forced log-prob of the gold answer, ingest tokens/s, time to first token
of a follow-up question (the question asked again after the answer), the time spent
scoring blocks per question, peak RSS above the runtime's (``/proc`` high-water mark,
reset per cell) against the bound a long context keeps (hot window + cold RAM budget +
sketches), and the bytes the disk tier holds. Figures to read, not assertions.
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import anyio
import msgspec
import numpy as np

import kvrt
from kvrt import Config, Engine, Segment, load_engine, open_runtime
from kvrt.native_bridge.memory import fix_mmap_threshold

from ._common import config_of, count, int_list, parser, run_main, section
from .passkey import log_softmax
from .ruler import Prompt, make_prompt, needle_positions

__all__ = ["LongCell", "main", "run_long_context_bench"]

TASKS = ("passkey", "multi_key", "multi_value", "variable_tracking")
LENGTHS = (16384, 32768)
WINDOWS = (1024, 2048)


class LongCell(msgspec.Struct, frozen=True, kw_only=True):
    """One condition at one length on one task."""

    task: str
    condition: str
    length: int
    """Tokens of the prompts' bodies asked for (the context holds a few more)."""
    prompts: int
    accuracy: float
    gold_logprob: float
    shown: float | None = None
    """Share of prompts whose asked needles were all in the window at the question (None:
    the window held the whole context)."""
    ingest_tps: float | None = None
    """Tokens computed per second while placing a new body (None: nothing computed)."""
    follow_up_s: float | None = None
    """Median time to the first token of the question asked again after the answer."""
    scoring_ms: float | None = None
    """Median time choosing the blocks to show, per question."""
    peak_rss_mib: float | None = None
    """Peak resident memory above the runtime's, during the cell."""
    bound_mib: float | None = None
    """What a long context keeps in memory at most: hot window + cold RAM budget + sketches."""
    disk_mib: float | None = None
    """Bytes on the disk tier at the end of the cell."""


def _rss_peak_reset() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _rss_peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _prompts(task: str, length: int, n: int, engine: Engine, seed: str) -> list[Prompt]:
    rng = random.Random(seed)
    tokenize: Callable[[str], list[int]] = lambda t: engine.tokenize(t, add_special=False)  # noqa: E731
    drawn = [make_prompt(task, length, rng, tokenize) for _ in range(n)]
    return sorted(drawn, key=lambda p: -p.needles[0][0])  # deepest first: shared filler restored


def _needles_shown(
    session: kvrt.Session, engine: Engine, prompt: Prompt, block_tokens: int
) -> bool:
    """Whether every block holding a token of the asked needles is in the window. The
    body's k-th block is ``body#k`` in a long context's window, ``body`` at index k in a
    context that fits."""
    spans = needle_positions(prompt, lambda t: engine.tokenize(t, add_special=True))
    want = {k for a, b in spans for k in range(a // block_tokens, (b - 1) // block_tokens + 1)}
    hot = set()
    for block in session.explain().blocks:
        if block.residency is kvrt.Residency.HOT:
            if block.segment == "body":
                hot.add(block.index)
            elif block.segment.startswith("body#"):
                hot.add(int(block.segment.removeprefix("body#")))
    return want <= hot


async def _answer(
    session: kvrt.Session, engine: Engine, prompt: Prompt, block_tokens: int
) -> tuple[bool, bool, float, kvrt.ContextStatus, float, float]:
    """Right, the asked needles shown, gold log-prob, the status of the first placement,
    its seconds, and the seconds to the first token of the question asked again after
    the answer."""
    body = Segment("body", prompt.body)
    gold = engine.tokenize(prompt.gold, add_special=False)
    text = [engine.detokenize(gold[:k]) for k in range(len(gold))]
    began = time.perf_counter()
    status = await session.ensure_context([body, Segment("q", prompt.question)])
    placed = time.perf_counter() - began
    shown = _needles_shown(session, engine, prompt, block_tokens)
    first = np.asarray(await session.next_logits(), dtype=np.float64)
    reply = (await session.generate(max_tokens=len(gold) + 2, temperature=0)).text
    began = time.perf_counter()
    again = [body, Segment("q", prompt.question), Segment("a", reply)]
    await session.ensure_context([*again, Segment("q2", "\n" + prompt.question)])
    await session.generate(max_tokens=1, temperature=0)
    follow_up = time.perf_counter() - began
    logprob = 0.0
    for k, token in enumerate(gold):
        if k:
            await session.ensure_context([body, Segment("q", prompt.question + text[k])])
        logits = first if k == 0 else np.asarray(await session.next_logits(), dtype=np.float64)
        logprob += float(log_softmax(logits)[token])
    return all(e in reply for e in prompt.expected), shown, logprob, status, placed, follow_up


async def _kvrt_cell(
    engine: Engine, config: Config, task: str, length: int, window: int | None, n: int
) -> LongCell:
    """``window`` None: the full window at the trained length."""
    trained = engine.facts.trained_context or length
    size = length if window is not None else trained - 128
    prompts = _prompts(task, size, n, engine, f"{task}-{size}")
    gc.collect()
    base = _rss_mib()
    _rss_peak_reset()
    rights, shown, logprobs, follow_ups, scorings = [], [], [], [], []
    computed, seconds = 0, 0.0
    bound = None
    async with open_runtime(engine=engine, config=config) as rt:
        hot = window if window is not None else trained
        async with rt.open_session(hot_tokens=hot, long_context=window is not None) as s:
            for prompt in prompts:
                right, seen, logprob, status, placed, follow_up = await _answer(
                    s, engine, prompt, config.session.block_tokens
                )
                rights.append(right)
                shown.append(seen)
                logprobs.append(logprob)
                follow_ups.append(follow_up)
                if status.long is not None:
                    scorings.append(status.long.scoring_seconds * 1000)
                    computed += status.long.computed_tokens
                    sketches = status.long.sketch_bytes
                else:
                    computed += status.prefilled_tokens
                    sketches = 0
                seconds += placed
                per_token = rt.model_info.model.kv_bytes_per_token
                cold = rt.model_info.capacity.host_cold_budget_bytes
                bound = (hot * per_token + cold + sketches) / 2**20
        stats = rt.cold_stats()
    disk = stats.disk.bytes / 2**20 if stats.disk is not None else None
    return LongCell(
        task=task,
        condition=f"kvrt@{window}" if window is not None else "full",
        length=size,
        prompts=len(prompts),
        accuracy=statistics.fmean(rights),
        gold_logprob=statistics.fmean(logprobs),
        shown=statistics.fmean(shown) if window is not None else None,
        ingest_tps=computed / seconds if computed else None,
        follow_up_s=statistics.median(follow_ups),
        scoring_ms=statistics.median(scorings) if scorings else None,
        peak_rss_mib=_rss_peak_mib() - base,
        bound_mib=bound,
        disk_mib=disk,
    )


def _yarn_cell(path: str, engine: Engine, task: str, length: int, n: int) -> LongCell:
    """``llama_cpp.Llama`` with YaRN stretched from the trained length to ``length``."""
    import llama_cpp

    from kvrt.adapters.llama import reference_llama

    trained = engine.facts.trained_context or length
    prompts = _prompts(task, length, n, engine, f"{task}-{length}")
    rights, logprobs = [], []
    computed, seconds = 0, 0.0
    gc.collect()
    base = _rss_mib()
    _rss_peak_reset()
    for prompt in prompts:
        tokens = engine.tokenize(prompt.body + prompt.question, add_special=True)
        gold = engine.tokenize(prompt.gold, add_special=False)
        llm = reference_llama(
            path,
            n_ctx=len(tokens) + len(gold) + 8,
            rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
            rope_freq_scale=trained / (len(tokens) + len(gold) + 8),
            yarn_orig_ctx=trained,
            logits_all=True,
            verbose=False,
        )
        began = time.perf_counter()
        llm.eval(tokens)
        seconds += time.perf_counter() - began
        computed += len(tokens)
        out: list[int] = []
        logprob = 0.0
        for token in gold:
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            if not out:
                first = int(np.argmax(logits))
            logprob += float(log_softmax(logits)[token])
            out.append(token)
            llm.eval([token])
        llm.n_tokens -= len(gold)  # back to the question: the greedy answer
        answer = [first]
        llm.eval([first])
        for _ in range(len(gold) + 1):
            nxt = int(np.argmax(np.asarray(llm.scores[llm.n_tokens - 1])))
            answer.append(nxt)
            llm.eval([nxt])
        reply = engine.detokenize(answer)
        rights.append(all(e in reply for e in prompt.expected))
        logprobs.append(logprob)
        llm.close()
    return LongCell(
        task=task,
        condition="yarn",
        length=length,
        prompts=len(prompts),
        accuracy=statistics.fmean(rights),
        gold_logprob=statistics.fmean(logprobs),
        ingest_tps=computed / seconds,
        peak_rss_mib=_rss_peak_mib() - base,
    )


async def run_long_context_bench(
    config: Config,
    *,
    tasks: Sequence[tuple[str, Sequence[int]]],
    windows: Sequence[int],
    prompts: int,
    long_prompts: int,
    yarn_lengths: Sequence[int],
    full: bool,
    progress: Callable[[str], None],
) -> list[LongCell]:
    engine = await anyio.to_thread.run_sync(lambda: load_engine(config=config))
    cells: list[LongCell] = []
    try:
        for task, lengths in tasks:
            if full:
                progress(f"{task} full")
                cells.append(await _kvrt_cell(engine, config, task, 0, None, prompts))
            for length in lengths:
                n = long_prompts if length > 100_000 else prompts
                for window in windows:
                    progress(f"{task} {length} kvrt@{window}")
                    cells.append(await _kvrt_cell(engine, config, task, length, window, n))
                if length in yarn_lengths:
                    progress(f"{task} {length} yarn")
                    yarn = partial(_yarn_cell, engine.facts.path, engine, task, length, min(n, 2))
                    cells.append(await anyio.to_thread.run_sync(yarn))
    finally:
        engine.close()
    return cells


def print_long_context(cells: list[LongCell]) -> None:
    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    print(
        "| task | condition | tokens | prompts | accuracy | needles shown | gold log-prob "
        "| ingest tok/s | follow-up s | scoring ms | peak RSS MiB | bound MiB | disk MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        print(
            f"| {c.task} | {c.condition} | {c.length} | {c.prompts} | {c.accuracy:.0%} "
            f"| {f(c.shown, '.0%')} | {c.gold_logprob:.2f} | {f(c.ingest_tps, '.0f')} "
            f"| {f(c.follow_up_s, '.2f')} "
            f"| {f(c.scoring_ms, '.0f')} | {f(c.peak_rss_mib, '.0f')} | {f(c.bound_mib, '.0f')} "
            f"| {f(c.disk_mib, '.0f')} |"
        )


def _task(text: str, lengths: Sequence[int]) -> tuple[str, Sequence[int]]:
    """``TASK`` (at ``lengths``) or ``TASK@N+N`` (at those)."""
    task, _, own = text.partition("@")
    if task not in TASKS:
        raise kvrt.ConfigError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
    if not own:
        return task, lengths
    try:
        return task, [int(n) for n in own.split("+")]
    except ValueError:
        raise kvrt.ConfigError(f"{text!r}: lengths after @ are whole numbers, + between") from None


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument(
        "--tasks",
        type=lambda s: s.split(","),
        default=list(TASKS),
        metavar="T,T",
        help="TASK@N+N asks TASK at those lengths only",
    )
    p.add_argument("--lengths", type=int_list, default=list(LENGTHS), metavar="N,N")
    p.add_argument("--windows", type=int_list, default=list(WINDOWS), metavar="W,W")
    p.add_argument("--prompts", type=count(1, 100), default=8, metavar="N")
    p.add_argument(
        "--long-prompts", type=count(1, 100), default=4, metavar="N", help="past 100k tokens"
    )
    p.add_argument("--yarn-lengths", type=int_list, default=[], metavar="N,N")
    p.add_argument("--no-full", action="store_true", help="skip the full-window reference")
    args = p.parse_args(argv)
    tasks = [_task(t, args.lengths) for t in args.tasks]
    config = config_of(args)
    fix_mmap_threshold()  # as `kvrt run` and `kvrt serve` do: what is freed is given back
    steps = sum(
        len(lengths) * len(args.windows)
        + (not args.no_full)
        + len([n for n in args.yarn_lengths if n in lengths])
        for _, lengths in tasks
    )
    section(
        args,
        steps,
        lambda step: run_long_context_bench(
            config,
            tasks=tasks,
            windows=args.windows,
            prompts=args.prompts,
            long_prompts=args.long_prompts,
            yarn_lengths=args.yarn_lengths,
            full=not args.no_full,
            progress=step,
        ),
        print_long_context,
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
