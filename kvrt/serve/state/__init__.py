"""The server's own state — kept responses (``previous_response_id``, ``GET
/v1/responses/{id}``) and conversations — in a real database, behind one protocol:

- :mod:`.sqlite` — SQLite, the default: one file beside the disk tier (a rollback
  journal, synced writes), so both survive a restart; several processes of one host may share it;
- :mod:`.shared` — the replicas' Redis/Valkey server when ``remote.url`` is set, signed
  like the blocks, so every replica reads what any of them kept.

Both keep per-tenant bounds (:class:`Bounds`), run off the event loop, and answer what
they cannot do with a :class:`StateError` the routes turn into a clear error (never a 200
for what was not kept, never a traceback for bad content).

Dependencies run one way, in the order of :data:`LAYERS`: the two stores (:mod:`.sqlite`,
:mod:`.shared`) stand on their parts (the SQLite file, :mod:`.database`; what a replica
may believe of the shared server's values, :mod:`.signed`), on work off the event loop
(:mod:`.threads`) and on what any store holds (:mod:`.records`); the architecture test
holds it.
"""

from __future__ import annotations

from typing import Protocol

import kvrt

from ..protocol.errors import RequestError
from .records import Bounds, ConversationHead, Item, KeptResponse, StateError, StateStats
from .shared import SharedState
from .sqlite import SqliteState

__all__ = [
    "Bounds",
    "ConversationHead",
    "Item",
    "KeptResponse",
    "SharedState",
    "SqliteState",
    "StateError",
    "StateStats",
    "StateStore",
    "open_state",
    "refusal",
]


class StateStore(Protocol):
    """Where the server keeps responses and conversations, by tenant."""

    where: str

    async def keep_response(self, tenant: str | None, rid: str, kept: KeptResponse) -> None:
        """Keep a response (a :class:`StateError` when it cannot be kept)."""
        ...

    async def response(self, tenant: str | None, rid: str) -> KeptResponse | None:
        """A kept response; None when unknown or expired."""
        ...

    async def forget_response(self, tenant: str | None, rid: str) -> bool:
        """Delete a kept response; whether there was one."""
        ...

    async def create_conversation(
        self, tenant: str | None, cid: str, head: ConversationHead, items: list[Item]
    ) -> None:
        """A new conversation holding ``items``."""
        ...

    async def conversation(self, tenant: str | None, cid: str) -> ConversationHead | None:
        """A conversation without its items; None when unknown or expired."""
        ...

    async def items(self, tenant: str | None, cid: str) -> list[Item] | None:
        """A conversation's items in order; None when it is unknown."""
        ...

    async def item_page(
        self, tenant: str | None, cid: str, *, limit: int, order: str, after: str | None
    ) -> tuple[list[Item], bool] | None:
        """``limit`` items after the item ``after`` in ``order`` (``asc``, ``desc``) and
        whether more follow; None when the conversation is unknown; a ``KeyError`` when
        it holds no item ``after``."""
        ...

    async def item(self, tenant: str | None, cid: str, iid: str) -> Item | None:
        """Item ``iid`` of a conversation (that one alone read); None when the
        conversation is unknown; a ``KeyError`` when it holds no such item."""
        ...

    async def add_items(self, tenant: str | None, cid: str, items: list[Item]) -> bool:
        """Append items; False when the conversation is unknown."""
        ...

    async def keep_turn(
        self,
        tenant: str | None,
        response: tuple[str, KeptResponse] | None,
        cid: str | None,
        items: list[Item],
    ) -> bool:
        """What one answered request adds, kept whole or not at all: the response under
        its id (when given) and ``items`` at the end of conversation ``cid`` (when given).
        False, with nothing kept, when the conversation is unknown (deleted meanwhile); a
        :class:`StateError` when either cannot be kept."""
        ...

    async def set_metadata(self, tenant: str | None, cid: str, metadata: dict[str, str]) -> bool:
        """Replace a conversation's metadata; False when it is unknown."""
        ...

    async def remove_item(self, tenant: str | None, cid: str, iid: str) -> bool | None:
        """Remove an item; False when there is none of that id, None when the
        conversation is unknown."""
        ...

    async def delete_conversation(self, tenant: str | None, cid: str) -> bool:
        """Delete a conversation; whether there was one."""
        ...

    async def stats(self) -> StateStats:
        """What the store holds and how it fared."""
        ...

    async def aclose(self) -> None:
        """Let the store go."""
        ...


async def open_state(runtime: kvrt.Runtime, path: str | None, bounds: Bounds) -> StateStore:
    """The runtime's shared server when it has one, else SQLite at ``path`` (None: in
    this process's memory only)."""
    if runtime.shared is not None:
        return SharedState(runtime.shared, bounds)
    return await SqliteState.open(path or ":memory:", bounds)


STATUS = {"full": 507, "too_large": 507, "unavailable": 503, "damaged": 500}


def refusal(exc: StateError, param: str | None = None) -> RequestError:
    """What a client is told when the state store could not do what it asked."""
    return RequestError(
        str(exc),
        status=STATUS[exc.kind],
        param=param,
        code=f"state_{exc.kind}",
        kind="server_error",
    )


LAYERS = (
    "sqlite",
    "shared",
    "database",
    "signed",
    "threads",
    "records",
)
"""The modules from the top down: each imports only those after it."""
