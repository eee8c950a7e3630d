"""What a replica may believe of the API state's values on the replicas' shared server.

Values are signed with the replicas' secret like blocks (:class:`kvrt.SharedStore`): a
kept response, a conversation's head and each item carry a tag over their name (an
item's name holds its place in the conversation), so a value altered, moved or written
without the secret is refused. Reads are bounded: an item's length is asked before it is
read (one past the largest request is refused unread and deleted), a page of items reads
that page alone, and a conversation holding more items than its head counts is refused.

A deleted conversation or response leaves a signed tombstone for its age, and each
replica remembers the latest version of the heads it has seen: an old value written back
under its own name (a replay) is gone again where its tombstone is, and refused where a
replica saw a later version (docs/cold-tiers.md says what a replay can still do). The
stores' rules over these values are :mod:`kvrt.serve.state.shared`'s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

import kvrt

from ..protocol.errors import MAX_BODY
from .records import Item, StateError, decode_item

__all__ = ["Client", "Head", "SignedValues", "as_count"]

T = TypeVar("T")
Client = Any
"""redis-py's client, in a worker thread (its pipelines' typing is too loose to follow)."""

_encode = msgspec.msgpack.Encoder()
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


def as_count(value: Any) -> int:
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


class Head(msgspec.Struct, frozen=True):
    """A conversation's head as stored: what it was created with, its metadata, the
    version every change raises, and how many items it holds."""

    created_at: int
    metadata: dict[str, str]
    version: int = 0
    items: int | None = None
    """None in a head written before the count was kept: then unchecked."""

    def encode(self) -> bytes:
        return _encode.encode((self.created_at, self.metadata, self.version, self.items))


def decode_head(cid: str, value: bytes) -> Head:
    try:
        got = _head.decode(value)
        created_at, metadata = got[0], got[1]
        version, items = (got[2], got[3]) if len(got) == 4 else (0, None)
        checked = msgspec.convert(
            {"created_at": created_at, "metadata": metadata, "version": version, "items": items},
            Head,
        )
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError, TypeError) as exc:
        raise StateError(f"conversation {cid!r} is damaged ({exc})", kind="damaged") from None
    return checked


class SignedValues:
    """The API state's values on the shared server behind ``shared``, as a replica may
    believe them; ``refused`` and ``failures`` count what it refused and could not do."""

    def __init__(self, shared: kvrt.SharedStore) -> None:
        self.shared = shared
        self.refused = self.failures = 0
        self.versions: OrderedDict[str, int] = OrderedDict()
        """The latest head version this replica saw of each conversation."""
        self.gone: OrderedDict[str, None] = OrderedDict()
        """Conversations and responses this replica deleted (by name)."""

    # -- names --

    def name(self, kind: str, tenant: str | None, key: str = "") -> str:
        return self.shared.name(kind, _tenant(tenant) + b"\0" + key.encode())

    async def run(self, what: str, fn: Callable[[Client], T]) -> T:
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

    def open(self, name: str, stored: Any) -> bytes:
        try:
            return self.shared.open(name, bytes(stored))
        except kvrt.SharedValueError:
            self.refused += 1
            raise StateError(
                f"a kept value ({name}) fails its check: written without the replicas' secret "
                "or altered; it is not used",
                kind="damaged",
            ) from None

    async def get(self, kind: str, tenant: str | None, key: str, max_bytes: int) -> bytes | None:
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

    def remember(self, book: OrderedDict[Any, Any], key: Any, value: Any = None) -> None:
        book[key] = value
        book.move_to_end(key)
        while len(book) > REMEMBERED:
            book.popitem(last=False)

    def tombstone(self, name: str) -> tuple[str, bytes]:
        """A deleted value's tombstone: its name and sealed content."""
        gone = name + ":gone"
        return gone, self.shared.seal(gone, b"gone")

    def buried(self, name: str, tomb: Any, deleted: bool) -> bool:
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

    def replayed(self, name: str) -> StateError:
        self.refused += 1
        return StateError(
            f"a kept value ({name}) was changed since: an earlier value written back "
            "without the replicas' secret is not used",
            kind="damaged",
        )

    def seal_items(self, items_name: str, first: int, encoded: list[bytes]) -> dict[str, bytes]:
        return {
            str(first + n): self.shared.seal(f"{items_name}:{first + n}", e)
            for n, e in enumerate(encoded)
        }

    def read_head(self, client: Client, cid: str, names: tuple[str, ...]) -> Head | None:
        """The head as the server holds it now (inside a transaction: watched), checked;
        None when the conversation is gone, or was deleted and written back (its values
        are deleted again). One older than a version this replica saw land before the
        read began is refused as replayed (compared with what was seen before the read:
        a read may finish after later writes land)."""
        head_name = names[0]
        floor, deleted = self.versions.get(head_name, 0), head_name in self.gone
        pipe = client.pipeline(transaction=False)
        pipe.strlen(head_name).getrange(head_name, 0, MAX_HEAD + 64).get(head_name + ":gone")
        size, raw, tomb = pipe.execute()
        if not size:
            return None
        if self.buried(head_name, tomb, deleted):
            self.refused += 1
            client.delete(*names)
            return None
        if as_count(size) > MAX_HEAD + self.shared.tag_bytes:
            self.refused += 1
            raise StateError(f"conversation {cid!r} has a head too large", kind="damaged")
        head = decode_head(cid, self.open(head_name, raw))
        if head.version < floor:
            raise self.replayed(head_name)
        self.saw(head_name, head.version)
        return head

    def saw(self, head_name: str, version: int) -> None:
        """Remember the latest version of a head this replica read or wrote."""
        self.remember(self.versions, head_name, max(version, self.versions.get(head_name, 0)))

    def places(self, client: Client, cid: str, items_name: str, head: Head) -> list[int]:
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
            large = {s for s, n in zip(places, pipe.execute(), strict=True) if as_count(n) > limit}
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

    def fetch(self, client: Client, cid: str, items_name: str, places: list[int]) -> list[bytes]:
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
            large = [str(s) for s, n in zip(chunk, lengths, strict=True) if as_count(n) > limit]
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

    def decoded(self, cid: str, items_name: str, found: list[tuple[int, bytes]]) -> list[Item]:
        """Stored items checked and decoded (in a worker thread: they may be large)."""
        out = []
        for n, (seq, stored) in enumerate(found):
            value = self.open(f"{items_name}:{seq}", stored)
            try:
                out.append(decode_item(cid, n, value))
            except StateError:
                self.refused += 1
                raise
        return out

    def place_of(
        self, client: Client, cid: str, items_name: str, ids_name: str, iid: str
    ) -> tuple[int, bytes] | None:
        """Where item ``iid`` is, and its stored value: from the index of ids, checked
        against the item itself (an index entry is not signed); by reading every item
        where the index has none (a conversation kept before the index)."""
        at = _seq(client.hget(ids_name, iid) or b"")
        if at is not None:
            stored = self.fetch(client, cid, items_name, [at])[0]
            if stored:
                value = self.open(f"{items_name}:{at}", stored)
                if decode_item(cid, at, value).get("id") == iid:
                    return at, stored
            return None
        if client.hlen(ids_name):
            return None
        places = sorted(p for p in map(_seq, client.hkeys(items_name)) if p is not None)
        for chunk in (places[at : at + 256] for at in range(0, len(places), 256)):
            for seq, stored in zip(chunk, self.fetch(client, cid, items_name, chunk), strict=True):
                try:
                    value = self.shared.open(f"{items_name}:{seq}", bytes(stored))
                    if decode_item(cid, seq, value).get("id") == iid:
                        return seq, stored
                except (kvrt.SharedValueError, StateError):
                    continue  # a damaged item is not the one asked for
        return None

    def next_place(self, client: Client, items_name: str, seq_name: str, count: int) -> int:
        """The place of the first of ``count`` new items: after the counter, unless the
        counter (not signed) points at places that hold items, which are never
        overwritten (then after the last item held)."""
        first = as_count(client.get(seq_name)) + 1
        pipe = client.pipeline(transaction=False)
        for seq in range(first, first + count):
            pipe.hexists(items_name, str(seq))
        if first > 1 and not any(pipe.execute()):
            return first
        held = [p for p in map(_seq, client.hkeys(items_name)) if p is not None]
        return max([first - 1, *held]) + 1
