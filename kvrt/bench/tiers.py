"""The cold tiers' parts timed one by one, for ``python -m benchmarks.tiers``: a block
restored from RAM, from disk (the page cache dropped first), from a Redis server with and
without the replicas' secret, next to computing it again; decode speed while the store
spills to disk. These reach into the store's tiers, which the public API keeps out of
sight: that is why they live in the package."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import anyio
import msgspec

import kvrt
from kvrt import AdmitMode, CacheClass, ColdKey, Config, EngineContext, EvictMode
from kvrt.cold import ColdEntry, DiskTier, RemoteTier, Signer, encode_block, token_digest

from .quick import text_of

__all__ = ["TierRow", "block_rows", "decode_while_spilling", "redis_server"]


class TierRow(msgspec.Struct, frozen=True, kw_only=True):
    tokens: int
    bytes: int
    ram_ms: float
    disk_ms: float
    """Read (page cache dropped where possible), verify and admit."""
    disk_read_ms: float
    """The disk tier's read and check alone."""
    plain_read_ms: float
    """A plain sequential read of the same file, page cache dropped the same way."""
    remote_ms: float | None
    remote_signed_ms: float | None = None
    """Read from Redis with the replicas' secret: the tag checked, then admitted."""
    sign_ms: float = 0.0
    """Sealing the block's stored bytes and checking the seal (HMAC-SHA256, 32 bytes)."""
    recompute_ms: float

    @property
    def disk_gbps(self) -> float:
        return self.bytes / 1e9 / (self.disk_read_ms / 1e3)

    @property
    def plain_gbps(self) -> float:
        return self.bytes / 1e9 / (self.plain_read_ms / 1e3)


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def _drop_cache(path: Path) -> bool:
    """Ask the kernel to forget ``path``'s cached pages; False where it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _plain_read(path: Path) -> None:
    with path.open("rb", buffering=0) as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(buf)


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", folder],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            import redis

            client = redis.Redis(port=port, socket_timeout=1)
            for _ in range(100):
                with contextlib.suppress(redis.ConnectionError):
                    client.ping()
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _admit(ctx: EngineContext, block: kvrt.ColdBlock) -> None:
    """Put ``block`` back in place, in the window that computed it."""
    ctx.evict(block.meta.start, block.meta.end, EvictMode.GAP)
    ctx.admit(block, AdmitMode.IN_PLACE)


def _seal_and_check(signer: Signer, name: str, head: bytes, payload: memoryview) -> None:
    signer.open(name, signer.seal(name, head, payload))


async def block_rows(
    config: Config, sizes: tuple[int, ...], repeat: int, step: Callable[[str], None]
) -> tuple[list[TierRow], str, str]:
    engine = await anyio.to_thread.run_sync(partial(kvrt.load_engine, config=config))
    rows, dropped = [], True
    try:
        with tempfile.TemporaryDirectory() as folder, redis_server() as url:
            victim = kvrt.policies.get("cold_victim", "class_lru")
            disk = DiskTier(folder, 1 << 40, engine.facts.fingerprint, victim.order)
            disk.open()
            remote = RemoteTier(url) if url else None
            secret = Signer(b"a benchmark's shared secret, 32 bytes")
            signed = RemoteTier(url, signer=secret) if url else None
            for n in sizes:
                step(f"{n}-token block")
                ctx = engine.open_context(max(512, n + 64))
                tokens = engine.tokenize(text_of(engine, n + 8), add_special=True)[:n]
                ctx.prefill(tokens)
                block = ctx.export(0, n)
                key = ColdKey(engine.facts.fingerprint, token_digest([]), token_digest(tokens), 0)
                entry = ColdEntry(key, CacheClass.VOLATILE, block)

                admit = partial(_admit, ctx)
                ram_ms = _median_ms(partial(admit, block), repeat)
                await disk.write(entry)
                path = disk.path_of(key)
                disk_read, disk_total, plain = [], [], []
                for _ in range(repeat):
                    dropped &= _drop_cache(path)
                    began = time.perf_counter()
                    got = await disk.read(key)
                    read = time.perf_counter() - began
                    assert got is not None
                    admit(got.block)
                    disk_total.append(time.perf_counter() - began)
                    disk_read.append(read)
                    _drop_cache(path)
                    began = time.perf_counter()
                    _plain_read(path)
                    plain.append(time.perf_counter() - began)
                remote_ms = None
                if remote is not None:
                    await remote.write(entry)
                    times = []
                    for _ in range(repeat):
                        began = time.perf_counter()
                        got = await remote.read(key)
                        assert got is not None
                        admit(got.block)
                        times.append(time.perf_counter() - began)
                    remote_ms = statistics.median(times) * 1e3
                remote_signed_ms = None
                if signed is not None:
                    await signed.write(entry)
                    times = []
                    for _ in range(repeat):
                        began = time.perf_counter()
                        got = await signed.read(key)
                        assert got is not None
                        admit(got.block)
                        times.append(time.perf_counter() - began)
                    remote_signed_ms = statistics.median(times) * 1e3
                head, payload = encode_block(entry)
                name = secret.name("blk", key.digest().encode())
                sign_ms = _median_ms(partial(_seal_and_check, secret, name, head, payload), repeat)
                fresh = engine.open_context(max(512, n + 64))
                began = time.perf_counter()
                fresh.prefill(tokens)
                recompute_ms = (time.perf_counter() - began) * 1e3
                fresh.close()
                ctx.close()
                rows.append(
                    TierRow(
                        tokens=n,
                        bytes=int(block.data.size),
                        ram_ms=ram_ms,
                        disk_ms=statistics.median(disk_total) * 1e3,
                        disk_read_ms=statistics.median(disk_read) * 1e3,
                        plain_read_ms=statistics.median(plain) * 1e3,
                        remote_ms=remote_ms,
                        remote_signed_ms=remote_signed_ms,
                        sign_ms=sign_ms,
                        recompute_ms=recompute_ms,
                    )
                )
            for tier in (remote, signed):
                if tier is not None:
                    tier.close()
            where = "a local redis-server on loopback" if url else "none: redis-server not found"
    finally:
        engine.close()
    cache = (
        "dropped per file with posix_fadvise(DONTNEED) after fsync"
        if dropped
        else "not dropped (the kernel refused): disk reads may come from the page cache"
    )
    return rows, cache, where


async def decode_while_spilling(config: Config, decode: int) -> tuple[float, float, float, int]:
    """Decode tokens/s of 4 sessions, quiet and while the cold store spills blocks to disk
    as fast as it can (real exported KV, put under ever new keys); the MB/s spilled."""

    async def generate(rt: kvrt.Runtime, i: int, made: list[int]) -> None:
        async with rt.open_session(hot_tokens=512) as s:
            await s.ensure_context([kvrt.Segment("q", f"Story {i}: once upon a time")])
            made[i] = len((await s.generate(decode, stop_at_end=False)).tokens)

    async def spill(rt: kvrt.Runtime, block: kvrt.ColdBlock, stop: anyio.Event) -> None:
        i = 0
        while not stop.is_set():
            key = ColdKey(block.meta.fingerprint, token_digest([i]), "spill", 0)
            await rt.cold_store.put(ColdEntry(key, CacheClass.VOLATILE, block))
            i += 1

    results = []
    for spilling in (False, True):
        async with kvrt.open_runtime(config=config) as rt:
            ctx = rt.engine.open_context(512)
            ctx.prefill(rt.engine.tokenize(text_of(rt.engine, 128), add_special=True)[:128])
            block = ctx.export(0, 128)
            ctx.close()
            stop = anyio.Event()
            made = [0] * 4
            async with anyio.create_task_group() as tg:
                if spilling:
                    tg.start_soon(spill, rt, block, stop)
                began = time.perf_counter()
                async with anyio.create_task_group() as gens:
                    for i in range(4):
                        gens.start_soon(generate, rt, i, made)
                seconds = time.perf_counter() - began
                stop.set()
            disk = rt.cold_stats().disk
            writes = disk.writes if disk is not None else 0
            mb = writes * block.data.size / 1e6
            results.append((sum(made) / seconds, mb / seconds, writes))
    return results[0][0], results[1][0], results[1][1], results[1][2]
