"""``kvrt bench --quick``: session-level figures measured side by side in one run.

- restore through a session next to a numpy copy of the same bytes;
- time to first token for a re-sent evicted 1k-token segment, restored, next to
  recomputing it in a runtime whose cold store has never seen it;
- greedy decode tokens/s through a session next to the engine's own loop
  (``llama_cpp.Llama``, or a bare OpenVINO infer request).

These are figures to read, not assertions: machines here are shared and noisy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import anyio
import msgspec
import numpy as np

from kvrt import Config, Engine, Segment, Session, context_tokens, open_runtime
from kvrt.bench.reference import reference_greedy_tps
from kvrt.cli.messages import message

__all__ = ["QuickBench", "run_quick_bench", "text_of"]

PROSE = (
    "Ledger entry {i}: the clerk counted {i} crates of tea, weighed the salt twice and "
    "wrote the names of the carters who brought them in from the eastern road. "
)


def text_of(engine: Engine, n: int, salt: int = 0) -> str:
    """Text of about ``n`` tokens, different for every ``salt``."""
    words = "".join(PROSE.format(i=salt * 1000 + i) for i in range(n // 25 + 4))
    return engine.detokenize(engine.tokenize(words, add_special=False)[:n])


class QuickBench(msgspec.Struct, frozen=True, kw_only=True):
    segment_tokens: int
    restore_bytes: int
    restore_ms: float
    numpy_copy_ms: float
    restore_gbps: float
    numpy_copy_gbps: float
    ttft_restored_ms: float
    ttft_recomputed_ms: float
    ttft_speedup: float
    decode_tokens: int
    session_decode_tps: float
    reference_decode_tps: float
    reference: str
    decode_ratio: float
    backend: str


async def _ttft(session: Session, segments: list[Segment]) -> float:
    started = time.perf_counter()
    await session.ensure_context(segments)
    async for _piece in session.generate(1, stop_at_end=False):
        break
    return (time.perf_counter() - started) * 1e3


async def run_quick_bench(
    config: Config,
    *,
    tokens: int = 1024,
    decode: int = 64,
    repeat: int = 5,
    progress: Callable[[str], None] | None = None,
) -> QuickBench:
    def step(what: str) -> None:
        if progress is not None:
            progress(what)

    hot = max(2048, tokens + 512)
    async with open_runtime(config=config) as rt:
        engine = rt.engine
        doc = text_of(engine, tokens)

        def context(question: str) -> list[Segment]:
            return [
                message(rt, "system", "system", "Answer briefly."),
                Segment("doc", doc),
                message(rt, "question", "user", question, generation_prompt=True),
            ]

        async with rt.open_session(hot_tokens=hot) as s:
            await s.ensure_context(context("Which ship came first?"))
            step("restore")
            times = []
            for _ in range(repeat):
                await s.evict("doc")
                started = time.perf_counter()
                await s.admit("doc")
                times.append(time.perf_counter() - started)
            restore_ms = statistics.median(times) * 1e3
            doc_bytes = s.explain().engine.admitted_bytes // repeat
            restored_tokens = s.explain().engine.admitted_tokens // repeat
            src = np.ones(doc_bytes, dtype=np.uint8)
            dst = np.empty_like(src)
            copies = []
            for _ in range(repeat):
                started = time.perf_counter()
                np.copyto(dst, src)
                copies.append(time.perf_counter() - started)
            copy_ms = statistics.median(copies) * 1e3

            step("time to first token, restored")
            await s.evict("doc")
            ttft_restored = await _ttft(s, context("Which ship came first?"))

            step("decode through a session")
            story = context("Tell me a long story about the harbour.")
            await s.ensure_context(story)
            started = time.perf_counter()
            produced = 0
            async for _piece in s.generate(decode, stop_at_end=False):
                produced += 1
            session_tps = produced / (time.perf_counter() - started)
        prompt = context_tokens(engine, story)
        question = context("Which ship came first?")
        path = rt.model_info.model.path

    step("time to first token, recomputed")
    # No disk or remote tier: the runtime above wrote its blocks through to them.
    alone = msgspec.structs.replace(
        config,
        disk=msgspec.structs.replace(config.disk, budget=0),
        remote=msgspec.structs.replace(config.remote, url=None),
    )
    async with open_runtime(config=alone) as rt2, rt2.open_session(hot_tokens=hot) as fresh:
        ttft_recomputed = await _ttft(fresh, question)

    step("decode without kvrt")
    backend = config.engine.backend
    reference, raw_tps = await anyio.to_thread.run_sync(
        reference_greedy_tps, config.engine, path, prompt, decode
    )
    gb = doc_bytes / 1e9
    return QuickBench(
        segment_tokens=restored_tokens,
        restore_bytes=doc_bytes,
        restore_ms=restore_ms,
        numpy_copy_ms=copy_ms,
        restore_gbps=gb / (restore_ms / 1e3),
        numpy_copy_gbps=gb / (copy_ms / 1e3),
        ttft_restored_ms=ttft_restored,
        ttft_recomputed_ms=ttft_recomputed,
        ttft_speedup=ttft_recomputed / ttft_restored,
        decode_tokens=decode,
        session_decode_tps=session_tps,
        reference_decode_tps=raw_tps,
        reference=reference,
        decode_ratio=session_tps / raw_tps,
        backend=backend,
    )
