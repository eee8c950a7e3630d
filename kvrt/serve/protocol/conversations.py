"""The Conversations API's translation (``/v1/conversations`` and its items, and the
Responses API's ``conversation`` field), pure: its routes are :mod:`kvrt.serve.exchanges.conversations`.

A conversation is a list of items the server keeps for its tenant,
and a response created in one reads them before its own input, then adds its input and
output to them. The KV of what a conversation holds is where every prompt's KV is: in a
session of the pool, else in the cold tiers (RAM, disk, Redis), so a conversation picked
up again computes only what is new to it.

Items are kept typed and in one canonical form (messages with text parts,
``function_call``, ``function_call_output``), each with an id; metadata as OpenAI bounds
it (16 keys of at most 64 characters, values of at most 512). They live in the server's
state store (:mod:`kvrt.serve.state`: SQLite, or the replicas' shared server), bounded
per tenant, read and written off the event loop.
"""

from __future__ import annotations

import re

import msgspec

import kvrt

from .errors import RequestError
from .items import message_items, to_messages
from .responses import FunctionCallItem, OutputItem
from .wire import Item, object_id

ID = re.compile(r"conv_[0-9a-f]{32}")
"""What a conversation id looks like (anything else is a 404 before any file is
touched)."""

__all__ = [
    "ID",
    "ConversationBody",
    "DeletedBody",
    "canonical_items",
    "conversation_items",
    "items_of",
    "messages",
    "metadata",
    "not_kept",
]


def metadata(value: object, where: str = "metadata") -> dict[str, str]:
    """Metadata as OpenAI bounds it, or a 400 naming what is wrong."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 16:
        raise RequestError(f"{where} must be an object of at most 16 keys", param=where)
    for key, text in value.items():
        if not isinstance(text, str) or len(key) > 64 or len(text) > 512:
            raise RequestError(
                f"{where} keys are at most 64 characters and values strings of at most 512",
                param=where,
            )
    return dict(value)


def canonical_items(items: object, where: str = "items") -> list[Item]:
    """Input items (as the Responses API takes them) checked and written in the one form
    a conversation keeps, each with a fresh id."""
    if not isinstance(items, list):
        raise RequestError(f"{where} must be a list of items", param=where)
    return [item for message in to_messages(items, where) for item in items_of(message)]


def items_of(message: kvrt.Message) -> list[Item]:
    """A kept message as conversation items, with fresh ids."""
    return message_items(message, object_id)


def conversation_items(output: list[OutputItem]) -> list[Item]:
    """A response's output items as a conversation keeps them (their ids kept)."""
    found: list[Item] = []
    for item in output:
        if isinstance(item, FunctionCallItem):
            found.append(msgspec.to_builtins(item))
            continue
        text = "".join(p.text for p in item.content)
        found.append(
            {
                "type": "message",
                "id": item.id,
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
                "status": "completed",
            }
        )
    return found


def as_input(item: Item) -> Item:
    """A kept item as a request's input item (what ``to_messages`` reads)."""
    return {k: v for k, v in item.items() if k not in ("id", "status")}


class ConversationBody(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation object."""

    id: str
    object: str = "conversation"
    created_at: int
    metadata: dict[str, str]


class DeletedBody(msgspec.Struct, frozen=True, kw_only=True):
    """What a deleted object is answered with."""

    id: str
    object: str
    deleted: bool = True


def not_kept(cid: str, param: str | None = None) -> RequestError:
    """The 404 of a conversation that is not kept (unknown, deleted, expired, another
    tenant's)."""
    return RequestError(
        f"conversation {cid!r} is not kept (unknown, deleted, or expired)",
        status=404,
        param=param,
        code="conversation_not_found",
    )


def messages(items: list[Item]) -> list[kvrt.Message]:
    """What a conversation holds, as the messages a response's context begins with (a
    conversation may be large: the server calls this in a worker thread)."""
    return to_messages([as_input(item) for item in items]) if items else []
