"""The API state in one SQLite database (the default: a file beside the disk tier), its
file kept by :mod:`.database` (a rollback journal, synced transactions, a reserve for
deletions on a full disk). Bounds are kept per tenant (:class:`~.records.Bounds`):
responses past them go, least recently used first; conversations past them are refused,
and both expire once unused for their age.

What cannot be kept is an error, never silence: a full disk or a bound is ``full``, a
read-only or unreachable file ``unavailable``. A row that does not decode is refused as
``damaged``, naming what it holds; every other row stays readable.
"""

from __future__ import annotations

import time

import msgspec

from .database import Database
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


class SqliteState:
    """Kept responses and conversations in the SQLite database at ``path`` (``:memory:``:
    in this process only). Open it with :meth:`open`."""

    def __init__(self, database: Database, bounds: Bounds) -> None:
        self._file = database
        self._db = database.connection
        self.where = database.where
        self.bounds = bounds
        self.refused = 0

    @classmethod
    async def open(
        cls, path: str, bounds: Bounds, *, max_file_bytes: int | None = None
    ) -> SqliteState:
        """The store at ``path``, created if missing; a :class:`StateError` says why one
        cannot be used (damaged, not a regular file, unwritable). ``max_file_bytes`` caps
        the database file (past it a write is ``full``), beside the per-tenant bounds."""
        return cls(await off_loop(Database.open, path, SCHEMA, max_file_bytes), bounds)

    @property
    def failures(self) -> int:
        """Writes the database could not make."""
        return self._file.failures

    async def aclose(self) -> None:
        await self._file.aclose()

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
        return await self._file.run(self._keep_turn, _tenant(tenant), record, cid, items, encoded)

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

        return self._file.write(write)

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
        return await self._file.run(self._response, _tenant(tenant), rid)

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
            self._file.touch("responses", tenant, rid, now)
        return kept

    def _number(self, value: object, what: str) -> float:
        """A number column's value, or ``damaged`` naming the row (a row written by
        something else than this store)."""
        if isinstance(value, int | float):
            return value
        self.refused += 1
        raise StateError(f"{what} is damaged (a column holds {value!r})", kind="damaged")

    async def forget_response(self, tenant: str | None, rid: str) -> bool:
        """Delete a kept response; whether there was one."""
        return await self._file.run(self._forget_response, _tenant(tenant), rid)

    def _forget_response(self, tenant: str, rid: str) -> bool:
        gone = self._file.freeing(
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
        await self._file.run(
            self._create, _tenant(tenant), cid, head.created_at, meta, items, encoded
        )

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

        self._file.write(write)

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
        return await self._file.run(self._head, _tenant(tenant), cid)

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
            self._file.touch("conversations", tenant, cid, now)
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
        return await self._file.run(self._items, _tenant(tenant), cid)

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
        return await self._file.run(self._page, _tenant(tenant), cid, limit, order, after)

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
        return await self._file.run(self._item, _tenant(tenant), cid, iid)

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

    def _decoded(self, cid: str, n: int, blob: bytes) -> Item:
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
        return await self._file.run(self._set_metadata, _tenant(tenant), cid, meta)

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

        return self._file.write(write)

    async def remove_item(self, tenant: str | None, cid: str, iid: str) -> bool | None:
        """Remove one item; False when the conversation has none of that id, None when the
        conversation is unknown."""
        return await self._file.run(self._remove_item, _tenant(tenant), cid, iid)

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

        return self._file.freeing(write)

    async def delete_conversation(self, tenant: str | None, cid: str) -> bool:
        """Delete a conversation and its items; whether there was one."""
        return await self._file.run(self._delete_conversation, _tenant(tenant), cid)

    def _delete_conversation(self, tenant: str, cid: str) -> bool:
        return self._file.freeing(lambda: self._delete(tenant, cid))

    def _delete(self, tenant: str, cid: str) -> bool:
        self._db.execute("DELETE FROM items WHERE tenant = ? AND conversation = ?", (tenant, cid))
        return bool(
            self._db.execute(
                "DELETE FROM conversations WHERE tenant = ? AND id = ?", (tenant, cid)
            ).rowcount
        )

    async def stats(self) -> StateStats:
        return await self._file.run(self._stats)

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
