"""``kvrt bench``: the full set of figures, measured side by side in one run.

- restore vs recompute for blocks of 16 to 4096 tokens: the measured crossover, and where
  the calibrated policy (fitted from this very run) puts it;
- an agent trace (system prompt, repo map, files that come and go, a short history) served
  by kvrt and by the engine's own ways without kvrt (``llama_cpp.Llama`` alone and with its
  ``LlamaRAMCache``): total prefill time and time to first token, as ratios;
- restore bandwidth next to memcpy, time to first token of a re-sent segment, decode
  through a session next to raw (the quick figures, on a 2k-token segment);
- aggregate decode throughput, peak RSS and cold-store peak with 1, 4 and 8 sessions.

Every figure is read against a goal; none is an assertion (these machines are shared).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import anyio
import msgspec
import psutil

from kvrt import CacheClass, Config, KvrtError, Runtime, Segment, context_tokens, open_runtime
from kvrt.bench.quick import QuickBench, run_quick_bench, text_of
from kvrt.bench.reference import reference_trace
from kvrt.cli.messages import message

__all__ = ["FullBench", "run_full_bench"]

StepReport = Callable[[str], None]


class CrossoverPoint(msgspec.Struct, frozen=True, kw_only=True):
    tokens: int
    n_bytes: int
    restore_ms: float
    recompute_ms: float

    @property
    def speedup(self) -> float:
        return self.recompute_ms / self.restore_ms


class Crossover(msgspec.Struct, frozen=True, kw_only=True):
    points: list[CrossoverPoint]
    start: int
    """Position of each block's first token."""
    measured: int | None
    """Smallest block size measured at which restoring was faster (None: never)."""
    calibrated: int | None
    """Smallest block size the calibrated policy, fitted from this run, would restore."""
    calibrated_restores: int
    calibrated_prefills: int


class TraceSystem(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    ttft_ms: list[float]
    call_ms: list[float]
    total_prefill_s: float
    """Sum over turns of the time to first token (prefill plus one token)."""
    median_ttft_ms: float


class Trace(msgspec.Struct, frozen=True, kw_only=True):
    turns: int
    context_tokens: list[int]
    kvrt_hot_tokens: int
    kvrt_restored_tokens: int
    kvrt_prefilled_tokens: int
    approximate_restored_tokens: int
    """With approximate hits allowed: tokens restored approximately over the trace."""
    approximate_prefilled_tokens: int
    systems: list[TraceSystem]
    """kvrt (exact hits only, the default), kvrt with approximate hits allowed, then the
    references."""
    prefill_ratios: dict[str, float]
    """Reference total prefill time over kvrt's (exact hits only), per reference."""
    approximate_prefill_ratios: dict[str, float]
    """Reference total prefill time over kvrt's with approximate hits allowed."""


class SessionsPoint(msgspec.Struct, frozen=True, kw_only=True):
    sessions: int
    tokens_per_s: float
    """Aggregate greedy decode throughput of all sessions decoding at once."""
    ratio_to_one: float
    peak_rss_bytes: int
    cold_peak_bytes: int
    cold_budget_bytes: int


class Goal(msgspec.Struct, frozen=True, kw_only=True):
    figure: str
    goal: str
    measured: str
    met: bool


class FullBench(msgspec.Struct, frozen=True, kw_only=True):
    backend: str
    crossover: Crossover
    trace: Trace
    quick: QuickBench
    sessions: list[SessionsPoint]
    goals: list[Goal]
    plot: str | None = None


# -- restore vs recompute by block size --


async def _crossover(config: Config, sizes: Sequence[int], step: StepReport) -> Crossover:
    async with open_runtime(config=config) as rt:
        calibrated = rt.policy("restore", "calibrated")  # learns from everything below
        system = message(rt, "system", "system", "Answer briefly.")
        question = Segment("q", "Which crate came first?")
        hot = max(sizes) + 512
        points = []
        bpt = 0
        async with rt.open_session(hot_tokens=hot) as s:
            await s.ensure_context([system])
            start = s.explain().logical_tokens
            for size in sizes:
                step(f"restore vs recompute, {size}-token blocks")
                restores, recomputes, n_bytes = [], [], 0
                for k in range(3 if size <= 512 else 1):
                    doc = Segment("doc", text_of(rt.engine, size, salt=size * 10 + k))
                    await s.ensure_context([system])  # the window holds the prefix only
                    began = time.perf_counter()
                    first = await s.ensure_context([system, doc, question])
                    recomputes.append(time.perf_counter() - began)
                    if first.restored_tokens:  # a new segment must be computed to count
                        raise KvrtError("the crossover segment was found in the cold store")
                    await s.evict("doc")
                    admitted = s.explain().engine.admitted_bytes
                    began = time.perf_counter()
                    again = await s.ensure_context([system, doc, question])
                    restores.append(time.perf_counter() - began)
                    n_bytes = s.explain().engine.admitted_bytes - admitted
                    size_tokens = again.restored_tokens
                    bpt = n_bytes // max(size_tokens, 1)
                points.append(
                    CrossoverPoint(
                        tokens=size_tokens,
                        n_bytes=n_bytes,
                        restore_ms=statistics.median(restores) * 1e3,
                        recompute_ms=statistics.median(recomputes) * 1e3,
                    )
                )
        measured = next((p.tokens for p in points if p.restore_ms < p.recompute_ms), None)
        restores_seen, prefills_seen = calibrated.observations
        return Crossover(
            points=points,
            start=start,
            measured=measured,
            calibrated=calibrated.crossover(bpt, start=start),
            calibrated_restores=restores_seen,
            calibrated_prefills=prefills_seen,
        )


# -- the agent trace --

TRACE_FILES = [[0], [0], [0, 1], [0, 1], [1], [1, 2], [2], [2], [0, 2], [0, 2]]
TRACE_FILES += [[3], [3], [3, 4], [4], [4, 0], [0], [0, 5], [5], [5, 1], [1]]


def trace_contexts(turns: int, file_tokens: int) -> list[list[Segment]]:
    system = Segment(
        "system",
        "You are a coding agent. Read the files you are shown and answer in one sentence.",
        cache_class=CacheClass.TASK_PINNED,
    )
    repo_map = Segment(
        "repo_map",
        "Repository map:\n"
        + "".join(f"- pkg/module_{i}.py: parsers and helpers for feature {i}\n" for i in range(30)),
        cache_class=CacheClass.REPO_MAP,
    )
    files = [
        "".join(
            f"def f{n}_{i}(x):\n    return x * {i} + {n}  # step {i} of file {n}\n"
            for i in range(file_tokens // 20)
        )
        for n in range(6)
    ]
    contexts = []
    history: list[Segment] = []
    for t in range(turns):
        opened = TRACE_FILES[t % len(TRACE_FILES)]
        question = Segment(f"user-{t}", f"Turn {t}: what does f{opened[-1]}_{t % 7} return?")
        contexts.append(
            [
                system,
                repo_map,
                *(Segment(f"file-{n}", files[n]) for n in opened),
                *history,
                question,
            ]
        )
        reply = Segment(f"assistant-{t}", f"It returns x times {t % 7} plus {opened[-1]}.")
        history = [*history, question, reply][-4:]  # the last two exchanges stay
    return contexts


def _system(name: str, turns: Sequence[tuple[float, float]]) -> TraceSystem:
    ttft = [a * 1e3 for a, _ in turns]
    return TraceSystem(
        name=name,
        ttft_ms=ttft,
        call_ms=[b * 1e3 for _, b in turns],
        total_prefill_s=sum(ttft) / 1e3,
        median_ttft_ms=statistics.median(ttft),
    )


async def serve_trace(
    rt: Runtime, contexts: list[list[Segment]], hot: int, approximate: str, step: StepReport
) -> tuple[list[tuple[float, float]], int, int, int]:
    """kvrt serving the trace: per turn seconds, and tokens restored, restored
    approximately, prefilled."""
    turns = []
    restored = approximated = prefilled = 0
    label = "kvrt" if approximate == "never" else "kvrt, approximate hits allowed"
    async with rt.open_session(hot_tokens=hot, approximate=approximate) as s:
        for t, segments in enumerate(contexts):
            step(f"agent trace: {label}, turn {t + 1} of {len(contexts)}")
            began = time.perf_counter()
            status = await s.ensure_context(segments)
            async for _piece in s.generate(1, stop_at_end=False):
                break
            elapsed = time.perf_counter() - began
            turns.append((elapsed, elapsed))
            restored += status.restored_tokens
            approximated += status.approximate_tokens
            prefilled += status.prefilled_tokens
    return turns, restored, approximated, prefilled


async def _trace(config: Config, turns: int, file_tokens: int, step: StepReport) -> Trace:
    async with open_runtime(config=config) as rt:
        contexts = trace_contexts(turns, file_tokens)
        prompts = [context_tokens(rt.engine, c) for c in contexts]
        n_ctx = max(len(p) for p in prompts) + 64
        hot = max(n_ctx, 4 * config.session.block_tokens)
        exact, restored, _, prefilled = await serve_trace(rt, contexts, hot, "never", step)
        path = rt.model_info.model.path
    # A runtime of its own, so no block of the exact run is found in the cold store.
    async with open_runtime(config=config) as rt:
        loose, _, approximated, loose_prefilled = await serve_trace(
            rt, contexts, hot, "allow", step
        )
    step("agent trace: without kvrt")
    references = await anyio.to_thread.run_sync(
        reference_trace, config.engine, path, prompts, n_ctx
    )
    systems = [_system("kvrt", exact), _system("kvrt, approximate hits allowed", loose)]
    systems += [_system(name, got) for name, got in references.items()]
    ours, theirs = systems[0].total_prefill_s, systems[1].total_prefill_s
    return Trace(
        turns=turns,
        context_tokens=[len(p) for p in prompts],
        kvrt_hot_tokens=hot,
        kvrt_restored_tokens=restored,
        kvrt_prefilled_tokens=prefilled,
        approximate_restored_tokens=approximated,
        approximate_prefilled_tokens=loose_prefilled,
        systems=systems,
        prefill_ratios={s.name: s.total_prefill_s / ours for s in systems[2:]},
        approximate_prefill_ratios={s.name: s.total_prefill_s / theirs for s in systems[2:]},
    )


# -- many sessions --


async def _decode_at_once(rt: Runtime, n: int, decode: int) -> tuple[float, int, int]:
    """``n`` sessions decode at once: aggregate tokens/s, peak RSS and cold-store peak."""
    process = psutil.Process()
    peak = {"rss": process.memory_info().rss, "cold": rt.cold_stats().bytes}
    produced = [0] * n
    readies = [anyio.Event() for _ in range(n)]
    go, finished = anyio.Event(), anyio.Event()

    async def watch() -> None:
        while True:
            peak["rss"] = max(peak["rss"], process.memory_info().rss)
            peak["cold"] = max(peak["cold"], rt.cold_stats().bytes)
            await anyio.sleep(0.01)

    async def one(i: int) -> None:
        async with rt.open_session(hot_tokens=512, name=f"bench-{i}") as s:
            # Larger than the window: each session parks blocks in the shared cold store.
            text = text_of(rt.engine, 700, salt=7000 + i)
            await s.ensure_context([message(rt, "doc", "user", text, generation_prompt=True)])
            readies[i].set()
            await go.wait()
            async for _piece in s.generate(decode, stop_at_end=False):
                produced[i] += 1
            await finished.wait()  # stay open until every session is done decoding

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        async with anyio.create_task_group() as sessions:
            for i in range(n):
                sessions.start_soon(one, i)
            for ready in readies:
                await ready.wait()
            began = time.perf_counter()
            go.set()
            # Counters the sessions bump as they go, read as often.
            while sum(produced) < n * decode:  # noqa: ASYNC110
                await anyio.sleep(0.002)
            elapsed = time.perf_counter() - began
            finished.set()
        tg.cancel_scope.cancel()
    return sum(produced) / elapsed, peak["rss"], peak["cold"]


async def _sessions(
    config: Config, counts: Sequence[int], decode: int, step: StepReport
) -> list[SessionsPoint]:
    out: list[SessionsPoint] = []
    async with open_runtime(config=config) as rt:
        for n in counts:
            step(f"{n} sessions decoding at once")
            tps, rss, cold = await _decode_at_once(rt, n, decode)
            out.append(
                SessionsPoint(
                    sessions=n,
                    tokens_per_s=tps,
                    ratio_to_one=tps / out[0].tokens_per_s if out else 1.0,
                    peak_rss_bytes=rss,
                    cold_peak_bytes=cold,
                    cold_budget_bytes=rt.cold_stats().budget_bytes,
                )
            )
    return out


# -- all of it --


def _goals(b: FullBench) -> list[Goal]:
    q, trace = b.quick, b.trace
    goals = [
        Goal(
            figure="restore bandwidth through a session",
            goal=">= 0.5x memcpy",
            measured=f"{q.restore_gbps / q.numpy_copy_gbps:.2f}x ({q.restore_gbps:.2f} vs {q.numpy_copy_gbps:.2f} GB/s)",
            met=q.restore_gbps >= 0.5 * q.numpy_copy_gbps,
        ),
        Goal(
            figure=f"time to first token, re-sent {q.segment_tokens}-token segment",
            goal=">= 100x faster than recomputing",
            measured=f"{q.ttft_speedup:.0f}x ({q.ttft_restored_ms:.0f} vs {q.ttft_recomputed_ms:.0f} ms)",
            met=q.ttft_speedup >= 100,
        ),
    ]
    for kind, ratios in (
        ("exact hits only", trace.prefill_ratios),
        ("approximate hits allowed", trace.approximate_prefill_ratios),
    ):
        for name, ratio in ratios.items():
            wanted = 5.0 if "RAMCache" in name else 1.0
            goals.append(
                Goal(
                    figure=f"agent trace, {trace.turns} turns, kvrt ({kind}) vs {name}",
                    goal=f">= {wanted:g}x less prefill time",
                    measured=f"{ratio:.2f}x less",
                    met=ratio >= wanted,
                )
            )
    goals.append(
        Goal(
            figure=f"decode through a session vs {q.reference}",
            goal=">= 0.95x",
            measured=f"{q.decode_ratio:.2f}x",
            met=q.decode_ratio >= 0.95,
        )
    )
    last = b.sessions[-1]
    inside = all(p.cold_peak_bytes <= p.cold_budget_bytes for p in b.sessions)
    goals.append(
        Goal(
            figure=f"{last.sessions} sessions, aggregate decode",
            goal=">= 0.9x one session, cold store inside its budget",
            measured=f"{last.ratio_to_one:.2f}x, cold peak {last.cold_peak_bytes / 1e6:.1f} of {last.cold_budget_bytes / 1e6:.0f} MB",
            met=last.ratio_to_one >= 0.9 and inside,
        )
    )
    return goals


async def run_full_bench(
    config: Config,
    *,
    sizes: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    turns: int = 20,
    file_tokens: int = 300,
    tokens: int = 2048,
    decode: int = 64,
    sessions: Sequence[int] = (1, 4, 8),
    progress: StepReport | None = None,
) -> FullBench:
    def step(what: str) -> None:
        if progress is not None:
            progress(what)

    crossover = await _crossover(config, sizes, step)
    trace = await _trace(config, turns, file_tokens, step)
    quick = await run_quick_bench(config, tokens=tokens, decode=decode, progress=step)
    many = await _sessions(config, sessions, decode, step)
    bench = FullBench(
        backend=config.engine.backend,
        crossover=crossover,
        trace=trace,
        quick=quick,
        sessions=many,
        goals=[],
    )
    return msgspec.structs.replace(bench, goals=_goals(bench))


def steps_of(sizes: Sequence[int], turns: int, sessions: Sequence[int]) -> int:
    """How many progress steps :func:`run_full_bench` reports."""
    return len(sizes) + 2 * turns + 1 + 5 + len(sessions)
