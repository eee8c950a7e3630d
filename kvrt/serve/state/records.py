"""What the server keeps of its API state, as any store holds it: kept responses,
conversations and their items, the bounds every store keeps them within, and the one
error a store raises."""

from __future__ import annotations

from typing import Literal

import msgspec

import kvrt

from ..protocol.wire import Item as Item

__all__ = [
    "Bounds",
    "ConversationHead",
    "KeptResponse",
    "StateError",
    "StateStats",
    "decode_item",
]


class Bounds(msgspec.Struct, frozen=True, kw_only=True):
    """What a store keeps for each tenant, at most."""

    responses: int = 1024
    """Kept responses; past it the least recently used go."""
    response_bytes: int = 64 * 2**20
    """Bytes of kept responses (their conversations and bodies); past it the least
    recently used go. A response larger than this is not kept (an error to its client)."""
    response_age: float = 7 * 24 * 3600.0
    """Seconds a kept response lives after it was last used."""
    conversations: int = 1024
    """Conversations; a tenant holding this many creates no more until some go (deleted,
    or unused for ``conversation_age``)."""
    conversation_bytes: int = 256 * 2**20
    """Bytes of conversation items; past it items are refused (a 507 naming the bound)."""
    conversation_age: float = 30 * 24 * 3600.0
    """Seconds a conversation lives after it was last used."""


class KeptResponse(msgspec.Struct, frozen=True):
    """One kept response: its conversation (without instructions), where its own input
    lies in it, and the response object as it was answered."""

    messages: tuple[kvrt.Message, ...]
    inputs: tuple[int, int]
    """The messages its request's ``input`` gave: ``messages[inputs[0]:inputs[1]]``."""
    body: bytes
    """The response object, JSON (``GET /v1/responses/{id}``)."""


class ConversationHead(msgspec.Struct, frozen=True):
    """A conversation without its items."""

    created_at: int
    metadata: dict[str, str]
    items: int = 0
    """Items it holds."""
    size: int = 0
    """Bytes its items take (JSON)."""


class StateStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a store holds (all tenants) and how it fared."""

    where: str
    """The store: ``sqlite:PATH`` or the remote server's address."""
    responses: int
    response_bytes: int
    conversations: int
    conversation_bytes: int
    refused: int
    """Rows or values refused as damaged (or forged, in a shared store)."""
    failures: int
    """Writes the store could not make (full, read-only, unreachable)."""

    @classmethod
    def unreadable(cls) -> StateStats:
        """What is reported of a store that cannot be opened or read: one failure."""
        return cls(
            where="",
            responses=0,
            response_bytes=0,
            conversations=0,
            conversation_bytes=0,
            refused=0,
            failures=1,
        )


StateProblem = Literal["full", "unavailable", "damaged", "too_large"]


class StateError(kvrt.KvrtError):
    """A store could not keep or read something; ``kind`` says why: ``full`` (a bound or
    the disk), ``unavailable`` (read-only, unreachable), ``damaged`` (a row or value that
    fails its checks: refused, the rest readable), ``too_large`` (one thing past a
    bound)."""

    def __init__(self, message: str, *, kind: StateProblem) -> None:
        super().__init__(message)
        self.kind = kind


_item = msgspec.json.Decoder(Item)


def decode_item(cid: str, n: int, stored: bytes) -> Item:
    """Item ``n`` of conversation ``cid`` from its stored bytes, or a ``damaged``
    :class:`StateError` naming it (every store keeps items as this JSON)."""
    try:
        item = _item.decode(stored)
        if not isinstance(item.get("id"), str) or not isinstance(item.get("type"), str):
            raise msgspec.DecodeError("no id or type")
    except (msgspec.DecodeError, TypeError) as exc:
        raise StateError(
            f"conversation {cid!r}: its item {n} is damaged ({exc}); delete the item or the "
            "conversation",
            kind="damaged",
        ) from None
    return item
