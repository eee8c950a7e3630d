"""The Conversations API (``/v1/conversations`` and its items) and the Responses API's
``conversation`` field: a conversation is a list of items the server keeps for its tenant,
and a response created in one reads them before its own input, then adds its input and
output to them. The KV of what a conversation holds is where every prompt's KV is: in a
session of the pool, else in the cold tiers (RAM, disk, Redis), so a conversation picked
up again computes only what is new to it.

Items are kept typed and in one canonical form (messages with text parts,
``function_call``, ``function_call_output``), each with an id; metadata as OpenAI bounds
it (16 keys of at most 64 characters, values of at most 512). In memory, conversations
are bounded by count and bytes: past either, the least recently used one leaves memory.
With a folder, each conversation is also a file there (one JSON line a change: created,
items added, an item removed, metadata set), so one that left memory, or a server that
restarted, reads it back when it is next asked for; deleting a conversation deletes its
file.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import kvrt

from .openai import RequestError
from .reading import listing, read_json, tenant_of
from .responses import locked, message_items, new_id, page, to_messages

_log = logging.getLogger("kvrt.serve")

ID = re.compile(r"conv_[0-9a-f]{32}")
"""What a conversation id looks like (anything else is a 404 before any file is
touched)."""

__all__ = [
    "ConversationStore",
    "Routes",
    "body",
    "canonical_items",
    "conversation_id",
    "items_of",
    "metadata",
    "output_items",
]


def metadata(value: Any, where: str = "metadata") -> dict[str, str]:
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


def canonical_items(items: Any, where: str = "items") -> list[dict[str, Any]]:
    """Input items (as the Responses API takes them) checked and written in the one form
    a conversation keeps, each with a fresh id."""
    if not isinstance(items, list):
        raise RequestError(f"{where} must be a list of items", param=where)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        try:
            read = to_messages([item])
        except RequestError as exc:
            raise RequestError(
                str(exc).replace("input[0]", at), param=(exc.param or "").replace("input[0]", at)
            ) from None
        for message in read:
            out.extend(items_of(message))
    return out


def items_of(message: kvrt.Message) -> list[dict[str, Any]]:
    """A kept message as conversation items, with fresh ids."""
    return message_items(message, new_id)


def output_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as a conversation keeps them (their ids kept)."""
    found: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item.get("content", ()))
            found.append(
                {
                    "type": "message",
                    "id": item["id"],
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                    "status": "completed",
                }
            )
        elif item["type"] == "function_call":
            keys = ("type", "id", "call_id", "name", "arguments", "status")
            found.append({k: item[k] for k in keys})
    return found


def as_input(item: dict[str, Any]) -> dict[str, Any]:
    """A kept item as a request's input item (what ``to_messages`` reads)."""
    return {k: v for k, v in item.items() if k not in ("id", "status")}


def conversation_id(value: Any) -> str | None:
    """The Responses API's ``conversation``: an id, or ``{"id": ...}``."""
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if not isinstance(value, str) or not value:
        raise RequestError(
            'conversation must be a conversation id or {"id": ...}', param="conversation"
        )
    return value


class _Kept(msgspec.Struct):
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]]
    size: int = 0


class ConversationStore:
    """Conversations by tenant, bounded in memory by count and bytes (least recently used
    first out), and written to ``folder`` when one is given."""

    def __init__(
        self, *, capacity: int = 1024, max_bytes: int = 64 * 2**20, folder: Path | None = None
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.folder = folder
        self.bytes = 0
        self._kept: OrderedDict[tuple[str | None, str], _Kept] = OrderedDict()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._kept)

    # -- the files --

    def _file(self, tenant: str | None, cid: str) -> Path | None:
        if self.folder is None:
            return None
        owner = "shared" if tenant is None else hashlib.sha256(tenant.encode()).hexdigest()[:16]
        return self.folder / owner / f"{cid}.jsonl"

    def _write(self, tenant: str | None, cid: str, record: dict[str, Any]) -> None:
        path = self._file(tenant, cid)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("ab") as f:
                f.write(msgspec.json.encode(record) + b"\n")
        except OSError as exc:  # kept in memory all the same; a restart will not have it
            _log.warning("conversation %s not written to %s: %s", cid, path, exc)

    def _read(self, tenant: str | None, cid: str) -> _Kept | None:
        path = self._file(tenant, cid)
        if path is None or not ID.fullmatch(cid):
            return None
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            return None
        kept: _Kept | None = None
        for line in lines:
            try:
                record = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue  # a line cut short by a crash: the changes before it stand
            op = record.get("op")
            if op == "create":
                kept = _Kept(record["created_at"], record["metadata"], [])
            elif kept is None:
                continue
            elif op == "add":
                kept.items.extend(record["items"])
            elif op == "remove":
                kept.items = [i for i in kept.items if i["id"] != record["id"]]
            elif op == "metadata":
                kept.metadata = record["metadata"]
        if kept is not None:
            kept.size = len(msgspec.json.encode(kept.items))
        return kept

    # -- the API --

    @locked
    def create(
        self, items: list[dict[str, Any]], meta: dict[str, str], *, tenant: str | None
    ) -> str:
        cid = new_id("conv")
        kept = self._kept[tenant, cid] = _Kept(int(time.time()), meta, [])
        self._write(tenant, cid, {"op": "create", "created_at": kept.created_at, "metadata": meta})
        self.add(cid, items, tenant=tenant)
        self._trim(keep=(tenant, cid))
        return cid

    @locked
    def get(self, cid: str, *, tenant: str | None, param: str | None = None) -> _Kept:
        found = self._kept.get((tenant, cid))
        if found is None:
            found = self._read(tenant, cid)
            if found is not None:
                self._kept[tenant, cid] = found
                self.bytes += found.size
                self._trim(keep=(tenant, cid))
        if found is None:
            raise RequestError(
                f"conversation {cid!r} is not kept (unknown, deleted, or dropped to stay "
                "within the server's bounds)",
                status=404,
                param=param,
                code="conversation_not_found",
            )
        self._kept.move_to_end((tenant, cid))
        return found

    @locked
    def add(self, cid: str, items: list[dict[str, Any]], *, tenant: str | None) -> None:
        kept = self.get(cid, tenant=tenant)
        size = len(msgspec.json.encode(items))
        if kept.size + size > self.max_bytes:
            raise RequestError(
                f"conversation {cid!r} would pass the server's {self.max_bytes:,} bytes",
                param="items",
            )
        if not items:
            return
        kept.items.extend(items)
        kept.size += size
        self.bytes += size
        self._write(tenant, cid, {"op": "add", "items": items})
        self._trim(keep=(tenant, cid))

    @locked
    def set_metadata(self, cid: str, meta: dict[str, str], *, tenant: str | None) -> None:
        self.get(cid, tenant=tenant).metadata = meta
        self._write(tenant, cid, {"op": "metadata", "metadata": meta})

    @locked
    def remove_item(self, cid: str, item_id: str, *, tenant: str | None) -> None:
        kept = self.get(cid, tenant=tenant)
        at = next((i for i, item in enumerate(kept.items) if item["id"] == item_id), None)
        if at is None:
            raise RequestError(f"item {item_id!r} is not in conversation {cid!r}", status=404)
        size = len(msgspec.json.encode([kept.items.pop(at)]))
        kept.size -= size
        self.bytes -= size
        self._write(tenant, cid, {"op": "remove", "id": item_id})

    @locked
    def delete(self, cid: str, *, tenant: str | None) -> None:
        kept = self.get(cid, tenant=tenant)
        del self._kept[tenant, cid]
        self.bytes -= kept.size
        path = self._file(tenant, cid)
        if path is not None:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                _log.warning("conversation %s: its file %s stays: %s", cid, path, exc)

    @locked
    def messages(self, cid: str, *, tenant: str | None) -> list[kvrt.Message]:
        """What the conversation holds, as the messages a response's context begins with."""
        kept = self.get(cid, tenant=tenant, param="conversation")
        return to_messages([as_input(item) for item in kept.items]) if kept.items else []

    def _trim(self, keep: tuple[str | None, str]) -> None:
        while len(self._kept) > 1 and (
            len(self._kept) > self.capacity or self.bytes > self.max_bytes
        ):
            oldest = next(iter(self._kept))
            if oldest == keep:
                break
            self.bytes -= self._kept.pop(oldest).size


def body(cid: str, kept: _Kept) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "conversation",
        "created_at": kept.created_at,
        "metadata": kept.metadata,
    }


class Routes:
    """The Conversations API's routes over a store; ``error`` makes a refusal's
    response (the server's, which counts it)."""

    def __init__(self, store: ConversationStore, error: Callable[[RequestError], Response]) -> None:
        self.store, self.error = store, error

    async def create(self, request: Request) -> Response:
        """``POST /v1/conversations``: ``items`` (input items) and ``metadata``."""
        try:
            sent = await read_json(request)
            unknown = sorted(set(sent) - {"items", "metadata"})
            if unknown:
                raise RequestError(f"{unknown[0]} is not supported by kvrt", param=unknown[0])
            items = canonical_items(sent.get("items") or [])
            meta = metadata(sent.get("metadata"))
            tenant = tenant_of(request)
            cid = self.store.create(items, meta, tenant=tenant)
            kept = self.store.get(cid, tenant=tenant)
        except RequestError as exc:
            return self.error(exc)
        return JSONResponse(body(cid, kept))

    async def one(self, request: Request) -> Response:
        """``GET`` a conversation, ``POST`` its new ``metadata``, or ``DELETE`` it."""
        cid, tenant = request.path_params["cid"], tenant_of(request)
        try:
            if request.method == "DELETE":
                self.store.delete(cid, tenant=tenant)
                return JSONResponse({"id": cid, "object": "conversation.deleted", "deleted": True})
            if request.method == "POST":
                sent = await read_json(request)
                meta = metadata(sent.get("metadata"))
                self.store.set_metadata(cid, meta, tenant=tenant)
            kept = self.store.get(cid, tenant=tenant)
        except RequestError as exc:
            return self.error(exc)
        return JSONResponse(body(cid, kept))

    async def items(self, request: Request) -> Response:
        """``GET`` a conversation's items (``limit``, ``order`` asc by default, ``after``),
        or ``POST`` more (``items``)."""
        cid, tenant = request.path_params["cid"], tenant_of(request)
        try:
            if request.method == "POST":
                sent = await read_json(request)
                added = canonical_items(sent.get("items"))
                self.store.add(cid, added, tenant=tenant)
                return JSONResponse(page(added, limit=len(added) or 1, order="asc", after=None))
            limit, order = listing(request, default_order="asc")
            kept = self.store.get(cid, tenant=tenant)
            listed = page(
                kept.items, limit=limit, order=order, after=request.query_params.get("after")
            )
        except RequestError as exc:
            return self.error(exc)
        return JSONResponse(listed)

    async def item(self, request: Request) -> Response:
        """``GET`` one item of a conversation, or ``DELETE`` it (answered with the
        conversation)."""
        cid, iid, tenant = (
            request.path_params["cid"],
            request.path_params["iid"],
            tenant_of(request),
        )
        try:
            if request.method == "DELETE":
                self.store.remove_item(cid, iid, tenant=tenant)
                return JSONResponse(body(cid, self.store.get(cid, tenant=tenant)))
            kept = self.store.get(cid, tenant=tenant)
            item = next((i for i in kept.items if i["id"] == iid), None)
            if item is None:
                raise RequestError(f"item {iid!r} is not in conversation {cid!r}", status=404)
        except RequestError as exc:
            return self.error(exc)
        return JSONResponse(item)
