"""The API state on the replicas' shared Redis/Valkey server (``remote.url``), so every
replica reads the responses and conversations any of them kept.

Values are signed with the replicas' secret like blocks (:class:`kvrt.SharedStore`):
a kept response, a conversation's head and each item carry a tag over their name (an
item's name holds its place in the conversation), so a value altered, moved or written
without the secret is refused. Bounds are kept per tenant with an index of what each
tenant holds (a sorted set by last use, and sizes); values expire with their age.

Every write that depends on what is there runs in one optimistic transaction (``WATCH``
the keys it read, ``MULTI``/``EXEC`` its writes, again if another client changed them
meanwhile): an item added while its conversation is deleted lands before the deletion or
not at all, and a tenant's recorded bytes are what its conversations hold.

Reads are bounded: an item's length is asked before it is read (one past the largest
request is refused unread and deleted), a page of items reads that page alone, and a
conversation holding more items than its head counts is refused.

A deleted conversation or response leaves a signed tombstone for its age, and each
replica remembers the latest version of the heads it has seen: an old value written back
under its own name (a replay) is gone again where its tombstone is, and refused where a
replica saw a later version (docs/cold-tiers.md says what a replay can still do).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

import kvrt

from ..protocol.errors import MAX_BODY
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

__all__ = ["SharedState"]

T = TypeVar("T")
Client = Any
"""redis-py's client, in a worker thread (its pipelines' typing is too loose to follow)."""

_encode = msgspec.msgpack.Encoder()
_response = msgspec.msgpack.Decoder(KeptResponse)
_head = msgspec.msgpack.Decoder(list[Any])


MAX_HEAD = 64 * 1024
"""The largest conversation head read (its metadata is at most 16 keys of 64 characters
and values of 512)."""
MAX_ITEM = MAX_BODY
"""The largest item read back: no request can have added a larger one."""
REMEMBERED = 65536
"""Heads and deletions each replica remembers (to refuse what is replayed)."""


def _tenant(tenant: str | None) -> bytes:
    return b"-" if tenant is None else b"+" + tenant.encode()


def _count(value: Any) -> int:
    """A count the server holds (a size, a sequence number); 0 for what this store never
    writes there (a foreign value)."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


def _seq(field: Any) -> int | None:
    """An item's place from its field name; None for a field this store never wrote."""
    try:
        text = bytes(field).decode("ascii")
    except (TypeError, UnicodeDecodeError):
        return None
    return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None


class _Head(msgspec.Struct, frozen=True):
    """A conversation's head as stored: what it was created with, its metadata, the
    version every change raises, and how many items it holds."""

    created_at: int
    metadata: dict[str, str]
    version: int = 0
    items: int | None = None
    """None in a head written before the count was kept: then unchecked."""

    def encode(self) -> bytes:
        return _encode.encode((self.created_at, self.metadata, self.version, self.items))


def _decode_head(cid: str, value: bytes) -> _Head:
    try:
        got = _head.decode(value)
        created_at, metadata = got[0], got[1]
        version, items = (got[2], got[3]) if len(got) == 4 else (0, None)
        checked = msgspec.convert(
            {"created_at": created_at, "metadata": metadata, "version": version, "items": items},
            _Head,
        )
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError, TypeError) as exc:
        raise StateError(f"conversation {cid!r} is damaged ({exc})", kind="damaged") from None
    return checked


class SharedState:
    """Kept responses and conversations on the remote server behind ``shared``."""

    def __init__(self, shared: kvrt.SharedStore, bounds: Bounds) -> None:
        self.shared = shared
        self.bounds = bounds
        self.where = "remote (shared by the replicas)"
        self.refused = self.failures = 0
        self._versions: OrderedDict[str, int] = OrderedDict()
        """The latest head version this replica saw of each conversation."""
        self._gone: OrderedDict[str, None] = OrderedDict()
        """Conversations and responses this replica deleted (by name)."""

    # -- names --

    def _name(self, kind: str, tenant: str | None, key: str = "") -> str:
        return self.shared.name(kind, _tenant(tenant) + b"\0" + key.encode())

    async def _run(self, what: str, fn: Callable[[Client], T]) -> T:
        """``fn(client)`` on the server; ``unavailable`` when it cannot be reached."""
        if not self.shared.up:
            self.failures += 1
            raise StateError(
                "the shared state server is down: try again shortly", kind="unavailable"
            )
        done = await self.shared.run(what, lambda client: [fn(client)])
        if done is None:
            self.failures += 1
            raise StateError(
                f"the shared state server could not be used ({what}): try again shortly",
                kind="unavailable",
            )
        return done[0]

    def _open(self, name: str, stored: Any) -> bytes:
        try:
            return self.shared.open(name, bytes(stored))
        except kvrt.SharedValueError:
            self.refused += 1
            raise StateError(
                f"a kept value ({name}) fails its check: written without the replicas' secret "
                "or altered; it is not used",
                kind="damaged",
            ) from None

    async def _get(self, kind: str, tenant: str | None, key: str, max_bytes: int) -> bytes | None:
        """A kept value, bounded and checked (a refused one is ``damaged``)."""
        ident = _tenant(tenant) + b"\0" + key.encode()
        if not self.shared.up:
            self.failures += 1
            raise StateError(
                "the shared state server is down: try again shortly", kind="unavailable"
            )
        try:
            return await self.shared.get(kind, ident, max_bytes=max_bytes)
        except kvrt.SharedValueError as exc:
            self.refused += 1
            raise StateError(
                f"a kept value fails its check ({exc}): written without the replicas' secret, "
                "altered or too large; it is not used",
                kind="damaged",
            ) from None

    def _remember(self, book: OrderedDict[Any, Any], key: Any, value: Any = None) -> None:
        book[key] = value
        book.move_to_end(key)
        while len(book) > REMEMBERED:
            book.popitem(last=False)

    def _tombstone(self, name: str) -> tuple[str, bytes]:
        """A deleted value's tombstone: its name and sealed content."""
        gone = name + ":gone"
        return gone, self.shared.seal(gone, b"gone")

    def _buried(self, name: str, tomb: Any, deleted: bool) -> bool:
        """Whether a value read under ``name`` is one deleted before: ``tomb`` (read
        with it) is its true tombstone, or this replica had deleted it before the read
        began (``deleted``)."""
        if deleted:
            return True
        if not tomb:
            return False
        try:
            return self.shared.open(name + ":gone", bytes(tomb)) == b"gone"
        except kvrt.SharedValueError:
            return False

    def _replayed(self, name: str) -> StateError:
        self.refused += 1
        return StateError(
            f"a kept value ({name}) was changed since: an earlier value written back "
            "without the replicas' secret is not used",
            kind="damaged",
        )

    async def aclose(self) -> None:
        """Nothing to close: the runtime owns the connection."""

    # -- responses --

    async def keep_response(self, tenant: str | None, rid: str, kept: KeptResponse) -> None:
        await self.keep_turn(tenant, (rid, kept), None, [])

    def _check_response(self, record: bytes) -> None:
        b = self.bounds
        if len(record) > b.response_bytes:
            raise StateError(
                f"the response takes {len(record):,} bytes, more than the "
                f"{b.response_bytes:,} a tenant's kept responses may",
                kind="too_large",
            )

    def _trim_responses(self, client: Client, tenant: str | None) -> None:
        """The tenant's least recently used responses past its bounds go."""
        b = self.bounds
        index, sizes = self._name("responses", tenant), self._name("response-sizes", tenant)
        held = [i.decode(errors="replace") for i in client.zrevrange(index, 0, -1)]
        sized = client.hmget(sizes, held) if held else []
        total, drop = 0, []
        for n, (other, size) in enumerate(zip(held, sized, strict=True)):
            total += _count(size)
            if n >= b.responses or total > b.response_bytes:
                drop.append(other)
        if drop:
            pipe = client.pipeline(transaction=True)
            pipe.delete(*(self._name("response", tenant, d) for d in drop))
            pipe.zrem(index, *drop)
            pipe.hdel(sizes, *drop)
            pipe.execute()

    async def response(self, tenant: str | None, rid: str) -> KeptResponse | None:
        name = self._name("response", tenant, rid)
        deleted = name in self._gone
        value = await self._get("response", tenant, rid, self.bounds.response_bytes)
        if value is None:
            return None
        tomb = await self._run("reading a response", lambda c: c.get(name + ":gone"))
        if self._buried(name, tomb, deleted):  # deleted, then written back: gone again
            self.refused += 1
            await self._run("deleting a replayed response", lambda c: c.delete(name))
            return None
        try:
            kept = _response.decode(value)
        except (msgspec.DecodeError, TypeError) as exc:
            self.refused += 1
            raise StateError(
                f"kept response {rid!r} is damaged ({exc}): it cannot be continued",
                kind="damaged",
            ) from None
        index = self._name("responses", tenant)
        age = max(1, int(self.bounds.response_age))
        await self._run(
            "touching a response",
            lambda c: (
                c.pipeline().zadd(index, {rid: time.time()}, xx=True).expire(name, age).execute()
            ),
        )
        return kept

    async def forget_response(self, tenant: str | None, rid: str) -> bool:
        name = self._name("response", tenant, rid)
        index, sizes = self._name("responses", tenant), self._name("response-sizes", tenant)
        gone, tomb = self._tombstone(name)
        age = max(1, int(self.bounds.response_age))

        def forget(client: Client) -> list[Any]:
            pipe = client.pipeline(transaction=True)
            pipe.delete(name).zrem(index, rid).hdel(sizes, rid).set(gone, tomb, ex=age)
            return list(pipe.execute())

        done = await self._run("deleting a response", forget)
        self._remember(self._gone, name)
        return bool(done[0])

    # -- conversations --

    def _conversation_names(self, tenant: str | None, cid: str) -> tuple[str, str, str, str]:
        """The conversation's head, items (by place), item counter and item places (by
        id)."""
        return (
            self._name("conversation", tenant, cid),
            self._name("items", tenant, cid),
            self._name("item-seq", tenant, cid),
            self._name("item-ids", tenant, cid),
        )

    def _seal_items(self, items_name: str, first: int, encoded: list[bytes]) -> dict[str, bytes]:
        return {
            str(first + n): self.shared.seal(f"{items_name}:{first + n}", e)
            for n, e in enumerate(encoded)
        }

    def _read_head(self, client: Client, cid: str, names: tuple[str, ...]) -> _Head | None:
        """The head as the server holds it now (inside a transaction: watched), checked;
        None when the conversation is gone, or was deleted and written back (its values
        are deleted again). One older than a version this replica saw land before the
        read began is refused as replayed (compared with what was seen before the read:
        a read may finish after later writes land)."""
        head_name = names[0]
        floor, deleted = self._versions.get(head_name, 0), head_name in self._gone
        pipe = client.pipeline(transaction=False)
        pipe.strlen(head_name).getrange(head_name, 0, MAX_HEAD + 64).get(head_name + ":gone")
        size, raw, tomb = pipe.execute()
        if not size:
            return None
        if self._buried(head_name, tomb, deleted):
            self.refused += 1
            client.delete(*names)
            return None
        if _count(size) > MAX_HEAD + self.shared.tag_bytes:
            self.refused += 1
            raise StateError(f"conversation {cid!r} has a head too large", kind="damaged")
        head = _decode_head(cid, self._open(head_name, raw))
        if head.version < floor:
            raise self._replayed(head_name)
        self._saw(head_name, head.version)
        return head

    def _saw(self, head_name: str, version: int) -> None:
        """Remember the latest version of a head this replica read or wrote."""
        self._remember(self._versions, head_name, max(version, self._versions.get(head_name, 0)))

    async def create_conversation(
        self, tenant: str | None, cid: str, head: ConversationHead, items: list[Item]
    ) -> None:
        b = self.bounds
        names = self._conversation_names(tenant, cid)
        head_name, items_name, seq_name, ids_name = names
        index, sizes = self._name("conversations", tenant), self._name("conversation-sizes", tenant)
        stored = _Head(head.created_at, head.metadata, 1, len(items))
        sealed_head = self.shared.seal(head_name, stored.encode())
        age = max(1, int(b.conversation_age))
        encoded: list[bytes] = []  # in the worker thread: items may be many megabytes
        size = 0

        def create(pipe: Client) -> bool:
            now = time.time()
            expired = [
                i.decode(errors="replace") for i in pipe.zrangebyscore(index, "-inf", now - age)
            ]
            count = int(pipe.zcard(index)) - len(expired)
            if count >= b.conversations:
                raise StateError(
                    f"this tenant keeps {count} conversations, the most the server keeps: "
                    "delete some first",
                    kind="full",
                )
            held = sum(
                _count(v)
                for k, v in pipe.hgetall(sizes).items()
                if k.decode(errors="replace") not in expired
            )
            if held + size > b.conversation_bytes:
                raise StateError(
                    f"this tenant's conversations would take {held + size:,} bytes, more "
                    f"than the server's {b.conversation_bytes:,}: delete some first",
                    kind="full",
                )
            pipe.multi()
            if expired:
                pipe.zrem(index, *expired)
                pipe.hdel(sizes, *expired)
            pipe.set(head_name, sealed_head, ex=age)
            if items:
                pipe.hset(items_name, mapping=self._seal_items(items_name, 1, encoded))
                pipe.hset(
                    ids_name, mapping={str(i.get("id", "")): n + 1 for n, i in enumerate(items)}
                )
                pipe.expire(items_name, age)
                pipe.expire(ids_name, age)
            pipe.set(seq_name, len(items), ex=age)
            pipe.zadd(index, {cid: now})
            pipe.hset(sizes, cid, size)
            pipe.expire(index, age)
            pipe.expire(sizes, age)
            return True

        def run(client: Client) -> bool:
            nonlocal encoded, size
            encoded = [msgspec.json.encode(i) for i in items]
            size = sum(len(e) for e in encoded)
            return bool(client.transaction(create, index, sizes, value_from_callable=True))

        await self._run("creating a conversation", run)
        self._saw(head_name, stored.version)

    async def conversation(self, tenant: str | None, cid: str) -> ConversationHead | None:
        names = self._conversation_names(tenant, cid)
        items_name = names[1]
        sizes = self._name("conversation-sizes", tenant)

        def read(client: Client) -> tuple[_Head, int, int] | None:
            head = self._read_head(client, cid, names)
            if head is None:
                return None
            held, size = client.pipeline().hlen(items_name).hget(sizes, cid).execute()
            return head, _count(held), _count(size)

        found = await self._run("reading a conversation", read)
        if found is None:
            return None
        head, held, size = found
        await self._touch(tenant, cid)
        return ConversationHead(head.created_at, head.metadata, held, size)

    async def _touch(self, tenant: str | None, cid: str) -> None:
        names = self._conversation_names(tenant, cid)
        index = self._name("conversations", tenant)
        age = max(1, int(self.bounds.conversation_age))

        def touch(client: Client) -> bool:
            pipe = client.pipeline()
            pipe.zadd(index, {cid: time.time()}, xx=True)  # never brings a deleted one back
            for name in names:
                pipe.expire(name, age)
            pipe.execute()
            return True

        await self._run("touching a conversation", touch)

    def _places(self, client: Client, cid: str, items_name: str, head: _Head) -> list[int]:
        """The places of the conversation's items, in order. Fields this store never
        writes (a name that is no place, a value larger than any request adds) are
        deleted unread; a conversation still holding another number of items than its
        head counts is ``damaged``."""
        places, foreign = [], []
        for field in client.hkeys(items_name):
            seq = _seq(field)
            if seq is None:
                foreign.append(field)
            else:
                places.append(seq)
        if head.items is not None and len(places) != head.items:
            pipe = client.pipeline(transaction=False)
            for seq in places:
                pipe.hstrlen(items_name, str(seq))
            limit = MAX_ITEM + self.shared.tag_bytes
            large = {s for s, n in zip(places, pipe.execute(), strict=True) if _count(n) > limit}
            places = [s for s in places if s not in large]
            foreign += [str(s) for s in large]
        if foreign:
            client.hdel(items_name, *foreign)
            self.refused += len(foreign)
        if head.items is not None and len(places) != head.items:
            self.refused += 1
            raise StateError(
                f"conversation {cid!r} holds {len(places)} items where its head counts "
                f"{head.items}: items were added or removed without the replicas' secret; "
                "delete the conversation",
                kind="damaged",
            )
        return sorted(places)

    def _fetch(self, client: Client, cid: str, items_name: str, places: list[int]) -> list[bytes]:
        """The stored items at ``places``, each checked for length before it is read (one
        larger than any request could add is deleted unread)."""
        out: list[bytes] = []
        limit = MAX_ITEM + self.shared.tag_bytes
        for at in range(0, len(places), 256):
            chunk = places[at : at + 256]
            pipe = client.pipeline(transaction=False)
            for seq in chunk:
                pipe.hstrlen(items_name, str(seq))
            lengths = pipe.execute()
            large = [str(s) for s, n in zip(chunk, lengths, strict=True) if _count(n) > limit]
            if large:
                client.hdel(items_name, *large)
                self.refused += len(large)
                raise StateError(
                    f"conversation {cid!r} held an item larger than any request adds "
                    "(deleted unread): it was written without the replicas' secret",
                    kind="damaged",
                )
            out += [v or b"" for v in client.hmget(items_name, [str(s) for s in chunk])]
        return out

    def _decoded(self, cid: str, items_name: str, found: list[tuple[int, bytes]]) -> list[Item]:
        """Stored items checked and decoded (in a worker thread: they may be large)."""
        out = []
        for n, (seq, stored) in enumerate(found):
            value = self._open(f"{items_name}:{seq}", stored)
            try:
                out.append(decode_item(cid, n, value))
            except StateError:
                self.refused += 1
                raise
        return out

    async def items(self, tenant: str | None, cid: str) -> list[Item] | None:
        names = self._conversation_names(tenant, cid)
        items_name = names[1]

        def read(client: Client) -> list[tuple[int, bytes]] | None:
            head = self._read_head(client, cid, names)
            if head is None:
                return None
            places = self._places(client, cid, items_name, head)
            return list(zip(places, self._fetch(client, cid, items_name, places), strict=True))

        found = await self._run("reading a conversation's items", read)
        if found is None:
            return None
        await self._touch(tenant, cid)
        return await off_loop(self._decoded, cid, items_name, found)

    async def item_page(
        self, tenant: str | None, cid: str, *, limit: int, order: str, after: str | None
    ) -> tuple[list[Item], bool] | None:
        """Only the page's items are read (and the item ``after``, to check its place)."""
        names = self._conversation_names(tenant, cid)
        items_name, ids_name = names[1], names[3]

        def read(client: Client) -> tuple[list[tuple[int, bytes]], bool] | None:
            head = self._read_head(client, cid, names)
            if head is None:
                return None
            places = self._places(client, cid, items_name, head)
            if order == "desc":
                places.reverse()
            if after is not None:
                found = self._place_of(client, cid, items_name, ids_name, after)
                if found is None or found[0] not in places:
                    raise KeyError(after)
                places = places[places.index(found[0]) + 1 :]
            chosen = places[:limit]
            return list(zip(chosen, self._fetch(client, cid, items_name, chosen), strict=True)), (
                len(places) > limit
            )

        found = await self._run("reading a page of items", read)
        if found is None:
            return None
        await self._touch(tenant, cid)
        raw, more = found
        return await off_loop(self._decoded, cid, items_name, raw), more

    def _place_of(
        self, client: Client, cid: str, items_name: str, ids_name: str, iid: str
    ) -> tuple[int, bytes] | None:
        """Where item ``iid`` is, and its stored value: from the index of ids, checked
        against the item itself (an index entry is not signed); by reading every item
        where the index has none (a conversation kept before the index)."""
        at = _seq(client.hget(ids_name, iid) or b"")
        if at is not None:
            stored = self._fetch(client, cid, items_name, [at])[0]
            if stored:
                value = self._open(f"{items_name}:{at}", stored)
                if decode_item(cid, at, value).get("id") == iid:
                    return at, stored
            return None
        if client.hlen(ids_name):
            return None
        places = sorted(p for p in map(_seq, client.hkeys(items_name)) if p is not None)
        for chunk in (places[at : at + 256] for at in range(0, len(places), 256)):
            for seq, stored in zip(chunk, self._fetch(client, cid, items_name, chunk), strict=True):
                try:
                    value = self.shared.open(f"{items_name}:{seq}", bytes(stored))
                    if decode_item(cid, seq, value).get("id") == iid:
                        return seq, stored
                except (kvrt.SharedValueError, StateError):
                    continue  # a damaged item is not the one asked for
        return None

    async def item(self, tenant: str | None, cid: str, iid: str) -> Item | None:
        names = self._conversation_names(tenant, cid)
        items_name, ids_name = names[1], names[3]

        def read(client: Client) -> tuple[int, bytes] | None:
            if self._read_head(client, cid, names) is None:
                return None
            found = self._place_of(client, cid, items_name, ids_name, iid)
            if found is None:
                raise KeyError(iid)
            return found

        found = await self._run("reading an item", read)
        if found is None:
            return None
        return (await off_loop(self._decoded, cid, items_name, [found]))[0]

    def _next_place(self, client: Client, items_name: str, seq_name: str, count: int) -> int:
        """The place of the first of ``count`` new items: after the counter, unless the
        counter (not signed) points at places that hold items, which are never
        overwritten (then after the last item held)."""
        first = _count(client.get(seq_name)) + 1
        pipe = client.pipeline(transaction=False)
        for seq in range(first, first + count):
            pipe.hexists(items_name, str(seq))
        if first > 1 and not any(pipe.execute()):
            return first
        held = [p for p in map(_seq, client.hkeys(items_name)) if p is not None]
        return max([first - 1, *held]) + 1

    async def add_items(self, tenant: str | None, cid: str, items: list[Item]) -> bool:
        return await self.keep_turn(tenant, None, cid, items)

    async def keep_turn(
        self,
        tenant: str | None,
        response: tuple[str, KeptResponse] | None,
        cid: str | None,
        items: list[Item],
    ) -> bool:
        """A response kept and ``items`` added to conversation ``cid`` in one transaction:
        both or neither. False (nothing kept) when the conversation is unknown."""
        b = self.bounds
        watched: list[str] = []
        if response is not None:
            rid = response[0]
            name = self._name("response", tenant, rid)
            index, rsizes = self._name("responses", tenant), self._name("response-sizes", tenant)
        if cid is not None:
            names = self._conversation_names(tenant, cid)
            head_name, items_name, seq_name, ids_name = names
            sizes = self._name("conversation-sizes", tenant)
            watched = [head_name, seq_name, sizes]
        age, response_age = max(1, int(b.conversation_age)), max(1, int(b.response_age))
        version: list[int] = []
        # Encoded and sealed in the worker thread, not on the event loop: a kept response
        # holds its whole conversation (many megabytes, at times).
        record = sealed_response = b""
        encoded: list[bytes] = []
        size = 0

        def keep(pipe: Client) -> bool:
            version.clear()  # an attempt that another client's write undid wrote nothing
            head = None
            if cid is not None:
                head = self._read_head(pipe, cid, names)
                if head is None:
                    return False
                held = sum(_count(v) for v in pipe.hvals(sizes))
                if held + size > b.conversation_bytes:
                    raise StateError(
                        f"this tenant's conversations would take {held + size:,} bytes, more "
                        f"than the server's {b.conversation_bytes:,}: delete some first",
                        kind="full",
                    )
                first = self._next_place(pipe, items_name, seq_name, len(items))
            pipe.multi()
            if cid is not None and head is not None and items:
                count = None if head.items is None else head.items + len(items)
                new = msgspec.structs.replace(head, version=head.version + 1, items=count)
                version[:] = [new.version]
                pipe.set(head_name, self.shared.seal(head_name, new.encode()), ex=age)
                pipe.hset(items_name, mapping=self._seal_items(items_name, first, encoded))
                pipe.hset(
                    ids_name, mapping={str(i.get("id", "")): first + n for n, i in enumerate(items)}
                )
                pipe.set(seq_name, first + len(items) - 1, ex=age)
                pipe.hincrby(sizes, cid, size)
                for expiring in (items_name, ids_name, sizes):
                    pipe.expire(expiring, age)
            if response is not None:
                pipe.set(name, sealed_response, ex=response_age)
                pipe.zadd(index, {rid: time.time()})
                pipe.hset(rsizes, rid, len(record))
                pipe.expire(index, response_age)
                pipe.expire(rsizes, response_age)
            return True

        def run(client: Client) -> bool:
            nonlocal record, sealed_response, encoded, size
            if response is not None:
                record = _encode.encode(response[1])
                self._check_response(record)
                sealed_response = self.shared.seal(name, record)
            encoded = [msgspec.json.encode(i) for i in items]
            size = sum(len(e) for e in encoded)
            done = bool(client.transaction(keep, *watched, value_from_callable=True))
            if done and response is not None:
                self._trim_responses(client, tenant)
            return done

        done = await self._run("keeping a turn" if response else "adding items", run)
        if version and cid is not None:
            self._saw(head_name, version[0])
        return done

    async def set_metadata(self, tenant: str | None, cid: str, metadata: dict[str, str]) -> bool:
        names = self._conversation_names(tenant, cid)
        head_name = names[0]
        age = max(1, int(self.bounds.conversation_age))
        version: list[int] = []

        def update(pipe: Client) -> bool:
            version.clear()
            head = self._read_head(pipe, cid, names)
            if head is None:
                return False
            new = msgspec.structs.replace(head, metadata=metadata, version=head.version + 1)
            version[:] = [new.version]
            pipe.multi()
            pipe.set(head_name, self.shared.seal(head_name, new.encode()), ex=age)
            return True

        done = await self._run(
            "setting metadata",
            lambda c: c.transaction(update, head_name, value_from_callable=True),
        )
        if version:
            self._saw(head_name, version[0])
        return bool(done)

    async def remove_item(self, tenant: str | None, cid: str, iid: str) -> bool | None:
        names = self._conversation_names(tenant, cid)
        head_name, items_name, _, ids_name = names
        sizes = self._name("conversation-sizes", tenant)
        age = max(1, int(self.bounds.conversation_age))
        version: list[int] = []

        def remove(pipe: Client) -> bool | None:
            version.clear()
            head = self._read_head(pipe, cid, names)
            if head is None:
                return None
            found = self._place_of(pipe, cid, items_name, ids_name, iid)
            if found is None:
                return False
            at, stored = found
            value = self._open(f"{items_name}:{at}", stored)
            count = None if head.items is None else head.items - 1
            new = msgspec.structs.replace(head, version=head.version + 1, items=count)
            version[:] = [new.version]
            pipe.multi()
            pipe.set(head_name, self.shared.seal(head_name, new.encode()), ex=age)
            pipe.hdel(items_name, str(at))
            pipe.hdel(ids_name, iid)
            pipe.hincrby(sizes, cid, -len(value))
            return True

        done: bool | None = await self._run(
            "removing an item",
            lambda c: c.transaction(remove, head_name, items_name, sizes, value_from_callable=True),
        )
        if version:
            self._saw(head_name, version[0])
        return done

    async def delete_conversation(self, tenant: str | None, cid: str) -> bool:
        names = self._conversation_names(tenant, cid)
        index, sizes = self._name("conversations", tenant), self._name("conversation-sizes", tenant)
        gone, tomb = self._tombstone(names[0])
        age = max(1, int(self.bounds.conversation_age))

        def delete(client: Client) -> list[Any]:
            return list(
                client.pipeline(transaction=True)
                .delete(names[0])
                .delete(*names[1:])
                .zrem(index, cid)
                .hdel(sizes, cid)
                .set(gone, tomb, ex=age)
                .execute()
            )

        done = await self._run("deleting a conversation", delete)
        self._remember(self._gone, names[0])
        return bool(done[0])

    async def stats(self) -> StateStats:
        """This process's view: what it refused and failed to write (the server's totals
        are not counted, so they read 0)."""
        return StateStats(
            where=self.where,
            responses=0,
            response_bytes=0,
            conversations=0,
            conversation_bytes=0,
            refused=self.refused + self.shared.refused,
            failures=self.failures,
        )
