"""``python -m benchmarks.flash``: what llama.cpp's flash attention changes, off and on side by side.

For each setting, on the configured model and KV type (one engine per setting):

- restoring 2048 tokens in place (one block, or blocks of the window on a sliding-window
  model; median of five) next to a numpy copy of their bytes, and exporting them;
- prefill and greedy decode tokens/s;
- agreement with ``llama_cpp.Llama`` under the same setting: the next-token logits after a
  500-token prompt (bit-identical or the largest gap) and 32 greedy tokens;
- whether the same prompt computed in 64-token pieces (as kvrt computes contexts: segment
  by segment, block by block) gives the same logits as computing it at once;

and the gap between kvrt's own logits with flash attention off and on. Figures to read,
not assertions: machines here are shared and noisy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import anyio
import msgspec
import numpy as np

from kvrt import ColdBlock, Config, ConfigError, EngineContext, EvictMode, open_engine
from kvrt.bench.quick import text_of

from ._common import config_of, count, parser, run_main, section

__all__ = ["FlashBench", "FlashPoint", "flash_steps", "print_flash", "run_flash_bench"]

PROMPT_TOKENS = 500
"""Not a multiple of 256: with flash attention, pieces agree with one batch at such
lengths only (measured on SmolLM2: 256 and 512 tokens agree, 211, 300 and 500 do not)."""
GREEDY_TOKENS = 32
CHUNK = 64
REPEAT = 5


class FlashPoint(msgspec.Struct, frozen=True, kw_only=True):
    flash_attention: bool
    block_tokens: int
    block_bytes: int
    export_ms: float
    restore_ms: float
    numpy_copy_ms: float
    restore_gbps: float
    restore_vs_copy: float
    prefill_tps: float
    decode_tps: float
    reference_logits_identical: bool
    reference_max_delta: float
    reference_greedy_equal: bool
    chunked_logits_identical: bool
    """The prompt computed in 64-token pieces gives the logits of computing it at once."""
    chunked_max_delta: float


class FlashBench(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    kv_type: str
    points: list[FlashPoint]
    off_vs_on_max_delta: float | None
    off_vs_on_greedy_equal: bool | None


def flash_steps(kv_type: str) -> int:
    """Settings measured: off and on, or only on where the KV type needs it."""
    from kvrt.native_bridge.llama import FLOAT_KV_TYPES

    return 2 if kv_type in FLOAT_KV_TYPES else 1


def _median_ms(fn: Callable[[], object], setup: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEAT):
        setup()
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _greedy(ctx: EngineContext, logits: object) -> list[int]:
    out = []
    for _ in range(GREEDY_TOKENS):
        out.append(int(np.asarray(logits).argmax()))
        logits = ctx.step(out[-1])
    return out


def _reference(path: str, config: Config, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    import llama_cpp

    from kvrt.adapters.llama import reference_llama

    llm = reference_llama(path, config.engine, n_ctx=2 * len(prompt) + 64, verbose=False)
    try:
        llm.eval(prompt)
        # Llama keeps no logits of its own unless built with logits_all: read llama.cpp's.
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float32)
        llm.reset()  # type: ignore[no-untyped-call]
        greedy: list[int] = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            greedy.append(token)
            if len(greedy) >= GREEDY_TOKENS:
                break
    finally:
        llm.close()
    return logits, greedy


def _measure(config: Config, block_tokens: int) -> tuple[FlashPoint, np.ndarray, list[int]]:
    engine = open_engine(config.engine)
    try:
        facts = engine.facts
        tokens = engine.tokenize(text_of(engine, block_tokens + 16))[:block_tokens]
        ctx = engine.open_context(block_tokens + GREEDY_TOKENS + 16)
        try:
            started = time.perf_counter()
            ctx.prefill(tokens)
            prefill_tps = len(tokens) / (time.perf_counter() - started)
            # One block, or blocks of the window on a sliding-window model.
            step = facts.max_block_tokens or len(tokens)
            ranges = [(a, min(a + step, len(tokens))) for a in range(0, len(tokens), step)]
            held: list[ColdBlock] = []
            export_ms = _median_ms(
                lambda: held.extend(ctx.export(a, b) for a, b in ranges), held.clear
            )
            blocks = held[-len(ranges) :]
            data = np.concatenate([np.asarray(b.data) for b in blocks])
            restore_ms = _median_ms(
                lambda: ctx.admit_run(blocks),
                lambda: ctx.evict(0, len(tokens), EvictMode.GAP),
            )
            target = np.empty_like(data)
            copy_ms = _median_ms(lambda: np.copyto(target, data), lambda: None)
            ctx.evict(len(tokens) - 1, len(tokens), EvictMode.GAP)  # logits need a computed token
            last = ctx.prefill(tokens[-1:])
            started = time.perf_counter()
            _greedy(ctx, last)
            decode_tps = GREEDY_TOKENS / (time.perf_counter() - started)
        finally:
            ctx.close()
        prompt = tokens[:PROMPT_TOKENS]
        probe = engine.open_context(PROMPT_TOKENS + GREEDY_TOKENS + 16)
        try:
            ours = np.asarray(probe.prefill(prompt), dtype=np.float32)
            greedy = _greedy(probe, ours)
        finally:
            probe.close()
        pieces = engine.open_context(PROMPT_TOKENS + 16)
        try:
            for k in range(0, len(prompt), CHUNK):
                chunked = np.asarray(pieces.prefill(prompt[k : k + CHUNK]), dtype=np.float32)
        finally:
            pieces.close()
        ref_logits, ref_greedy = _reference(facts.path, config, prompt)
    finally:
        engine.close()
    gbps = data.nbytes / restore_ms / 1e6
    point = FlashPoint(
        flash_attention=facts.flash_attention,
        block_tokens=len(tokens),
        block_bytes=int(data.nbytes),
        export_ms=export_ms,
        restore_ms=restore_ms,
        numpy_copy_ms=copy_ms,
        restore_gbps=gbps,
        restore_vs_copy=copy_ms / restore_ms,
        prefill_tps=prefill_tps,
        decode_tps=decode_tps,
        reference_logits_identical=bool(np.array_equal(ours, ref_logits)),
        reference_max_delta=float(np.abs(ours - ref_logits).max()),
        reference_greedy_equal=greedy == ref_greedy,
        chunked_logits_identical=bool(np.array_equal(ours, chunked)),
        chunked_max_delta=float(np.abs(ours - chunked).max()),
    )
    return point, ours, greedy


async def run_flash_bench(
    config: Config, *, block_tokens: int = 2048, progress: Callable[[str], None] | None = None
) -> FlashBench:
    """Measure each flash-attention setting the KV type allows (a quantized V cache needs
    flash attention, so it has only ``on``)."""
    if config.engine.backend != "llama":
        raise ConfigError("--flash measures llama.cpp's flash attention: use --backend llama")
    settings = ["off", "on"] if flash_steps(config.engine.kv_type) == 2 else ["on"]
    points, logits, greedy = [], [], []
    for setting in settings:
        if progress is not None:
            progress(f"flash attention {setting}")
        engine = msgspec.structs.replace(config.engine, flash_attention=setting)
        point, ours, tokens = await anyio.to_thread.run_sync(
            _measure, msgspec.structs.replace(config, engine=engine), block_tokens
        )
        points.append(point)
        logits.append(ours)
        greedy.append(tokens)
    return FlashBench(
        model=config.engine.model or "embedded",
        kv_type=config.engine.kv_type,
        points=points,
        off_vs_on_max_delta=float(np.abs(logits[0] - logits[1]).max())
        if len(logits) == 2
        else None,
        off_vs_on_greedy_equal=greedy[0] == greedy[1] if len(greedy) == 2 else None,
    )


def print_flash(bench: FlashBench) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"flash attention — {bench.model}, {bench.kv_type} KV")
    for column in (
        "flash attention",
        "restore GB/s",
        "x numpy copy",
        "export ms",
        "prefill tok/s",
        "decode tok/s",
        "logits vs llama_cpp.Llama",
        "greedy equal",
        "64-token pieces vs at once",
    ):
        table.add_column(column, justify="right")
    for p in bench.points:
        table.add_row(
            "on" if p.flash_attention else "off",
            f"{p.restore_gbps:.2f}",
            f"{p.restore_vs_copy:.2f}",
            f"{p.export_ms:.1f}",
            f"{p.prefill_tps:.0f}",
            f"{p.decode_tps:.1f}",
            "identical" if p.reference_logits_identical else f"max |Δ| {p.reference_max_delta:.3g}",
            "yes" if p.reference_greedy_equal else "no",
            "identical" if p.chunked_logits_identical else f"max |Δ| {p.chunked_max_delta:.3g}",
        )
    console = Console()
    console.print(table)
    if bench.off_vs_on_max_delta is not None:
        console.print(
            f"kvrt off vs on: max |Δlogit| {bench.off_vs_on_max_delta:.3g}, greedy "
            f"{'equal' if bench.off_vs_on_greedy_equal else 'different'}",
            highlight=False,
        )


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument(
        "--tokens",
        type=count(512, 7680),
        default=2048,
        metavar="N",
        help="tokens restored (default 2048; 512 to 7680)",
    )
    args = p.parse_args(argv)
    config = config_of(args)
    section(
        args,
        flash_steps(config.engine.kv_type),
        lambda step: run_flash_bench(config, block_tokens=args.tokens, progress=step),
        print_flash,
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
