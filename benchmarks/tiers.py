"""``python -m benchmarks.tiers``: the cold tiers measured side by side in one run.

- restoring a block of 128, 1k and 4k tokens from RAM, from disk and from a Redis server,
  next to computing it again; reading from disk with the page cache dropped for the file
  (``posix_fadvise(DONTNEED)``) where the kernel allows it, and a plain sequential read of
  the same bytes beside it;
- time to first token of a re-sent 2k-token segment in a restarted process: restored from
  the disk tier an earlier process wrote, next to computed again;
- decode tokens/s of 4 sessions generating at once, with and without the cold store
  spilling blocks to disk as fast as it can meanwhile, and the spill rate reached.

Redis is measured when ``redis-server`` is on the PATH (a server is started on a free
loopback port and stopped after). Figures to read, not assertions: machines here are
shared and noisy.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

import anyio
import msgspec

import kvrt
from kvrt import Config
from kvrt.bench.tiers import TierRow, block_rows, decode_while_spilling

from ._common import config_of, count, int_list, parser, run_main, section

__all__ = ["TierRow", "TiersBench", "run_tiers_bench"]


class TiersBench(msgspec.Struct, frozen=True, kw_only=True):
    rows: list[TierRow]
    page_cache: str
    """How the page cache was dropped before disk reads, or why it was not."""
    remote: str
    """The Redis server measured, or why none was."""
    restart_tokens: int
    ttft_restarted_disk_ms: float
    ttft_restarted_recomputed_ms: float
    restart_restored_tokens: int
    decode_tps_quiet: float
    decode_tps_spilling: float
    spill_mb_per_s: float
    spilled_blocks: int


RESTART = """
import anyio, json, sys, time, kvrt
from kvrt import Segment
from kvrt.bench.quick import text_of

async def main(mode):
    async with kvrt.open_runtime() as rt, rt.open_session(hot_tokens={hot}) as s:
        doc = text_of(rt.engine, {tokens})
        context = [Segment("doc", doc), Segment("q", "Which crates came first?")]
        began = time.perf_counter()
        status = await s.ensure_context(context)
        async for _ in s.generate(1, stop_at_end=False):
            break
        ms = (time.perf_counter() - began) * 1e3
        print(json.dumps({{"ms": ms, "restored": status.restored_tokens}}))

anyio.run(main, sys.argv[1])
"""


async def _restart(tokens: int, folder: str) -> tuple[float, float, int]:
    """TTFT of a re-sent segment in a fresh process: from disk, then with no disk tier."""
    script = RESTART.format(hot=tokens + 512, tokens=tokens)
    env = {**os.environ, "KVRT_DISK_PATH": folder}

    async def once(extra: dict[str, str]) -> dict[str, float]:
        done = await anyio.run_process(
            [sys.executable, "-c", script, "x"], env={**env, **extra}, check=True
        )
        return dict(json.loads(done.stdout.decode().strip().splitlines()[-1]))

    await once({})  # the earlier process: computes, writes its blocks, exits
    restored = await once({})
    recomputed = await once({"KVRT_DISK_BUDGET": "0"})
    return restored["ms"], recomputed["ms"], int(restored["restored"])


async def run_tiers_bench(
    config: Config,
    *,
    sizes: tuple[int, ...] = (128, 1024, 4096),
    restart_tokens: int = 2048,
    decode: int = 32,
    repeat: int = 3,
    progress: Callable[[str], None] | None = None,
) -> TiersBench:
    def step(what: str) -> None:
        if progress is not None:
            progress(what)

    rows, cache, where = await block_rows(config, sizes, repeat, step)
    step("restarted process")
    with tempfile.TemporaryDirectory() as folder:
        disk_ms, recomputed_ms, restored = await _restart(restart_tokens, folder)
    step("decode while spilling")
    quiet, busy, mb_s, blocks = await decode_while_spilling(config, decode)
    return TiersBench(
        rows=rows,
        page_cache=cache,
        remote=where,
        restart_tokens=restart_tokens,
        ttft_restarted_disk_ms=disk_ms,
        ttft_restarted_recomputed_ms=recomputed_ms,
        restart_restored_tokens=restored,
        decode_tps_quiet=quiet,
        decode_tps_spilling=busy,
        spill_mb_per_s=mb_s,
        spilled_blocks=blocks,
    )


def print_tiers(f: TiersBench) -> None:
    print("block restore, median ms (page cache: " + f.page_cache + "; remote: " + f.remote + ")")
    print(
        "tokens     bytes      RAM     disk  (read  GB/s | plain read GB/s)   Redis  signed"
        " (seal+check)  recompute"
    )
    for r in f.rows:
        remote = f"{r.remote_ms:7.2f}" if r.remote_ms is not None else "      -"
        signed = f"{r.remote_signed_ms:7.2f}" if r.remote_signed_ms is not None else "      -"
        print(
            f"{r.tokens:6d} {r.bytes:9d} {r.ram_ms:8.2f} {r.disk_ms:8.2f}  ({r.disk_read_ms:6.2f} "
            f"{r.disk_gbps:5.2f} | {r.plain_read_ms:6.2f} {r.plain_gbps:5.2f})   {remote} "
            f"{signed} ({r.sign_ms:6.2f})  {r.recompute_ms:9.1f}"
        )
    print(
        f"re-sent {f.restart_tokens}-token segment in a restarted process: first token "
        f"{f.ttft_restarted_disk_ms:.0f} ms from disk ({f.restart_restored_tokens} tokens "
        f"restored) vs {f.ttft_restarted_recomputed_ms:.0f} ms recomputed "
        f"({f.ttft_restarted_recomputed_ms / f.ttft_restarted_disk_ms:.1f}x)"
    )
    print(
        f"4 sessions decoding: {f.decode_tps_quiet:.1f} tok/s quiet, {f.decode_tps_spilling:.1f} "
        f"tok/s while the cold store spills {f.spill_mb_per_s:.1f} MB/s to disk "
        f"({f.spilled_blocks} blocks)"
    )


SIZES = (128, 1024, 4096)


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument(
        "--sizes",
        type=int_list,
        default=SIZES,
        metavar="N,N,...",
        help="block sizes in tokens (default 128,1024,4096; below 7680)",
    )
    p.add_argument(
        "--tokens",
        type=count(16, 7168),
        default=2048,
        metavar="N",
        help="the restarted process's context (default 2048)",
    )
    p.add_argument(
        "--decode",
        type=count(1, 64),
        default=64,
        metavar="N",
        help="tokens to decode while spilling (default 64)",
    )
    args = p.parse_args(argv)
    if max(args.sizes) > 7680:
        raise kvrt.ConfigError("--sizes must stay below 7680 tokens")
    config = config_of(args)
    section(
        args,
        len(args.sizes) + 2,
        lambda step: run_tiers_bench(
            config, sizes=args.sizes, restart_tokens=args.tokens, decode=args.decode, progress=step
        ),
        print_tiers,
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
