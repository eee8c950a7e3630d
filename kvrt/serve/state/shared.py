"""The API state on the replicas' shared Redis/Valkey server (``remote.url``), so every
replica reads the responses and conversations any of them kept.

Values are signed with the replicas' secret like blocks (:class:`kvrt.SharedStore`):
a kept response, a conversation's head and each item carry a tag over their name (an
item's name holds its place in the conversation), so a value altered, moved or written
without the secret is refused. Bounds are kept per tenant with an index of what each
tenant holds (a sorted set by last use, and sizes); values expire with their age.
Reads are bounded: a conversation is read in pieces and refused once it passes its
tenant's bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import msgspec

import kvrt

from .records import (
    Bounds,
    ConversationHead,
    Item,
    KeptResponse,
    StateError,
    StateStats,
    decode_item,
)

__all__ = ["SharedState"]

T = TypeVar("T")
Client = Any
"""redis-py's client, in a worker thread (its pipelines' typing is too loose to follow)."""

_encode = msgspec.msgpack.Encoder()
_response = msgspec.msgpack.Decoder(KeptResponse)
_head = msgspec.msgpack.Decoder(tuple[int, dict[str, str]])


MAX_HEAD = 64 * 1024
"""The largest conversation head read (its metadata is at most 16 keys of 64 characters
and values of 512)."""


def page_of(
    items: list[Item], *, limit: int, order: str, after: str | None
) -> tuple[list[Item], bool]:
    """``limit`` of ``items`` after the item ``after`` in ``order``, and whether more
    follow (a ``KeyError`` when no item is ``after``)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise KeyError(after)
        ordered = ordered[at + 1 :]
    return ordered[:limit], len(ordered) > limit


def _tenant(tenant: str | None) -> bytes:
    return b"-" if tenant is None else b"+" + tenant.encode()


class SharedState:
    """Kept responses and conversations on the remote server behind ``shared``."""

    def __init__(self, shared: kvrt.SharedStore, bounds: Bounds) -> None:
        self.shared = shared
        self.bounds = bounds
        self.where = "remote (shared by the replicas)"
        self.refused = self.failures = 0

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
        try:
            done = await self.shared.run(what, fn)
        except StateError:
            raise
        if done is None:
            self.failures += 1
            raise StateError(
                f"the shared state server could not be used ({what}): try again shortly",
                kind="unavailable",
            )
        return done

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

    async def aclose(self) -> None:
        """Nothing to close: the runtime owns the connection."""

    # -- responses --

    async def keep_response(self, tenant: str | None, rid: str, kept: KeptResponse) -> None:
        record = _encode.encode(kept)
        b = self.bounds
        if len(record) > b.response_bytes:
            raise StateError(
                f"the response takes {len(record):,} bytes, more than the "
                f"{b.response_bytes:,} a tenant's kept responses may",
                kind="too_large",
            )
        name = self._name("response", tenant, rid)
        sealed = self.shared.seal(name, record)
        index, sizes = self._name("responses", tenant), self._name("response-sizes", tenant)
        age = max(1, int(b.response_age))

        def write(client: Client) -> bool:
            now = time.time()
            pipe = client.pipeline(transaction=True)
            pipe.set(name, sealed, ex=age)
            pipe.zadd(index, {rid: now})
            pipe.hset(sizes, rid, len(record))
            pipe.expire(index, age)
            pipe.expire(sizes, age)
            pipe.execute()
            held = [i.decode() for i in client.zrevrange(index, 0, -1)]
            sized = client.hmget(sizes, held) if held else []
            total, drop = 0, []
            for n, (other, size) in enumerate(zip(held, sized, strict=True)):
                total += int(size or 0)
                if n >= b.responses or total > b.response_bytes:
                    drop.append(other)
            if drop:
                pipe = client.pipeline(transaction=True)
                pipe.delete(*(self._name("response", tenant, d) for d in drop))
                pipe.zrem(index, *drop)
                pipe.hdel(sizes, *drop)
                pipe.execute()
            return True

        await self._run("keeping a response", write)

    async def response(self, tenant: str | None, rid: str) -> KeptResponse | None:
        name = self._name("response", tenant, rid)
        value = await self._get("response", tenant, rid, self.bounds.response_bytes)
        if value is None:
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
            lambda c: c.pipeline().zadd(index, {rid: time.time()}).expire(name, age).execute(),
        )
        return kept

    async def forget_response(self, tenant: str | None, rid: str) -> bool:
        name = self._name("response", tenant, rid)
        index, sizes = self._name("responses", tenant), self._name("response-sizes", tenant)

        def forget(client: Client) -> list[Any]:
            return list(client.pipeline().delete(name).zrem(index, rid).hdel(sizes, rid).execute())

        done = await self._run("deleting a response", forget)
        return bool(done[0])

    # -- conversations --

    def _conversation_names(self, tenant: str | None, cid: str) -> tuple[str, str, str]:
        return (
            self._name("conversation", tenant, cid),
            self._name("items", tenant, cid),
            self._name("item-seq", tenant, cid),
        )

    def _seal_items(self, items_name: str, first: int, items: list[Item]) -> dict[str, bytes]:
        return {
            str(first + n): self.shared.seal(f"{items_name}:{first + n}", msgspec.json.encode(i))
            for n, i in enumerate(items)
        }

    async def create_conversation(
        self, tenant: str | None, cid: str, head: ConversationHead, items: list[Item]
    ) -> None:
        b = self.bounds
        head_name, items_name, seq_name = self._conversation_names(tenant, cid)
        index, sizes = self._name("conversations", tenant), self._name("conversation-sizes", tenant)
        sealed_head = self.shared.seal(head_name, _encode.encode((head.created_at, head.metadata)))
        size = sum(len(msgspec.json.encode(i)) for i in items)
        age = max(1, int(b.conversation_age))

        def create(client: Client) -> bool:
            now = time.time()
            expired = [i.decode() for i in client.zrangebyscore(index, "-inf", now - age)]
            if expired:
                client.zrem(index, *expired)
                client.hdel(sizes, *expired)
            count = int(client.zcard(index))
            if count >= b.conversations:
                raise StateError(
                    f"this tenant keeps {count} conversations, the most the server keeps: "
                    "delete some first",
                    kind="full",
                )
            held = sum(int(v) for v in client.hvals(sizes))
            if held + size > b.conversation_bytes:
                raise StateError(
                    f"this tenant's conversations would take {held + size:,} bytes, more "
                    f"than the server's {b.conversation_bytes:,}: delete some first",
                    kind="full",
                )
            pipe = client.pipeline(transaction=True)
            pipe.set(head_name, sealed_head, ex=age)
            if items:
                pipe.hset(items_name, mapping=self._seal_items(items_name, 1, items))
                pipe.expire(items_name, age)
            pipe.set(seq_name, len(items), ex=age)
            pipe.zadd(index, {cid: now})
            pipe.hset(sizes, cid, size)
            pipe.expire(index, age)
            pipe.expire(sizes, age)
            pipe.execute()
            return True

        await self._run("creating a conversation", create)

    async def conversation(self, tenant: str | None, cid: str) -> ConversationHead | None:
        _, items_name, _ = self._conversation_names(tenant, cid)
        sizes = self._name("conversation-sizes", tenant)
        stored = await self._get("conversation", tenant, cid, MAX_HEAD)
        if stored is None:
            return None
        got = await self._run(
            "reading a conversation",
            lambda c: c.pipeline().hlen(items_name).hget(sizes, cid).execute(),
        )
        try:
            created_at, meta = _head.decode(stored)
        except (msgspec.DecodeError, TypeError) as exc:
            self.refused += 1
            raise StateError(f"conversation {cid!r} is damaged ({exc})", kind="damaged") from None
        await self._touch(tenant, cid)
        return ConversationHead(created_at, meta, int(got[0]), int(got[1] or 0))

    async def _touch(self, tenant: str | None, cid: str) -> None:
        names = self._conversation_names(tenant, cid)
        index = self._name("conversations", tenant)
        age = max(1, int(self.bounds.conversation_age))

        def touch(client: Client) -> bool:
            pipe = client.pipeline()
            pipe.zadd(index, {cid: time.time()})
            for name in names:
                pipe.expire(name, age)
            pipe.execute()
            return True

        await self._run("touching a conversation", touch)

    async def items(self, tenant: str | None, cid: str) -> list[Item] | None:
        if await self.conversation(tenant, cid) is None:
            return None
        _, items_name, _ = self._conversation_names(tenant, cid)
        limit = self.bounds.conversation_bytes + (1 << 20)

        def read(client: Client) -> list[tuple[int, bytes]] | None:
            found, total, cursor = [], 0, 0
            while True:
                cursor, page = client.hscan(items_name, cursor, count=256)
                for field, value in page.items():
                    total += len(value)
                    if total > limit:
                        return None
                    found.append((int(field), value))
                if not cursor:
                    return found

        raw = await self._run("reading a conversation's items", lambda c: [read(c)])
        if raw[0] is None:
            self.refused += 1
            raise StateError(
                f"conversation {cid!r} holds more than a tenant's conversations may: refused",
                kind="damaged",
            )
        return await anyio.to_thread.run_sync(self._decoded, cid, items_name, raw[0])

    def _decoded(self, cid: str, items_name: str, raw: list[tuple[int, bytes]]) -> list[Item]:
        """A conversation's stored items checked and decoded, in order (in a worker
        thread: a conversation may be large)."""
        out = []
        for n, (seq, stored) in enumerate(sorted(raw)):
            value = self._open(f"{items_name}:{seq}", stored)
            try:
                out.append(decode_item(cid, n, value))
            except StateError:
                self.refused += 1
                raise
        return out

    async def item_page(
        self, tenant: str | None, cid: str, *, limit: int, order: str, after: str | None
    ) -> tuple[list[Item], bool] | None:
        found = await self.items(tenant, cid)
        if found is None:
            return None
        return page_of(found, limit=limit, order=order, after=after)

    async def add_items(self, tenant: str | None, cid: str, items: list[Item]) -> bool:
        head = await self.conversation(tenant, cid)
        if head is None:
            return False
        if not items:
            return True
        b = self.bounds
        _, items_name, seq_name = self._conversation_names(tenant, cid)
        sizes = self._name("conversation-sizes", tenant)
        encoded = [msgspec.json.encode(i) for i in items]
        size = sum(len(e) for e in encoded)
        age = max(1, int(b.conversation_age))

        def add(client: Client) -> bool:
            held = sum(int(v) for v in client.hvals(sizes))
            if held + size > b.conversation_bytes:
                raise StateError(
                    f"this tenant's conversations would take {held + size:,} bytes, more "
                    f"than the server's {b.conversation_bytes:,}: delete some first",
                    kind="full",
                )
            last = int(client.incrby(seq_name, len(items)))
            first = last - len(items) + 1
            pipe = client.pipeline(transaction=True)
            pipe.hset(items_name, mapping=self._seal_items(items_name, first, items))
            pipe.hincrby(sizes, cid, size)
            pipe.expire(items_name, age)
            pipe.expire(seq_name, age)
            pipe.execute()
            return True

        return await self._run("adding items", add)

    async def set_metadata(self, tenant: str | None, cid: str, metadata: dict[str, str]) -> bool:
        head = await self.conversation(tenant, cid)
        if head is None:
            return False
        head_name, _, _ = self._conversation_names(tenant, cid)
        sealed = self.shared.seal(head_name, _encode.encode((head.created_at, metadata)))
        age = max(1, int(self.bounds.conversation_age))
        await self._run("setting metadata", lambda c: c.set(head_name, sealed, ex=age))
        return True

    async def remove_item(self, tenant: str | None, cid: str, iid: str) -> bool | None:
        items = await self.items(tenant, cid)
        if items is None:
            return None
        _, items_name, _ = self._conversation_names(tenant, cid)
        sizes = self._name("conversation-sizes", tenant)

        def remove(client: Client) -> bool:
            for field, stored in client.hscan_iter(items_name, count=256):
                try:
                    value = self.shared.open(f"{items_name}:{int(field)}", bytes(stored))
                except kvrt.SharedValueError:
                    continue
                try:
                    found = decode_item(cid, int(field), value)
                except StateError:
                    continue  # a damaged item is not the one asked for
                if found.get("id") == iid:
                    pipe = client.pipeline(transaction=True)
                    pipe.hdel(items_name, field)
                    pipe.hincrby(sizes, cid, -len(value))
                    pipe.execute()
                    return True
            return False

        done = await self._run("removing an item", lambda c: [remove(c)])
        return done[0]

    async def delete_conversation(self, tenant: str | None, cid: str) -> bool:
        names = self._conversation_names(tenant, cid)
        index, sizes = self._name("conversations", tenant), self._name("conversation-sizes", tenant)

        def delete(client: Client) -> list[Any]:
            return list(
                client.pipeline(transaction=True)
                .delete(names[0])
                .delete(names[1], names[2])
                .zrem(index, cid)
                .hdel(sizes, cid)
                .execute()
            )

        done = await self._run("deleting a conversation", delete)
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
