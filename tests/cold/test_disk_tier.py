"""The disk tier: blocks that survive restarts and crashes, checked before every use.

The format refuses damaged bytes; the tier rebuilds its index from the files on open,
removing truncated or damaged ones; RAM victims are demoted to disk and disk hits promoted
back; faults in the writer leave a block in RAM or count it lost, never crash; a process
killed mid-spill leaves only complete blocks; two processes share a folder. The restart
test runs the real model: a second process restores, bit-exact, what the first computed.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest

import kvrt
from kvrt import CacheClass, Segment, policies
from kvrt._cold import BlockIO, ColdStore, DiskTier, blockfile
from kvrt.adapters.llama import LlamaEngine
from tests.support.disk_writer import SIZE, block, disk_tier, serving
from tests.support.models import next_logits
from tests.support.tiers import DOC, FIRST_PROCESS, OTHER, references, settled

pytestmark = pytest.mark.model

HERE = Path(__file__).resolve().parent
WRITER = [sys.executable, str(HERE.parent / "support" / "disk_writer.py")]


def store_over(disk: DiskTier, ram_blocks: int = 2, **kw: object) -> ColdStore:
    victim = policies.get("cold_victim", "class_lru")
    return ColdStore(ram_blocks * SIZE, victim, tiers=[disk], **kw)  # type: ignore[arg-type]


def block_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kvb"))


# -- the format --


def test_a_block_round_trips_and_every_damage_is_refused() -> None:
    entry = block(7)
    head, payload = blockfile.encode(entry)
    good = np.frombuffer(head + bytes(payload), dtype=np.uint8).copy()
    back = blockfile.decode(good.copy(), expect=entry.key)
    assert back.key == entry.key and back.cache_class is CacheClass.VOLATILE
    assert back.meta == entry.meta and np.array_equal(back.data, entry.data)

    def damaged(at: int) -> np.ndarray:
        bad = good.copy()
        bad[at] ^= 0x01
        return bad

    for at in (0, 9, blockfile.PREFIX.size + 3, len(head) + 100, len(good) - 1):
        with pytest.raises(blockfile.CorruptBlockError):
            blockfile.decode(damaged(at))
    with pytest.raises(blockfile.CorruptBlockError, match="promises"):
        blockfile.decode(good[:-1].copy())
    with pytest.raises(blockfile.CorruptBlockError, match="another key"):
        blockfile.decode(good.copy(), expect=block(8).key)


# -- the tier in one process --


@pytest.mark.anyio
async def test_ram_victims_are_demoted_and_disk_hits_promoted(tmp_path: Path) -> None:
    disk = disk_tier(str(tmp_path))
    disk.open()
    store = store_over(disk)
    async with serving(store):
        for i in range(6):
            assert await store.put(block(i))
        await settled(store)
        stats = store.stats()
        assert stats.entries == 2 and stats.evictions == stats.demoted == 4
        for i in range(6):
            assert block(i).key in store
        found = await store.fetch(block(0).key)
        assert found is not None and found.tier == "disk"
        assert np.array_equal(found.entry.data, block(0).data)
        assert found.entry.meta == block(0).meta
        again = await store.fetch(block(0).key)
        assert again is not None and again.tier == "ram"  # promoted
        stats = store.stats()
        assert stats.disk_hits == 1 and stats.promoted == 1 and stats.exact_hits == 2
    disk_stats = store.stats().disk
    assert disk_stats is not None and disk_stats.writes == 6 and len(block_files(tmp_path)) == 6


@pytest.mark.anyio
async def test_the_index_is_rebuilt_on_open_and_damaged_files_removed(tmp_path: Path) -> None:
    disk = disk_tier(str(tmp_path))
    disk.open()
    store = store_over(disk)
    async with serving(store):
        for i in range(5):
            await store.put(block(i))
    files = block_files(tmp_path)
    assert len(files) == 5
    truncated, flipped = files[0], files[1]
    truncated.write_bytes(truncated.read_bytes()[:1000])
    raw = bytearray(flipped.read_bytes())
    raw[-10] ^= 0xFF  # the header still reads: only the checksum can tell
    flipped.write_bytes(bytes(raw))
    garbage = files[2].parent / ("0" * 40 + ".kvb")
    garbage.write_bytes(b"not a block at all")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    leftover = files[3].parent / f".{files[3].stem}.{int(dead.stdout)}.abcd.tmp"
    leftover.write_bytes(b"half a block")
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("mine")

    reopened = disk_tier(str(tmp_path))
    reopened.open()
    stats = reopened.stats()
    assert stats.opened_with == stats.entries == 4  # the flipped one is caught on read
    assert stats.corrupt == 2  # the truncated file and the garbage
    assert not truncated.exists() and not garbage.exists() and not leftover.exists()
    assert unrelated.read_text() == "mine"  # not ours: left alone

    store = store_over(reopened)
    async with serving(store):
        served = {i: await store.fetch(block(i).key) for i in range(5)}
    broken = {i for i, f in served.items() if f is None}
    assert len(broken) == 2  # the truncated block and the flipped one: misses, never served
    for i, found in served.items():
        if found is not None:
            assert np.array_equal(found.entry.data, block(i).data)
    assert reopened.stats().corrupt == 3 and not flipped.exists()
    assert reopened.stats().last_error is not None


@pytest.mark.anyio
@pytest.mark.parametrize("writers", [1, 2])
async def test_the_disk_budget_holds(tmp_path: Path, writers: int) -> None:
    one = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in blockfile.encode(block(0)))
    disk = DiskTier(tmp_path, 3 * one, "f", policies.get("cold_victim", "class_lru").order)
    disk.open()
    store = store_over(disk, writers=writers)
    async with serving(store):
        for i in range(8):
            await store.put(block(i))
    stats = disk.stats()
    assert stats.entries == 3 and stats.bytes <= stats.budget_bytes and stats.removed == 5
    assert len(block_files(tmp_path)) == 3
    if writers == 1:
        # The least recently written went. (With two writers, "written" is when a write
        # finished, which a slow write can put after later ones: no order to assert.)
        assert {i for i in range(8) if block(i).key in disk} == {5, 6, 7}


class Faulty(BlockIO):
    """A writer that fails the way disks do: no space, an I/O error, or a short write that
    claims more than it wrote."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.on = True

    def write(self, fd: int, data: memoryview) -> int:
        if not self.on:
            return super().write(fd, data)
        if self.fault == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.fault == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        os.write(fd, data[: max(1, data.nbytes // 2)])
        return data.nbytes  # lies: the check of the file's size catches it


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["enospc", "eio", "short"])
async def test_writer_faults_are_reported_never_served_never_a_crash(
    tmp_path: Path, fault: str
) -> None:
    io = Faulty(fault)
    disk = DiskTier(tmp_path, 1 << 30, "f", policies.get("cold_victim", "class_lru").order, io=io)
    disk.open()
    store = store_over(disk, ram_blocks=3)
    async with serving(store):
        for i in range(2):
            await store.put(block(i))
        await settled(store)
        stats = disk.stats()
        assert stats.write_failures == 2 and stats.writes == 0 and stats.lost == 0
        assert stats.last_error is not None and "writ" in stats.last_error
        for i in range(2):  # still in RAM, whole
            found = await store.fetch(block(i).key)
            assert found is not None and found.tier == "ram"
            assert np.array_equal(found.entry.data, block(i).data)

        for i in range(2, 8):  # RAM overflows while every write fails
            await store.put(block(i))
        await settled(store)
        stats, ram = disk.stats(), store.stats()
        held = [i for i in range(8) if block(i).key in store]
        assert len(held) == ram.entries <= 3
        assert stats.lost == 8 - len(held)  # counted, not silent
        for i in held:
            found = await store.fetch(block(i).key)
            assert found is not None and np.array_equal(found.entry.data, block(i).data)

        io.on = False  # the disk recovers: later blocks are written
        await store.put(block(9))
        await settled(store)
        assert disk.stats().writes == 1 and block(9).key in disk
    assert not list(tmp_path.rglob("*.tmp"))  # no half-written file left behind
    assert len(block_files(tmp_path)) == 1


class Slow(BlockIO):
    def write(self, fd: int, data: memoryview) -> int:
        time.sleep(0.3)
        return super().write(fd, data)


@pytest.mark.anyio
async def test_close_finishes_queued_writes_within_its_timeout(tmp_path: Path) -> None:
    disk = disk_tier(str(tmp_path))
    disk.open()
    store = store_over(disk, ram_blocks=8)
    async with serving(store):
        for i in range(4):
            await store.put(block(i))
    assert len(block_files(tmp_path)) == 4
    assert store.flush_report is None or "finished" in store.flush_report

    slow = DiskTier(tmp_path / "slow", 1 << 30, "f", disk._order, io=Slow())
    slow.open()
    store = store_over(slow, ram_blocks=8, flush_timeout=0.2, writers=1)
    async with serving(store):
        for i in range(4):
            await store.put(block(i))
    assert store.flush_report is not None and "unfinished after 0.2 s" in store.flush_report
    assert not list((tmp_path / "slow").rglob("*.tmp"))


# -- processes --


@pytest.mark.subprocess
def test_a_process_killed_mid_spill_leaves_only_complete_blocks(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [*WRITER, str(tmp_path), "0", "100000"], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    written = 0
    while written < 40:
        line = child.stdout.readline()
        assert line, "the writer ended early"
        written = int(line.split()[1])
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)

    disk = disk_tier(str(tmp_path))
    disk.open()
    stats = disk.stats()
    assert stats.entries >= written and stats.corrupt == 0
    assert not list(tmp_path.rglob("*.tmp"))  # the dead writer's temporary files went

    async def read_all() -> int:
        good = 0
        for path in block_files(tmp_path):
            raw = np.fromfile(path, dtype=np.uint8)
            entry = blockfile.decode(raw)
            i = entry.meta.start // 16
            assert entry.key == block(i).key and np.array_equal(entry.data, block(i).data)
            good += 1
        return good

    assert anyio.run(read_all) == stats.entries


@pytest.mark.subprocess
def test_two_processes_share_one_folder(tmp_path: Path) -> None:
    a = subprocess.Popen([*WRITER, str(tmp_path), "0", "60"], stdout=subprocess.PIPE, text=True)
    b = subprocess.Popen([*WRITER, str(tmp_path), "30", "90"], stdout=subprocess.PIPE, text=True)
    out_a, _ = a.communicate(timeout=120)
    out_b, _ = b.communicate(timeout=120)
    assert a.returncode == b.returncode == 0
    assert out_a.splitlines()[-1].startswith("done") and out_b.splitlines()[-1].startswith("done")
    disk = disk_tier(str(tmp_path))
    disk.open()
    assert disk.stats().entries == 90 and disk.stats().corrupt == 0
    for path in block_files(tmp_path):
        entry = blockfile.decode(np.fromfile(path, dtype=np.uint8))
        i = entry.meta.start // 16
        assert np.array_equal(entry.data, block(i).data)


# -- the real model across a restart --


@pytest.mark.subprocess
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])  # the remote tier's twin runs asyncio
async def test_a_restarted_process_restores_what_an_earlier_one_computed(
    engine: LlamaEngine, anyio_backend: str
) -> None:
    context = [Segment("doc", DOC), Segment("q", "Who kept the logbook?")]
    script = FIRST_PROCESS.format(doc=DOC, other=OTHER)
    done = await anyio.run_process([sys.executable, "-c", script], check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]

    want, want_logits = await references(engine, context)

    small_ram = kvrt.load_config(flags={"memory.cold": "3MiB"})
    async with kvrt.open_runtime(engine=engine, config=small_ram) as rt:
        disk = rt.cold_stats().disk
        assert disk is not None and disk.opened_with > 0  # the first process's blocks
        async with rt.open_session(hot_tokens=512) as s:
            status = await s.ensure_context(context)
            assert status.restored_tokens > 0 and status.exact
            assert status.prefilled_tokens < status.restored_tokens
            choices = {b.choice for b in s.explain().blocks if b.segment == "doc"}
            assert any("restored from cold (disk)" in (c or "") for c in choices), choices
            got_logits = await next_logits(s)
            got = (await s.generate(max_tokens=16)).tokens
            # RAM holds about one block here: the doc's evicted blocks are cold on disk
            # (demoted, or never promoted) or in RAM, and explain() says which.
            await s.evict("doc")
            tiers = [b.cold_tier for b in s.explain().blocks if b.segment == "doc"]
            assert "disk" in tiers and set(tiers) <= {"ram", "disk"}, tiers
        assert rt.cold_stats().disk_hits > 0
    assert np.array_equal(got_logits, want_logits)
    assert got == want


SAVING_PROCESS = """
import anyio, json, sys, kvrt
from kvrt import Segment

async def main():
    async with kvrt.open_runtime() as rt, rt.open_session(hot_tokens=512) as s:
        await s.ensure_context([
            Segment("system", "You answer briefly.", cache_class="task_pinned"),
            Segment("doc", {doc!r}),
            Segment("q", "The logbook was kept by"),
        ])
        first = await s.generate(max_tokens=12)  # generated tokens join the context
        saved = await s.save(sys.argv[1])
        after = await s.generate(max_tokens=12)
        assert len(first.tokens) == 12, first.finish_reason
        print(json.dumps({{"first": first.tokens, "after": after.tokens,
                          "on_disk": saved.on_disk, "blocks": len(saved.blocks)}}))

anyio.run(main)
"""


@pytest.mark.subprocess
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_saved_session_resumes_in_a_later_process(
    engine: LlamaEngine, tmp_path: Path, anyio_backend: str
) -> None:
    path = tmp_path / "agent.json"
    script = SAVING_PROCESS.format(doc=DOC)
    done = await anyio.run_process([sys.executable, "-c", script, str(path)], check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    child = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert child["on_disk"] == child["blocks"] > 0  # every block reached the disk

    saved = msgspec.json.decode(path.read_bytes(), type=kvrt.SavedSession)
    assert [s.name for s in saved.segments] == ["system", "doc", "q", "assistant"]
    assert saved.segments[0].cache_class is CacheClass.TASK_PINNED
    assert saved.segments[-1].tokens == child["first"]  # the reply is part of it

    async with kvrt.open_runtime(engine=engine) as rt, rt.open_session(resume=path) as s:
        assert s.resumed is not None
        assert s.resumed.restored_tokens == s.resumed.logical_tokens  # every block, from disk
        assert s.resumed.prefilled_tokens <= 1 and s.resumed.exact
        after = await s.generate(max_tokens=12)
    assert list(after.tokens) == child["after"]  # it continues as the first process did

    other = kvrt.Config(engine=kvrt.EngineConfig(kv_type="q8_0"), disk=kvrt.DiskConfig(budget=0))
    with pytest.raises(kvrt.InvalidContextError, match="another model or KV layout"):
        async with kvrt.open_runtime(config=other) as rt, rt.open_session(resume=path):
            pass
    path.write_text("{not json")
    with pytest.raises(kvrt.InvalidContextError, match="not a saved kvrt session"):
        async with kvrt.open_runtime(engine=engine) as rt, rt.open_session(resume=path):
            pass


@pytest.mark.anyio
async def test_bad_tier_settings_and_paths_are_clear_errors(
    engine: LlamaEngine, tmp_path: Path
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    bad = kvrt.load_config(flags={"disk.path": str(not_a_folder / "blocks")})
    with pytest.raises(kvrt.ConfigError, match=r"disk\.path .* cannot hold cold blocks"):
        async with kvrt.open_runtime(engine=engine, config=bad):
            pass
    with pytest.raises(kvrt.ConfigError, match=r"remote\.url must be a redis://"):
        async with kvrt.open_runtime(
            engine=engine, config=kvrt.load_config(flags={"remote.url": "http://x"})
        ):
            pass
    with pytest.raises(kvrt.ConfigError, match=r"disk\.budget"):
        kvrt.load_config(flags={"disk.budget": "-1"})
    async with kvrt.open_runtime(engine=engine) as rt, rt.open_session(hot_tokens=512) as s:
        await s.ensure_context([Segment("q", "Hello")])
        with pytest.raises(kvrt.InvalidArgumentError, match="cannot write the saved session"):
            await s.save(tmp_path / "missing" / "agent.json")
        with pytest.raises(kvrt.ArgumentTypeError):
            await s.save(42)  # type: ignore[arg-type]
    with pytest.raises(kvrt.InvalidContextError, match="cannot read the saved session"):
        async with (
            kvrt.open_runtime(engine=engine) as rt,
            rt.open_session(resume=tmp_path / "none.json"),
        ):
            pass


@pytest.mark.anyio
async def test_a_prefetch_reads_disk_hits_into_ram_ahead_of_the_call(engine: LlamaEngine) -> None:
    context = [Segment("doc", DOC), Segment("q", "Who kept the logbook?")]
    async with kvrt.open_runtime(engine=engine) as rt, rt.open_session(hot_tokens=512) as s:
        await s.ensure_context(context)  # its blocks reach the disk when the session closes
    async with kvrt.open_runtime(engine=engine) as rt, rt.open_session(hot_tokens=512) as s:
        assert rt.cold_stats().entries == 0  # a new store: the blocks are on disk only
        found = await s.prefetch(context).wait()
        assert found is not None and found.cold_blocks == 3  # doc (128 + 58 tokens), question
        stats = rt.cold_stats()
        assert stats.promoted == found.cold_blocks and stats.entries == found.cold_blocks
        status = await s.ensure_context(context)
        assert status.restored_tokens == status.logical_tokens
        assert {b.choice for b in s.explain().blocks} == {"restored from cold"}  # from RAM
        assert rt.cold_stats().disk_hits == 0


@pytest.mark.anyio
async def test_what_is_not_a_regular_file_never_makes_the_tier_wait(tmp_path: Path) -> None:
    """A FIFO, a folder and a device named like block files are skipped and counted on
    open; a block file that grew (sparse, to 1 TiB) after it was indexed is refused on read
    before anything is allocated for it."""
    disk = disk_tier(str(tmp_path))
    disk.open()
    store = store_over(disk, ram_blocks=8)
    async with serving(store):
        for i in range(3):
            await store.put(block(i))
    files = block_files(tmp_path)
    assert len(files) == 3
    folder = files[0].parent
    fifo = folder / ("1" * 40 + ".kvb")
    os.mkfifo(fifo)
    (folder / ("2" * 40 + ".kvb")).mkdir()
    (folder / ("3" * 40 + ".kvb")).symlink_to("/dev/zero")
    (folder / ("4" * 40 + ".tmp")).mkdir()  # a temporary name that is a folder: left alone

    reopened = disk_tier(str(tmp_path))
    with anyio.fail_after(10):
        await anyio.to_thread.run_sync(reopened.open)
    stats = reopened.stats()
    assert stats.entries == 3 and stats.foreign == 3 and stats.corrupt == 0
    assert fifo.exists()  # not ours: left alone

    os.truncate(files[1], 2**40)  # sparse: no disk space used, 1 TiB long
    store = store_over(reopened, ram_blocks=8)
    async with serving(store):
        with anyio.fail_after(10):
            grown = next(i for i in range(3) if reopened.path_of(block(i).key) == files[1])
            assert await store.fetch(block(grown).key) is None  # refused, never allocated
            other = (grown + 1) % 3
            found = await store.fetch(block(other).key)
            assert found is not None and np.array_equal(found.entry.data, block(other).data)
    assert reopened.stats().corrupt == 1 and "promised" in (reopened.stats().last_error or "")


@pytest.mark.anyio
async def test_a_saved_session_that_is_not_a_regular_file_is_refused_at_once(
    engine: LlamaEngine, tmp_path: Path
) -> None:
    fifo = tmp_path / "agent.json"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(2**40)  # sparse
    async with kvrt.open_runtime(
        engine=engine, config=kvrt.Config(disk=kvrt.DiskConfig(budget=0))
    ) as rt:
        cases: list[tuple[str | Path, str]] = [
            (fifo, "not a regular file"),
            ("/dev/zero", "not a regular file"),
            (huge, "more than a saved session's"),
        ]
        for path, why in cases:
            with anyio.fail_after(10), pytest.raises(kvrt.InvalidContextError, match=why):
                async with rt.open_session(resume=path):
                    pass
        async with rt.open_session(hot_tokens=512) as s:
            await s.ensure_context([Segment("q", "Who kept the logbook?")])
            saved = await s.save(tmp_path / "good.json")
        raw = json.loads((tmp_path / "good.json").read_text())
        raw["segments"][0]["tokens"][1] = 2**63
        (tmp_path / "bad.json").write_text(json.dumps(raw))
        with pytest.raises(kvrt.InvalidTokenError, match=r"token id 9223372036854775808"):
            async with rt.open_session(resume=tmp_path / "bad.json"):
                pass
        assert saved.blocks
