"""The API state in one SQLite database (the default: a file beside the disk tier).

A rollback journal, every write in one transaction committed with a full sync before it
is acknowledged, several processes of one host sharing the file. (Not write-ahead
logging: its index is a file every process maps into memory, and one that cannot be
written, an immutable file or a full disk, ends the process with SIGBUS when it is
touched; a journal's failures are errors.) Every call runs in a worker thread, one at a
time (the event loop never waits on the disk). Bounds are kept per tenant
(:class:`~.records.Bounds`): responses past them go, least recently used first;
conversations past them are refused, and both expire once unused for their age.

What cannot be kept is an error, never silence: a full disk or a bound is ``full``, a
read-only or unreachable file ``unavailable``. A row that does not decode is refused as
``damaged``, naming what it holds; every other row stays readable. A deletion on a full
disk goes through: the store keeps a reserve file beside the database, given up to let a
deletion write its journal (and taken again once there is room).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec

from .records import (
    Bounds,
    ConversationHead,
    Item,
    KeptResponse,
    StateError,
    StateStats,
    decode_item,
)
from .threads import off_loop

__all__ = ["SqliteState"]

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, used REAL NOT NULL, size INTEGER NOT NULL,
    record BLOB NOT NULL, PRIMARY KEY (tenant, id));
CREATE INDEX IF NOT EXISTS responses_by_use ON responses (tenant, used);
CREATE TABLE IF NOT EXISTS conversations (
    tenant TEXT NOT NULL, id TEXT NOT NULL, created_at INTEGER NOT NULL, used REAL NOT NULL,
    metadata BLOB NOT NULL, items INTEGER NOT NULL, size INTEGER NOT NULL,
    PRIMARY KEY (tenant, id));
CREATE TABLE IF NOT EXISTS items (
    tenant TEXT NOT NULL, conversation TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL,
    item BLOB NOT NULL, PRIMARY KEY (tenant, conversation, seq));
CREATE INDEX IF NOT EXISTS items_by_id ON items (tenant, conversation, id);
"""

FULL = {"SQLITE_FULL"}
DAMAGED = {"SQLITE_CORRUPT", "SQLITE_NOTADB", "SQLITE_CORRUPT_INDEX", "SQLITE_CORRUPT_VTAB"}
RESERVE_BYTES = 1 << 20
"""The reserve kept beside the database for deletions on a full disk."""
TOUCH_AFTER = 60.0
"""Seconds after which reading a row records its use again (not on every read)."""

_encode = msgspec.msgpack.Encoder()
_response = msgspec.msgpack.Decoder(KeptResponse)
_metadata = msgspec.json.Decoder(dict[str, str])


def _encoded(items: list[Item]) -> list[bytes]:
    """Items as they are stored (in a worker thread: they may be large)."""
    return [msgspec.json.encode(item) for item in items]


def _tenant(tenant: str | None) -> str:
    return "-" if tenant is None else "+" + tenant


def _problem(exc: sqlite3.Error, where: str) -> StateError:
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name in FULL or name.startswith("SQLITE_FULL"):
        return StateError(f"the state database {where} is full: {exc}", kind="full")
    if name in DAMAGED or name.startswith("SQLITE_CORRUPT"):
        return StateError(f"the state database {where} is damaged: {exc}", kind="damaged")
    return StateError(f"the state database {where} cannot be used: {exc}", kind="unavailable")


class SqliteState:
    """Kept responses and conversations in the SQLite database at ``path`` (``:memory:``:
    in this process only). Open it with :meth:`open`."""

    def __init__(
        self,
        connection: sqlite3.Connection,
        where: str,
        bounds: Bounds,
        reserve: Path | None = None,
    ) -> None:
        self._db = connection
        self._reserve = reserve
        self._keep_reserve()
        self.where = where
        self.bounds = bounds
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)
        self.refused = self.failures = 0

    @classmethod
    async def open(
        cls, path: str, bounds: Bounds, *, max_file_bytes: int | None = None
    ) -> SqliteState:
        """The store at ``path``, created if missing; a :class:`StateError` says why one
        cannot be used (damaged, not a regular file, unwritable). ``max_file_bytes`` caps
        the database file (past it a write is ``full``), beside the per-tenant bounds."""
        return await off_loop(cls._open, path, bounds, max_file_bytes)

    @classmethod
    def _open(cls, path: str, bounds: Bounds, max_file_bytes: int | None) -> SqliteState:
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
            raise _problem(exc, path) from None
        try:
            db.execute("PRAGMA busy_timeout = 10000")
            if not memory:
                db.execute("PRAGMA journal_mode = DELETE")
                db.execute("PRAGMA synchronous = FULL")
            db.executescript(SCHEMA)
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
            raise _problem(exc, path) from None
        except BaseException:
            db.close()
            raise
        if not memory:
            os.chmod(path, 0o600)
        return cls(db, where, bounds, None if memory else Path(path + ".reserve"))

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await off_loop(self._locked, fn, *args, limiter=self._limiter)

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            try:
                return fn(*args)
            except sqlite3.Error as exc:
                problem = _problem(exc, self.where)
                self.failures += problem.kind != "damaged"
                self._rollback()
                raise problem from None

    def _write(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in one transaction, committed (synced) before it returns."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            result = fn()
            self._db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return result

    def _freeing(self, fn: Callable[[], T]) -> T:
        """A write that frees space (a deletion), run in one transaction even on a full
        disk: there, the reserve is given up and the write made again."""
        try:
            return self._write(fn)
        except sqlite3.Error as exc:
            if _problem(exc, self.where).kind != "full" or not self._give_up_reserve():
                raise
        try:
            return self._write(fn)
        finally:
            self._keep_reserve()

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
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def _touch(self, table: str, tenant: str, key: str, now: float) -> None:
        """Record a row's use, where the database can be written (a read never fails for
        want of it)."""
        with contextlib.suppress(sqlite3.Error):
            self._write(
                lambda: self._db.execute(
                    f"UPDATE {table} SET used = ? WHERE tenant = ? AND id = ?", (now, tenant, key)
                )
            )

    async def aclose(self) -> None:
        await self._run(self._db.close)

    # -- responses --

    async def keep_response(self, tenant: str | None, rid: str, kept: KeptResponse) -> None:
        """Keep ``kept`` under ``rid`` (the tenant's least recently used go past its
        bounds); a :class:`StateError` when it cannot be kept."""
        await self.keep_turn(tenant, (rid, kept), None, [])

    async def keep_turn(
        self,
        tenant: str | None,
        response: tuple[str, KeptResponse] | None,
        cid: str | None,
        items: list[Item],
    ) -> bool:
        """Keep a response and add ``items`` to conversation ``cid`` in one transaction:
        both or neither. False (nothing kept) when the conversation is unknown; a
        :class:`StateError` when either cannot be kept."""
        record = None
        if response is not None:  # a conversation of many megabytes, at times
            record = (response[0], await off_loop(_encode.encode, response[1]))
            self._check_response(len(record[1]))
        encoded = await off_loop(_encoded, items)
        return await self._run(self._keep_turn, _tenant(tenant), record, cid, items, encoded)

    def _check_response(self, size: int) -> None:
        b = self.bounds
        if size > b.response_bytes:
            raise StateError(
                f"the response takes {size:,} bytes, more than the "
                f"{b.response_bytes:,} a tenant's kept responses may",
                kind="too_large",
            )

    def _keep_turn(
        self,
        tenant: str,
        record: tuple[str, bytes] | None,
        cid: str | None,
        items: list[Item],
        encoded: list[bytes],
    ) -> bool:
        now = time.time()

        def write() -> bool:
            # The conversation is looked up inside the transaction: one deleted by another
            # process meanwhile takes nothing (no orphan item outside every bound).
            if cid is not None:
                if not self._live(tenant, cid, now):
                    return False
                if items:
                    self._append(tenant, cid, items, encoded, now)
            if record is not None:
                self._keep_record(tenant, *record, now)
            return True

        return self._write(write)

    def _keep_record(self, tenant: str, rid: str, record: bytes, now: float) -> None:
        b = self.bounds
        self._db.execute(
            "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
            (tenant, rid, now, len(record), record),
        )
        self._db.execute(
            "DELETE FROM responses WHERE tenant = ? AND used < ?", (tenant, now - b.response_age)
        )
        # Sizes are the records' own lengths and a row whose use is not a number (a
        # damaged row) goes first: no other row's content can fail this write.
        rows = self._db.execute(
            "SELECT id, length(record) FROM responses WHERE tenant = ? "
            "ORDER BY typeof(used) IN ('integer', 'real') DESC, used DESC",
            (tenant,),
        ).fetchall()
        total, drop = 0, []
        for n, (other, size) in enumerate(rows):
            total += size or 0
            if n >= b.responses or total > b.response_bytes:
                drop.append((tenant, other))
        self._db.executemany("DELETE FROM responses WHERE tenant = ? AND id = ?", drop)

    async def response(self, tenant: str | None, rid: str) -> KeptResponse | None:
        """The kept response, None when unknown or expired; ``damaged`` when its row does
        not decode."""
        return await self._run(self._response, _tenant(tenant), rid)

    def _response(self, tenant: str, rid: str) -> KeptResponse | None:
        row = self._db.execute(
            "SELECT record, used FROM responses WHERE tenant = ? AND id = ?", (tenant, rid)
        ).fetchone()
        if row is None:
            return None
        now = time.time()
        used = self._number(row[1], f"kept response {rid!r}")
        if used < now - self.bounds.response_age:
            return None
        try:
            kept = _response.decode(row[0])
        except (msgspec.DecodeError, TypeError) as exc:
            self.refused += 1
            raise StateError(
                f"kept response {rid!r} is damaged ({exc}): it cannot be continued",
                kind="damaged",
            ) from None
        if used < now - TOUCH_AFTER:
            self._touch("responses", tenant, rid, now)
        return kept

    def _number(self, value: Any, what: str) -> float:
        """A number column's value, or ``damaged`` naming the row (a row written by
        something else than this store)."""
        if isinstance(value, int | float):
            return value
        self.refused += 1
        raise StateError(f"{what} is damaged (a column holds {value!r})", kind="damaged")

    async def forget_response(self, tenant: str | None, rid: str) -> bool:
        """Delete a kept response; whether there was one."""
        return await self._run(self._forget_response, _tenant(tenant), rid)

    def _forget_response(self, tenant: str, rid: str) -> bool:
        gone = self._freeing(
            lambda: (
                self._db.execute(
                    "DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid)
                ).rowcount
            )
        )
        return bool(gone)

    # -- conversations --

    async def create_conversation(
        self, tenant: str | None, cid: str, head: ConversationHead, items: list[Item]
    ) -> None:
        """A new conversation holding ``items``; ``full`` when the tenant holds as many
        as its bound, or its items would pass the bytes bound."""
        encoded = await off_loop(_encoded, items)  # many megabytes, at times
        meta = msgspec.json.encode(head.metadata)
        await self._run(self._create, _tenant(tenant), cid, head.created_at, meta, items, encoded)

    def _create(
        self,
        tenant: str,
        cid: str,
        created_at: int,
        meta: bytes,
        items: list[Item],
        encoded: list[bytes],
    ) -> None:
        b, now = self.bounds, time.time()

        def write() -> None:
            self._expire(tenant, now)
            (count,) = self._db.execute(
                "SELECT count(*) FROM conversations WHERE tenant = ?", (tenant,)
            ).fetchone()
            if count >= b.conversations:
                raise StateError(
                    f"this tenant keeps {count} conversations, the most the server keeps: "
                    "delete some first",
                    kind="full",
                )
            self._db.execute(
                "INSERT INTO conversations VALUES (?, ?, ?, ?, ?, 0, 0)",
                (tenant, cid, created_at, now, meta),
            )
            self._append(tenant, cid, items, encoded, now)

        self._write(write)

    def _expire(self, tenant: str, now: float) -> None:
        old = self._db.execute(
            "SELECT id FROM conversations WHERE tenant = ? AND used < ?",
            (tenant, now - self.bounds.conversation_age),
        ).fetchall()
        for (cid,) in old:
            self._delete(tenant, cid)

    def _append(
        self, tenant: str, cid: str, items: list[Item], encoded: list[bytes], now: float
    ) -> None:
        size = sum(len(e) for e in encoded)
        (held,) = self._db.execute(
            "SELECT coalesce(sum(size), 0) FROM conversations WHERE tenant = ?", (tenant,)
        ).fetchone()
        if held + size > self.bounds.conversation_bytes:
            raise StateError(
                f"this tenant's conversations would take {held + size:,} bytes, more than the "
                f"server's {self.bounds.conversation_bytes:,}: delete some first",
                kind="full",
            )
        (last,) = self._db.execute(
            "SELECT coalesce(max(seq), 0) FROM items WHERE tenant = ? AND conversation = ? "
            "AND typeof(seq) = 'integer'",
            (tenant, cid),
        ).fetchone()
        self._db.executemany(
            "INSERT INTO items VALUES (?, ?, ?, ?, ?)",
            [
                (tenant, cid, last + 1 + n, str(item.get("id", "")), blob)
                for n, (item, blob) in enumerate(zip(items, encoded, strict=True))
            ],
        )
        self._db.execute(
            "UPDATE conversations SET items = items + ?, size = size + ?, used = ? "
            "WHERE tenant = ? AND id = ?",
            (len(items), size, now, tenant, cid),
        )

    async def conversation(self, tenant: str | None, cid: str) -> ConversationHead | None:
        """The conversation without its items; None when unknown or expired."""
        return await self._run(self._head, _tenant(tenant), cid)

    def _head(self, tenant: str, cid: str) -> ConversationHead | None:
        row = self._db.execute(
            "SELECT created_at, metadata, items, size, used FROM conversations "
            "WHERE tenant = ? AND id = ?",
            (tenant, cid),
        ).fetchone()
        if row is None:
            return None
        what = f"conversation {cid!r}"
        created_at, items, size, used = (self._number(row[n], what) for n in (0, 2, 3, 4))
        now = time.time()
        if used < now - self.bounds.conversation_age:
            return None
        try:
            meta = _metadata.decode(row[1])
        except (msgspec.DecodeError, TypeError):
            self.refused += 1
            meta = {}
        if used < now - TOUCH_AFTER:
            self._touch("conversations", tenant, cid, now)
        return ConversationHead(int(created_at), meta, int(items), int(size))

    def _live(self, tenant: str, cid: str, now: float) -> bool:
        """Whether the conversation is kept and unexpired (inside a write's transaction,
        so that what the write does holds only while it is)."""
        row = self._db.execute(
            "SELECT used FROM conversations WHERE tenant = ? AND id = ?", (tenant, cid)
        ).fetchone()
        if row is None:
            return False
        return self._number(row[0], f"conversation {cid!r}") >= now - self.bounds.conversation_age

    async def items(self, tenant: str | None, cid: str) -> list[Item] | None:
        """Every item, in order; None when the conversation is unknown; ``damaged`` when
        an item does not decode."""
        return await self._run(self._items, _tenant(tenant), cid)

    def _items(self, tenant: str, cid: str) -> list[Item] | None:
        if self._head(tenant, cid) is None:
            return None
        rows = self._db.execute(
            "SELECT seq, item FROM items WHERE tenant = ? AND conversation = ? ORDER BY seq",
            (tenant, cid),
        ).fetchall()
        return [self._decoded(cid, n, blob) for n, (_, blob) in enumerate(rows)]

    async def item_page(
        self, tenant: str | None, cid: str, *, limit: int, order: str, after: str | None
    ) -> tuple[list[Item], bool] | None:
        """``limit`` items after the item ``after`` in ``order`` (``asc``, ``desc``), and
        whether more follow; None when the conversation is unknown; a ``KeyError`` when
        it holds no item ``after``. Only those items are read."""
        return await self._run(self._page, _tenant(tenant), cid, limit, order, after)

    def _page(
        self, tenant: str, cid: str, limit: int, order: str, after: str | None
    ) -> tuple[list[Item], bool] | None:
        if self._head(tenant, cid) is None:
            return None
        asc = order == "asc"
        bound = -1 if asc else 1 << 62
        if after is not None:
            row = self._db.execute(
                "SELECT seq FROM items WHERE tenant = ? AND conversation = ? AND id = ?",
                (tenant, cid, after),
            ).fetchone()
            if row is None:
                raise KeyError(after)
            bound = row[0]
        rows = self._db.execute(
            "SELECT seq, item FROM items WHERE tenant = ? AND conversation = ? AND "
            + ("seq > ? ORDER BY seq ASC" if asc else "seq < ? ORDER BY seq DESC")
            + " LIMIT ?",
            (tenant, cid, bound, limit + 1),
        ).fetchall()
        found = [self._decoded(cid, seq, blob) for seq, blob in rows[:limit]]
        return found, len(rows) > limit

    async def item(self, tenant: str | None, cid: str, iid: str) -> Item | None:
        """Item ``iid`` (that one alone read); None when the conversation is unknown; a
        ``KeyError`` when it holds no such item."""
        return await self._run(self._item, _tenant(tenant), cid, iid)

    def _item(self, tenant: str, cid: str, iid: str) -> Item | None:
        if self._head(tenant, cid) is None:
            return None
        row = self._db.execute(
            "SELECT seq, item FROM items WHERE tenant = ? AND conversation = ? AND id = ? "
            "ORDER BY seq LIMIT 1",
            (tenant, cid, iid),
        ).fetchone()
        if row is None:
            raise KeyError(iid)
        return self._decoded(cid, row[0], row[1])

    def _decoded(self, cid: str, n: int, blob: Any) -> Item:
        try:
            return decode_item(cid, n, blob)
        except StateError:
            self.refused += 1
            raise

    async def add_items(self, tenant: str | None, cid: str, items: list[Item]) -> bool:
        """Append ``items``; False when the conversation is unknown."""
        return await self.keep_turn(tenant, None, cid, items)

    async def set_metadata(self, tenant: str | None, cid: str, metadata: dict[str, str]) -> bool:
        """Replace the conversation's metadata; False when it is unknown."""
        meta = msgspec.json.encode(metadata)
        return await self._run(self._set_metadata, _tenant(tenant), cid, meta)

    def _set_metadata(self, tenant: str, cid: str, meta: bytes) -> bool:
        now = time.time()

        def write() -> bool:
            if not self._live(tenant, cid, now):
                return False
            self._db.execute(
                "UPDATE conversations SET metadata = ?, used = ? WHERE tenant = ? AND id = ?",
                (meta, now, tenant, cid),
            )
            return True

        return self._write(write)

    async def remove_item(self, tenant: str | None, cid: str, iid: str) -> bool | None:
        """Remove one item; False when the conversation has none of that id, None when the
        conversation is unknown."""
        return await self._run(self._remove_item, _tenant(tenant), cid, iid)

    def _remove_item(self, tenant: str, cid: str, iid: str) -> bool | None:
        now = time.time()

        def write() -> bool | None:
            if not self._live(tenant, cid, now):
                return None
            row = self._db.execute(
                "SELECT seq, length(item) FROM items WHERE tenant = ? AND conversation = ? "
                "AND id = ? ORDER BY seq LIMIT 1",
                (tenant, cid, iid),
            ).fetchone()
            if row is None:
                return False
            self._db.execute(
                "DELETE FROM items WHERE tenant = ? AND conversation = ? AND seq = ?",
                (tenant, cid, row[0]),
            )
            self._db.execute(
                "UPDATE conversations SET items = items - 1, size = size - ?, used = ? "
                "WHERE tenant = ? AND id = ?",
                (row[1] or 0, now, tenant, cid),
            )
            return True

        return self._freeing(write)

    async def delete_conversation(self, tenant: str | None, cid: str) -> bool:
        """Delete a conversation and its items; whether there was one."""
        return await self._run(self._delete_conversation, _tenant(tenant), cid)

    def _delete_conversation(self, tenant: str, cid: str) -> bool:
        return self._freeing(lambda: self._delete(tenant, cid))

    def _delete(self, tenant: str, cid: str) -> bool:
        self._db.execute("DELETE FROM items WHERE tenant = ? AND conversation = ?", (tenant, cid))
        return bool(
            self._db.execute(
                "DELETE FROM conversations WHERE tenant = ? AND id = ?", (tenant, cid)
            ).rowcount
        )

    async def stats(self) -> StateStats:
        return await self._run(self._stats)

    def _stats(self) -> StateStats:
        responses = self._db.execute(
            "SELECT count(*), coalesce(sum(size), 0) FROM responses"
        ).fetchone()
        conversations = self._db.execute(
            "SELECT count(*), coalesce(sum(size), 0) FROM conversations"
        ).fetchone()
        return StateStats(
            where=self.where,
            responses=int(responses[0]),
            response_bytes=int(responses[1]),
            conversations=int(conversations[0]),
            conversation_bytes=int(conversations[1]),
            refused=self.refused,
            failures=self.failures,
        )
