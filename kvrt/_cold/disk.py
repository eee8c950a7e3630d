"""The disk tier: cold blocks as files under ``disk.path``, surviving restarts and crashes.

One file per block, named by its key's digest (``<path>/v1/<fingerprint>/<ab>/<digest>.kvb``,
in the :mod:`~kvrt._cold.blockfile` format). A file is written under a temporary name,
fsynced, linked into place and its directory fsynced: a crash leaves a complete block or
none. Names are write-once: a second writer of the same key (another process sharing the
path) finds the file in place and keeps it, so processes share a path without locks and
never see each other's half-written files. Temporary files of processes that no longer run
are removed when the tier opens.

On open the index is rebuilt from the files' headers; a truncated, damaged or unreadable
``.kvb`` file is counted and removed (other files in the folder are left alone, and so is
anything named ``.kvb`` that is not a regular file — a folder, a FIFO, a device — counted
in ``foreign``). Files are opened non-blocking and checked to be regular before a byte is
read, so nothing in the folder can make a read wait. Every read checks the file's size
against the index (what its header promised) before allocating, then the whole block
(checksum, lengths, key) before it is used: a block that fails is removed and counted,
never handed to an engine.

The file work is synchronous and runs in worker threads (``anyio.to_thread``); the index
is only touched on the event loop.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import msgspec
import numpy as np

from .._types import CacheClass, ColdEntryView
from .._util import cache_home
from . import blockfile
from .entry import ColdEntry, ColdKey

__all__ = ["DEFAULT_DISK_FRACTION", "BlockIO", "DiskStats", "DiskTier", "disk_location"]

SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
DEFAULT_DISK_FRACTION = 0.10
"""Share of the free space where ``disk.path`` lives that the tier takes by default."""


def default_disk_path(env: Mapping[str, str] | None = None) -> Path:
    """``$KVRT_CACHE_DIR/blocks``, else ``$XDG_CACHE_HOME/kvrt/blocks``, else
    ``~/.cache/kvrt/blocks``."""
    return cache_home(env) / "blocks"


def disk_location(path: str | None, budget: int | None) -> tuple[Path, int]:
    """The disk tier's folder and budget: ``budget`` if given, else a share of the free
    space of the file system ``path`` lives on (0 when that cannot be read)."""
    folder = Path(path).expanduser() if path else default_disk_path()
    if budget is not None:
        return folder, budget
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return folder, 0
    return folder, int(free * DEFAULT_DISK_FRACTION)


class DiskStats(msgspec.Struct, frozen=True, kw_only=True):
    """The disk tier's figures."""

    path: str
    """The folder holding this model's blocks."""
    entries: int
    """Blocks on disk (this process's index)."""
    bytes: int
    """Bytes of those files."""
    budget_bytes: int
    """The tier's budget; ``bytes`` stays within it."""
    hits: int
    """Blocks read back and verified."""
    writes: int
    """Blocks written (committed: fsynced and in place)."""
    write_failures: int
    """Writes that failed (no space, an I/O error, a short write): the block stayed in RAM."""
    lost: int
    """Blocks that left RAM with no disk copy (their write failed, or the disk budget
    dropped it): kept as tokens only."""
    corrupt: int
    """Damaged or truncated files found (on open or on read): removed, never served."""
    removed: int
    """Files deleted to stay within the budget (the cold-victim policy's choice)."""
    opened_with: int
    """Blocks found on disk when the tier opened (written by earlier processes)."""
    foreign: int = 0
    """Entries named like block files that are not regular files (folders, FIFOs,
    devices): skipped, left alone."""
    last_error: str | None
    """The most recent failure, if any."""


class BlockIO:
    """The system calls a block write goes through (a test may replace them)."""

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)


@dataclass(slots=True)
class _Record:
    id: int
    path: Path
    size: int
    cache_class: CacheClass
    last_used: int


MAX_HEADER_BYTES = 16 * 2**20
"""A block's header holds its token ids: far below this for any block kvrt writes."""


class NotRegularError(OSError):
    """Something named like a block file that is not a regular file."""


def _open_regular(path: Path) -> io.FileIO:
    """``path`` opened for reading, unbuffered, without blocking (a FIFO opens at once),
    checked to be a regular file before anything is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularError(f"{path.name} is not a regular file")
        os.set_blocking(fd, True)
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier:
    """Blocks of one model under ``root``, within ``budget_bytes``: a
    :class:`~kvrt._cold.tier.ColdTier`."""

    name: Final = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        budget_bytes: int,
        fingerprint: str,
        order: Callable[[Sequence[ColdEntryView]], list[int]],
        *,
        io: BlockIO | None = None,
    ) -> None:
        self.root = Path(root)
        self.folder = self.root / f"v{blockfile.VERSION}" / fingerprint
        self.budget_bytes = budget_bytes
        self._order = order
        self._io = io or BlockIO()
        self._index: dict[ColdKey, _Record] = {}
        self._bytes = 0
        self._clock = 0
        self._next_id = 0
        self._limiter = anyio.CapacityLimiter(2)
        self.hits = self.writes = self.write_failures = self.lost = 0
        self.corrupt = self.removed = self.opened_with = self.foreign = 0
        self.last_error: str | None = None

    # -- opening (synchronous: before the store serves) --

    def open(self) -> None:
        """Create the folder, clear dead writers' temporary files and index the blocks."""
        self.folder.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, ColdKey, _Record]] = []
        for path in self.folder.glob("*/*"):
            if path.name.endswith(TEMP_SUFFIX):
                self._clear_temp(path)
            elif path.suffix == SUFFIX:
                scanned = self._scan(path)
                if scanned is not None:
                    found.append(scanned)
        for _mtime, key, record in sorted(found, key=lambda f: f[0]):
            self._clock += 1
            record.last_used = self._clock
            self._index[key] = record
            self._bytes += record.size
        self.opened_with = len(self._index)
        for path in self._over_budget(0):
            self._unlink(path)

    def _clear_temp(self, path: Path) -> None:
        parts = path.name.split(".")
        pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
        if pid is None or not _pid_alive(pid):
            self._unlink(path)

    def _scan(self, path: Path) -> tuple[float, ColdKey, _Record] | None:
        """The key and record of one block file from its header, or None (removed, or
        not a regular file and left alone)."""
        try:
            with _open_regular(path) as f:
                st = os.fstat(f.fileno())
                size, mtime = st.st_size, st.st_mtime
                head = f.read(blockfile.PREFIX.size)
                header_len, payload_len = blockfile.read_prefix(head)
                if size != blockfile.PREFIX.size + header_len + payload_len:
                    raise blockfile.CorruptBlockError(f"{size} bytes, truncated or padded")
                if header_len > MAX_HEADER_BYTES:
                    raise blockfile.CorruptBlockError(f"a {header_len}-byte header")
                header = blockfile.read_block_header(f.read(header_len))
        except FileNotFoundError:
            return None  # removed by another process meanwhile
        except NotRegularError:
            self.foreign += 1
            return None
        except (OSError, blockfile.CorruptBlockError) as exc:
            self._damaged(path, exc)
            return None
        key = ColdKey(header.fingerprint, header.prefix, header.tokens_digest, header.start)
        if path.stem != key.digest():
            self._damaged(path, blockfile.CorruptBlockError("file name does not match its key"))
            return None
        self._next_id += 1
        return mtime, key, _Record(self._next_id, path, size, CacheClass(header.cache_class), 0)

    def _damaged(self, path: Path, exc: BaseException) -> None:
        self.corrupt += 1
        self.last_error = f"{path.name}: {exc}"
        self._unlink(path)

    # -- index (event loop) --

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def close(self) -> None:
        """Nothing held open: every file is closed after its transfer."""

    def size(self, key: ColdKey) -> int | None:
        record = self._index.get(key)
        return record.size if record is not None else None

    def stats(self) -> DiskStats:
        return DiskStats(
            path=str(self.folder),
            entries=len(self._index),
            bytes=self._bytes,
            budget_bytes=self.budget_bytes,
            hits=self.hits,
            writes=self.writes,
            write_failures=self.write_failures,
            lost=self.lost,
            corrupt=self.corrupt,
            removed=self.removed,
            opened_with=self.opened_with,
            foreign=self.foreign,
            last_error=self.last_error,
        )

    def path_of(self, key: ColdKey) -> Path:
        digest = key.digest()
        return self.folder / digest[:2] / f"{digest}{SUFFIX}"

    def _over_budget(self, need: int) -> list[Path]:
        """Drop records by the victim policy until ``need`` more bytes fit; their paths."""
        if self._bytes + need <= self.budget_bytes:
            return []
        by_id = {r.id: k for k, r in self._index.items()}
        views = [
            ColdEntryView(id=r.id, cache_class=r.cache_class, n_bytes=r.size, last_used=r.last_used)
            for r in self._index.values()
        ]
        paths = []
        for victim in self._order(views):
            if self._bytes + need <= self.budget_bytes:
                break
            key = by_id.get(victim)
            if key is None or key not in self._index:
                continue
            record = self._index.pop(key)
            self._bytes -= record.size
            self.removed += 1
            paths.append(record.path)
        return paths

    def _forget(self, key: ColdKey) -> None:
        record = self._index.pop(key, None)
        if record is not None:
            self._bytes -= record.size

    # -- transfers (async; the file work in threads) --

    async def discover(self, keys: Sequence[ColdKey]) -> int:
        """Nothing to learn: the index is this process's view of the folder."""
        return 0

    def left_ram(self, key: ColdKey) -> None:
        if not key.session_local:
            self.lost += 1

    async def write(self, entry: ColdEntry) -> bool:
        """Write ``entry``'s block; True once it is on disk. False, counted, when it is
        too large for the budget or the write fails (no space, I/O error, short write)."""
        if entry.key in self._index:
            return True
        head, payload = blockfile.encode(entry)
        size = len(head) + payload.nbytes
        if size > self.budget_bytes:
            return False
        try:
            await anyio.to_thread.run_sync(
                self._write_file, self.path_of(entry.key), head, payload, limiter=self._limiter
            )
        except OSError as exc:
            self.write_failures += 1
            self.last_error = f"writing a block: {exc.strerror or exc}"
            return False
        if entry.key in self._index:  # raced with a promotion's re-index
            return True
        victims = self._over_budget(size)
        self._next_id += 1
        self._clock += 1
        self._index[entry.key] = _Record(
            self._next_id, self.path_of(entry.key), size, entry.cache_class, self._clock
        )
        self._bytes += size
        self.writes += 1
        if victims:
            await anyio.to_thread.run_sync(self._unlink_all, victims, limiter=self._limiter)
        return True

    async def discard(self, key: ColdKey) -> None:
        """Remove the block under ``key`` (the engine rejected its bytes), counted."""
        record = self._index.get(key)
        if record is None:
            return
        self._forget(key)  # counted by the store (rejected)
        self.last_error = f"{record.path.name}: the engine rejected its KV bytes"
        await anyio.to_thread.run_sync(self._unlink, record.path, limiter=self._limiter)

    async def read(self, key: ColdKey) -> ColdEntry | None:
        """The verified block under ``key``; None if it is gone or fails a check (then
        removed and counted)."""
        record = self._index.get(key)
        if record is None:
            return None
        self._clock += 1
        record.last_used = self._clock
        try:
            entry = await anyio.to_thread.run_sync(
                self._read_file, record.path, key, record.size, limiter=self._limiter
            )
        except FileNotFoundError:
            self._forget(key)  # removed by another process sharing the path
            return None
        except blockfile.CorruptBlockError as exc:
            self._forget(key)
            self.corrupt += 1
            self.last_error = f"{record.path.name}: {exc}"
            await anyio.to_thread.run_sync(self._unlink, record.path, limiter=self._limiter)
            return None
        except (OSError, NotRegularError) as exc:  # unreadable now: not served, left alone
            self._forget(key)
            self.last_error = f"reading {record.path.name}: {exc.strerror or exc}"
            return None
        self.hits += 1
        return entry

    # -- file work (worker threads) --

    def _write_file(self, path: Path, head: bytes, payload: memoryview) -> None:
        if path.exists():
            return  # write-once: another writer put the same block in place
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                for part in (memoryview(head), payload):
                    done = 0
                    while done < part.nbytes:
                        n = self._io.write(fd, part[done:])
                        if n <= 0:
                            raise OSError(5, "short write: the file system took no bytes")
                        done += n
                expected = len(head) + payload.nbytes
                if os.fstat(fd).st_size != expected:
                    raise OSError(5, f"short write: {os.fstat(fd).st_size} of {expected} bytes")
                self._io.fsync(fd)
            finally:
                os.close(fd)
            with contextlib.suppress(FileExistsError):
                os.link(temp, path)
            self._sync_folder(path.parent)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)

    @staticmethod
    def _sync_folder(folder: Path) -> None:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _read_file(path: Path, key: ColdKey, expected: int) -> ColdEntry:
        with _open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size != expected:  # grown or cut since it was indexed: never allocated
                raise blockfile.CorruptBlockError(
                    f"{size} bytes where its header promised {expected}"
                )
            buf = np.empty(size, dtype=np.uint8)
            view = buf.data
            done = 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    break
                done += n
        if done != size:
            raise blockfile.CorruptBlockError(f"read {done} of {size} bytes")
        return blockfile.decode(buf, expect=key)

    @staticmethod
    def _unlink(path: Path) -> None:
        # Gone already, a folder, or not ours to remove: left where it is.
        with contextlib.suppress(OSError):
            path.unlink()

    @classmethod
    def _unlink_all(cls, paths: Sequence[Path]) -> None:
        for path in paths:
            cls._unlink(path)
