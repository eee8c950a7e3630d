"""Engine-layer figures, measured side by side in one run (not a test: machines are noisy).

    python -m kvrt.bench.engine_figures [--tokens 1024] [--decode 64] [--json]

- export / admit bandwidth of a KV block next to a numpy copy of the same bytes;
- time to admit a block next to the time to prefill the same tokens;
- greedy decode tokens/s through kvrt's adapter next to the engine's own loop
  (llama_cpp.Llama and a bare bridge loop; for OpenVINO a bare infer-request loop).

    python -m kvrt.bench.engine_figures --backend openvino
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import msgspec
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvrt import AdmitMode, EngineConfig, EvictMode, open_engine
from kvrt.bench.reference import reference_greedy_tps
from kvrt.native_bridge.llama import LlamaModel
from kvrt.native_bridge.llama_context import LlamaContext

ARCHIVE = (
    "In the archive of the old harbour office, every ship that ever docked had a card: its "
    "name, its cargo, the weather on the day it arrived and the name of the pilot who "
    "brought it in. "
)


class Figures(msgspec.Struct):
    block_tokens: int
    block_bytes: int
    export_ms: float
    admit_ms: float
    numpy_copy_ms: float
    export_gbps: float
    admit_gbps: float
    numpy_copy_gbps: float
    prefill_ms: float
    admit_speedup_vs_prefill: float
    decode_tokens: int
    kvrt_decode_tps: float
    bridge_decode_tps: float
    llama_cpp_decode_tps: float
    decode_ratio: float


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bridge_loop_tps(path: str, prompt: list[int], n: int) -> float:
    """The same greedy loop straight on the native bridge: the adapter's own overhead."""
    model = LlamaModel(path)
    bare = LlamaContext(model, n_ctx=len(prompt) + n + 8)
    bare.decode(prompt, 0)
    pos = len(prompt)
    started = time.perf_counter()
    for _ in range(n):
        bare.decode([int(np.argmax(bare.logits()))], pos)
        pos += 1
    tps = n / (time.perf_counter() - started)
    bare.close()
    model.close()
    return tps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024, help="block size in tokens")
    parser.add_argument("--decode", type=int, default=64, help="tokens to decode")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", choices=["llama", "openvino"], default="llama")
    args = parser.parse_args()

    config = EngineConfig(
        backend=args.backend, kv_type="f32" if args.backend == "openvino" else "f16"
    )
    engine = open_engine(config)
    base = engine.tokenize(ARCHIVE * (args.tokens // 20 + 2))
    tokens = base[: args.tokens]
    n = len(tokens)
    with Progress(transient=True) as progress:
        task = progress.add_task("measuring", total=5)

        ctx = engine.open_context(n + 64)
        t = time.perf_counter()
        ctx.prefill(tokens)
        prefill_ms = (time.perf_counter() - t) * 1e3
        progress.advance(task)

        block = ctx.export(0, n)
        export_ms = median_ms(lambda: ctx.export(0, n), args.repeat)
        progress.advance(task)

        def evict_admit() -> None:
            ctx.admit(block, AdmitMode.IN_PLACE)

        admit_times = []
        for _ in range(args.repeat):
            ctx.evict(0, n, EvictMode.GAP)
            t = time.perf_counter()
            evict_admit()
            admit_times.append(time.perf_counter() - t)
        admit_ms = statistics.median(admit_times) * 1e3
        dst = np.empty_like(block.data)
        copy_ms = median_ms(lambda: np.copyto(dst, block.data), args.repeat)
        progress.advance(task)

        prompt = engine.tokenize(
            engine.apply_chat_template([("user", "Tell me a long story about a harbour.")]),
            parse_special=True,
        )
        dec = engine.open_context(len(prompt) + args.decode + 8)
        logits = dec.prefill(prompt)
        t = time.perf_counter()
        for _ in range(args.decode):  # greedy, as the references decode
            logits = dec.step(int(np.argmax(logits)))
        kvrt_tps = args.decode / (time.perf_counter() - t)
        progress.advance(task)

        _, raw_tps = reference_greedy_tps(config, engine.facts.path, prompt, args.decode)
        # On OpenVINO the bare infer-request loop already is the bridge loop.
        bridge_tps = raw_tps
        if args.backend == "llama":
            bridge_tps = bridge_loop_tps(engine.facts.path, prompt, args.decode)
        progress.advance(task)

    gb = block.data.size / 1e9
    figures = Figures(
        block_tokens=n,
        block_bytes=int(block.data.size),
        export_ms=export_ms,
        admit_ms=admit_ms,
        numpy_copy_ms=copy_ms,
        export_gbps=gb / (export_ms / 1e3),
        admit_gbps=gb / (admit_ms / 1e3),
        numpy_copy_gbps=gb / (copy_ms / 1e3),
        prefill_ms=prefill_ms,
        admit_speedup_vs_prefill=prefill_ms / admit_ms,
        decode_tokens=args.decode,
        kvrt_decode_tps=kvrt_tps,
        bridge_decode_tps=bridge_tps,
        llama_cpp_decode_tps=raw_tps,
        decode_ratio=kvrt_tps / raw_tps,
    )
    ctx.close()
    dec.close()
    engine.close()
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(figures)).decode())
        return
    table = Table(
        title=f"kvrt engine figures on {args.backend} — {n}-token block, {block.data.size / 1e6:.1f} MB"
    )
    table.add_column("measure")
    table.add_column("kvrt", justify="right")
    table.add_column("reference", justify="right")
    table.add_column("ratio", justify="right")
    f = figures
    table.add_row(
        "export (GB/s) vs numpy copy",
        f"{f.export_gbps:.2f}",
        f"{f.numpy_copy_gbps:.2f}",
        f"{f.export_gbps / f.numpy_copy_gbps:.2f}x",
    )
    table.add_row(
        "admit (GB/s) vs numpy copy",
        f"{f.admit_gbps:.2f}",
        f"{f.numpy_copy_gbps:.2f}",
        f"{f.admit_gbps / f.numpy_copy_gbps:.2f}x",
    )
    table.add_row(
        f"admit vs prefill {n} tokens (ms)",
        f"{f.admit_ms:.2f}",
        f"{f.prefill_ms:.0f}",
        f"{f.admit_speedup_vs_prefill:.0f}x faster",
    )
    table.add_row(
        "greedy decode (tokens/s) vs "
        + ("llama_cpp.Llama" if args.backend == "llama" else "raw infer request"),
        f"{f.kvrt_decode_tps:.1f}",
        f"{f.llama_cpp_decode_tps:.1f}",
        f"{f.decode_ratio:.2f}x",
    )
    table.add_row(
        "greedy decode (tokens/s) vs bare bridge loop",
        f"{f.kvrt_decode_tps:.1f}",
        f"{f.bridge_decode_tps:.1f}",
        f"{f.kvrt_decode_tps / f.bridge_decode_tps:.2f}x",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
