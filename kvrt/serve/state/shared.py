"""The API state on the replicas' shared Redis/Valkey server (``remote.url``), so every
replica reads the responses and conversations any of them kept. What a replica may
believe of a value it reads there (signed, bounded, not replayed) is :mod:`.signed`'s.

Bounds are kept per tenant with an index of what each tenant holds (a sorted set by last
use, and sizes); values expire with their age. Every write that depends on what is there
runs in one optimistic transaction (``WATCH`` the keys it read, ``MULTI``/``EXEC`` its
writes, again if another client changed them meanwhile): an item added while its
conversation is deleted lands before the deletion or not at all, and a tenant's recorded
bytes are what its conversations hold.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

import kvrt

from .records import (
    Bounds,
    ConversationHead,
    Item,
    KeptResponse,
    StateError,
    StateStats,
)
from .signed import Client, Head, SignedValues, as_count
from .threads import off_loop

__all__ = ["SharedState"]

_encode = msgspec.msgpack.Encoder()
_response = msgspec.msgpack.Decoder(KeptResponse)


class SharedState:
    """Kept responses and conversations on the remote server behind ``shared``."""

    def __init__(self, shared: kvrt.SharedStore, bounds: Bounds) -> None:
        self.values = SignedValues(shared)
        """The values on the server, as this replica may believe them."""
        self.bounds = bounds
        self.where = "remote (shared by the replicas)"

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
        index, sizes = (
            self.values.name("responses", tenant),
            self.values.name("response-sizes", tenant),
        )
        held = [i.decode(errors="replace") for i in client.zrevrange(index, 0, -1)]
        sized = client.hmget(sizes, held) if held else []
        total, drop = 0, []
        for n, (other, size) in enumerate(zip(held, sized, strict=True)):
            total += as_count(size)
            if n >= b.responses or total > b.response_bytes:
                drop.append(other)
        if drop:
            pipe = client.pipeline(transaction=True)
            pipe.delete(*(self.values.name("response", tenant, d) for d in drop))
            pipe.zrem(index, *drop)
            pipe.hdel(sizes, *drop)
            pipe.execute()

    async def response(self, tenant: str | None, rid: str) -> KeptResponse | None:
        name = self.values.name("response", tenant, rid)
        deleted = name in self.values.gone
        value = await self.values.get("response", tenant, rid, self.bounds.response_bytes)
        if value is None:
            return None
        tomb = await self.values.run("reading a response", lambda c: c.get(name + ":gone"))
        if self.values.buried(name, tomb, deleted):  # deleted, then written back: gone again
            self.values.refused += 1
            await self.values.run("deleting a replayed response", lambda c: c.delete(name))
            return None
        try:
            kept = _response.decode(value)
        except (msgspec.DecodeError, TypeError) as exc:
            self.values.refused += 1
            raise StateError(
                f"kept response {rid!r} is damaged ({exc}): it cannot be continued",
                kind="damaged",
            ) from None
        index = self.values.name("responses", tenant)
        age = max(1, int(self.bounds.response_age))
        await self.values.run(
            "touching a response",
            lambda c: (
                c.pipeline().zadd(index, {rid: time.time()}, xx=True).expire(name, age).execute()
            ),
        )
        return kept

    async def forget_response(self, tenant: str | None, rid: str) -> bool:
        name = self.values.name("response", tenant, rid)
        index, sizes = (
            self.values.name("responses", tenant),
            self.values.name("response-sizes", tenant),
        )
        gone, tomb = self.values.tombstone(name)
        age = max(1, int(self.bounds.response_age))

        def forget(client: Client) -> list[Any]:
            pipe = client.pipeline(transaction=True)
            pipe.delete(name).zrem(index, rid).hdel(sizes, rid).set(gone, tomb, ex=age)
            return list(pipe.execute())

        done = await self.values.run("deleting a response", forget)
        self.values.remember(self.values.gone, name)
        return bool(done[0])

    # -- conversations --

    def _conversation_names(self, tenant: str | None, cid: str) -> tuple[str, str, str, str]:
        """The conversation's head, items (by place), item counter and item places (by
        id)."""
        return (
            self.values.name("conversation", tenant, cid),
            self.values.name("items", tenant, cid),
            self.values.name("item-seq", tenant, cid),
            self.values.name("item-ids", tenant, cid),
        )

    async def create_conversation(
        self, tenant: str | None, cid: str, head: ConversationHead, items: list[Item]
    ) -> None:
        b = self.bounds
        names = self._conversation_names(tenant, cid)
        head_name, items_name, seq_name, ids_name = names
        index, sizes = (
            self.values.name("conversations", tenant),
            self.values.name("conversation-sizes", tenant),
        )
        stored = Head(head.created_at, head.metadata, 1, len(items))
        sealed_head = self.values.shared.seal(head_name, stored.encode())
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
                as_count(v)
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
                pipe.hset(items_name, mapping=self.values.seal_items(items_name, 1, encoded))
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

        await self.values.run("creating a conversation", run)
        self.values.saw(head_name, stored.version)

    async def conversation(self, tenant: str | None, cid: str) -> ConversationHead | None:
        names = self._conversation_names(tenant, cid)
        items_name = names[1]
        sizes = self.values.name("conversation-sizes", tenant)

        def read(client: Client) -> tuple[Head, int, int] | None:
            head = self.values.read_head(client, cid, names)
            if head is None:
                return None
            held, size = client.pipeline().hlen(items_name).hget(sizes, cid).execute()
            return head, as_count(held), as_count(size)

        found = await self.values.run("reading a conversation", read)
        if found is None:
            return None
        head, held, size = found
        await self._touch(tenant, cid)
        return ConversationHead(head.created_at, head.metadata, held, size)

    async def _touch(self, tenant: str | None, cid: str) -> None:
        names = self._conversation_names(tenant, cid)
        index = self.values.name("conversations", tenant)
        age = max(1, int(self.bounds.conversation_age))

        def touch(client: Client) -> bool:
            pipe = client.pipeline()
            pipe.zadd(index, {cid: time.time()}, xx=True)  # never brings a deleted one back
            for name in names:
                pipe.expire(name, age)
            pipe.execute()
            return True

        await self.values.run("touching a conversation", touch)

    async def items(self, tenant: str | None, cid: str) -> list[Item] | None:
        names = self._conversation_names(tenant, cid)
        items_name = names[1]

        def read(client: Client) -> list[tuple[int, bytes]] | None:
            head = self.values.read_head(client, cid, names)
            if head is None:
                return None
            places = self.values.places(client, cid, items_name, head)
            return list(
                zip(places, self.values.fetch(client, cid, items_name, places), strict=True)
            )

        found = await self.values.run("reading a conversation's items", read)
        if found is None:
            return None
        await self._touch(tenant, cid)
        return await off_loop(self.values.decoded, cid, items_name, found)

    async def item_page(
        self, tenant: str | None, cid: str, *, limit: int, order: str, after: str | None
    ) -> tuple[list[Item], bool] | None:
        """Only the page's items are read (and the item ``after``, to check its place)."""
        names = self._conversation_names(tenant, cid)
        items_name, ids_name = names[1], names[3]

        def read(client: Client) -> tuple[list[tuple[int, bytes]], bool] | None:
            head = self.values.read_head(client, cid, names)
            if head is None:
                return None
            places = self.values.places(client, cid, items_name, head)
            if order == "desc":
                places.reverse()
            if after is not None:
                found = self.values.place_of(client, cid, items_name, ids_name, after)
                if found is None or found[0] not in places:
                    raise KeyError(after)
                places = places[places.index(found[0]) + 1 :]
            chosen = places[:limit]
            return list(
                zip(chosen, self.values.fetch(client, cid, items_name, chosen), strict=True)
            ), (len(places) > limit)

        found = await self.values.run("reading a page of items", read)
        if found is None:
            return None
        await self._touch(tenant, cid)
        raw, more = found
        return await off_loop(self.values.decoded, cid, items_name, raw), more

    async def item(self, tenant: str | None, cid: str, iid: str) -> Item | None:
        names = self._conversation_names(tenant, cid)
        items_name, ids_name = names[1], names[3]

        def read(client: Client) -> tuple[int, bytes] | None:
            if self.values.read_head(client, cid, names) is None:
                return None
            found = self.values.place_of(client, cid, items_name, ids_name, iid)
            if found is None:
                raise KeyError(iid)
            return found

        found = await self.values.run("reading an item", read)
        if found is None:
            return None
        return (await off_loop(self.values.decoded, cid, items_name, [found]))[0]

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
            name = self.values.name("response", tenant, rid)
            index, rsizes = (
                self.values.name("responses", tenant),
                self.values.name("response-sizes", tenant),
            )
        if cid is not None:
            names = self._conversation_names(tenant, cid)
            head_name, items_name, seq_name, ids_name = names
            sizes = self.values.name("conversation-sizes", tenant)
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
                head = self.values.read_head(pipe, cid, names)
                if head is None:
                    return False
                held = sum(as_count(v) for v in pipe.hvals(sizes))
                if held + size > b.conversation_bytes:
                    raise StateError(
                        f"this tenant's conversations would take {held + size:,} bytes, more "
                        f"than the server's {b.conversation_bytes:,}: delete some first",
                        kind="full",
                    )
                first = self.values.next_place(pipe, items_name, seq_name, len(items))
            pipe.multi()
            if cid is not None and head is not None and items:
                count = None if head.items is None else head.items + len(items)
                new = msgspec.structs.replace(head, version=head.version + 1, items=count)
                version[:] = [new.version]
                pipe.set(head_name, self.values.shared.seal(head_name, new.encode()), ex=age)
                pipe.hset(items_name, mapping=self.values.seal_items(items_name, first, encoded))
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
                sealed_response = self.values.shared.seal(name, record)
            encoded = [msgspec.json.encode(i) for i in items]
            size = sum(len(e) for e in encoded)
            done = bool(client.transaction(keep, *watched, value_from_callable=True))
            if done and response is not None:
                self._trim_responses(client, tenant)
            return done

        done = await self.values.run("keeping a turn" if response else "adding items", run)
        if version and cid is not None:
            self.values.saw(head_name, version[0])
        return done

    async def set_metadata(self, tenant: str | None, cid: str, metadata: dict[str, str]) -> bool:
        names = self._conversation_names(tenant, cid)
        head_name = names[0]
        age = max(1, int(self.bounds.conversation_age))
        version: list[int] = []

        def update(pipe: Client) -> bool:
            version.clear()
            head = self.values.read_head(pipe, cid, names)
            if head is None:
                return False
            new = msgspec.structs.replace(head, metadata=metadata, version=head.version + 1)
            version[:] = [new.version]
            pipe.multi()
            pipe.set(head_name, self.values.shared.seal(head_name, new.encode()), ex=age)
            return True

        done = await self.values.run(
            "setting metadata",
            lambda c: c.transaction(update, head_name, value_from_callable=True),
        )
        if version:
            self.values.saw(head_name, version[0])
        return bool(done)

    async def remove_item(self, tenant: str | None, cid: str, iid: str) -> bool | None:
        names = self._conversation_names(tenant, cid)
        head_name, items_name, _, ids_name = names
        sizes = self.values.name("conversation-sizes", tenant)
        age = max(1, int(self.bounds.conversation_age))
        version: list[int] = []

        def remove(pipe: Client) -> bool | None:
            version.clear()
            head = self.values.read_head(pipe, cid, names)
            if head is None:
                return None
            found = self.values.place_of(pipe, cid, items_name, ids_name, iid)
            if found is None:
                return False
            at, stored = found
            value = self.values.open(f"{items_name}:{at}", stored)
            count = None if head.items is None else head.items - 1
            new = msgspec.structs.replace(head, version=head.version + 1, items=count)
            version[:] = [new.version]
            pipe.multi()
            pipe.set(head_name, self.values.shared.seal(head_name, new.encode()), ex=age)
            pipe.hdel(items_name, str(at))
            pipe.hdel(ids_name, iid)
            pipe.hincrby(sizes, cid, -len(value))
            return True

        done: bool | None = await self.values.run(
            "removing an item",
            lambda c: c.transaction(remove, head_name, items_name, sizes, value_from_callable=True),
        )
        if version:
            self.values.saw(head_name, version[0])
        return done

    async def delete_conversation(self, tenant: str | None, cid: str) -> bool:
        names = self._conversation_names(tenant, cid)
        index, sizes = (
            self.values.name("conversations", tenant),
            self.values.name("conversation-sizes", tenant),
        )
        gone, tomb = self.values.tombstone(names[0])
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

        done = await self.values.run("deleting a conversation", delete)
        self.values.remember(self.values.gone, names[0])
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
            refused=self.values.refused + self.values.shared.refused,
            failures=self.values.failures,
        )
