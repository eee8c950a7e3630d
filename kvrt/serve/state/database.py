"""The SQLite file the API state lives in: opened checked, used from one worker thread at
a time (the event loop never waits on the disk), every write one transaction committed
with a full sync before it is acknowledged, several processes of one host sharing the
file. A rollback journal, not write-ahead logging: its index is a file every process maps
into memory, and one that cannot be written (an immutable file, a full disk) ends the
process with SIGBUS when it is touched; a journal's failures are errors, each a
:class:`StateError` of its kind. A deletion on a full disk goes through: a reserve file
kept beside the database is given up to let it write its journal (and taken again once
there is room).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, TypeVarTuple

import anyio

from .records import StateError
from .threads import off_loop

__all__ = ["Database"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

FULL = {"SQLITE_FULL"}
DAMAGED = {"SQLITE_CORRUPT", "SQLITE_NOTADB", "SQLITE_CORRUPT_INDEX", "SQLITE_CORRUPT_VTAB"}
RESERVE_BYTES = 1 << 20
"""The reserve kept beside the database for deletions on a full disk."""


def problem(exc: sqlite3.Error, where: str) -> StateError:
    """``exc`` as the store's error: ``full``, ``damaged`` or ``unavailable``."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name in FULL or name.startswith("SQLITE_FULL"):
        return StateError(f"the state database {where} is full: {exc}", kind="full")
    if name in DAMAGED or name.startswith("SQLITE_CORRUPT"):
        return StateError(f"the state database {where} is damaged: {exc}", kind="damaged")
    return StateError(f"the state database {where} cannot be used: {exc}", kind="unavailable")


class Database:
    """One SQLite database (``:memory:``: in this process only), open. Open it with
    :meth:`open`; ``connection`` is what statements run on, inside :meth:`run`."""

    def __init__(self, connection: sqlite3.Connection, where: str, reserve: Path | None) -> None:
        self.connection = connection
        self.where = where
        self.failures = 0
        """Statements that failed for want of the disk (full, read-only, unreachable)."""
        self._reserve = reserve
        self._keep_reserve()
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)

    @classmethod
    def open(cls, path: str, schema: str, max_file_bytes: int | None) -> Database:
        """The database at ``path`` with ``schema``, created if missing (call it in a
        worker thread); a :class:`StateError` says why one cannot be used (damaged, not a
        regular file, unwritable). ``max_file_bytes`` caps the file (past it a write is
        ``full``)."""
        where = f"sqlite:{path}"
        memory = path == ":memory:"
        if not memory:
            file = Path(path).expanduser()
            try:
                file.parent.mkdir(parents=True, exist_ok=True)
                mode = file.stat().st_mode if file.exists() else None
            except OSError as exc:
                raise StateError(
                    f"the state database {path} cannot be used: {exc.strerror or exc}",
                    kind="unavailable",
                ) from None
            if mode is not None and not stat.S_ISREG(mode):
                raise StateError(
                    f"the state database {path} is not a regular file", kind="unavailable"
                )
            path = str(file)
        try:
            db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise problem(exc, path) from None
        try:
            db.execute("PRAGMA busy_timeout = 10000")
            if not memory:
                db.execute("PRAGMA journal_mode = DELETE")
                db.execute("PRAGMA synchronous = FULL")
            db.executescript(schema)
            if max_file_bytes is not None:
                (page,) = db.execute("PRAGMA page_size").fetchone()
                db.execute(f"PRAGMA max_page_count = {max(1, max_file_bytes // page)}")
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise StateError(
                    f"the state database {path} is damaged ({check[0] if check else 'no answer'}):"
                    " move it away, or give another (--state)",
                    kind="damaged",
                )
        except sqlite3.Error as exc:
            db.close()
            raise problem(exc, path) from None
        except BaseException:
            db.close()
            raise
        if not memory:
            os.chmod(path, 0o600)
        return cls(db, where, None if memory else Path(path + ".reserve"))

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """``fn(*args)`` in a worker thread, alone on the database; what SQLite raises is
        the store's error (the transaction under way undone)."""
        return await off_loop(self._locked, fn, *args, limiter=self._limiter)

    def _locked(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        with self._lock:
            try:
                return fn(*args)
            except sqlite3.Error as exc:
                refused = problem(exc, self.where)
                self.failures += refused.kind != "damaged"
                self._rollback()
                raise refused from None

    def write(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in one transaction, committed (synced) before it returns."""
        self.connection.execute("BEGIN IMMEDIATE")
        try:
            result = fn()
            self.connection.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return result

    def freeing(self, fn: Callable[[], T]) -> T:
        """A write that frees space (a deletion), run in one transaction even on a full
        disk: there, the reserve is given up and the write made again."""
        try:
            return self.write(fn)
        except sqlite3.Error as exc:
            if problem(exc, self.where).kind != "full" or not self._give_up_reserve():
                raise
        try:
            return self.write(fn)
        finally:
            self._keep_reserve()

    def touch(self, table: str, tenant: str, key: str, now: float) -> None:
        """Record a row's use, where the database can be written (a read never fails for
        want of it)."""
        with contextlib.suppress(sqlite3.Error):
            self.write(
                lambda: self.connection.execute(
                    f"UPDATE {table} SET used = ? WHERE tenant = ? AND id = ?", (now, tenant, key)
                )
            )

    async def aclose(self) -> None:
        await self.run(self.connection.close)

    def _give_up_reserve(self) -> bool:
        if self._reserve is None:
            return False
        try:
            self._reserve.unlink()
        except OSError:
            return False
        return True

    def _keep_reserve(self) -> None:
        """Take the reserve again where there is room (a disk that has none goes on
        without it)."""
        if self._reserve is None or self._reserve.exists():
            return
        try:
            with self._reserve.open("wb") as file:
                file.truncate(RESERVE_BYTES)
                os.posix_fallocate(file.fileno(), 0, RESERVE_BYTES)
        except OSError:
            with contextlib.suppress(OSError):
                self._reserve.unlink()

    def _rollback(self) -> None:
        """Undo the transaction under way, if SQLite has not already (it does on a full
        disk)."""
        if self.connection.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self.connection.execute("ROLLBACK")
