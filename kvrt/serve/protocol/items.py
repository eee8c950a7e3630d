"""Input items (as the Responses and Conversations APIs take them) read into the chat
messages kvrt keeps of them, and kept messages listed as items again. Pure."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import kvrt

from .errors import RequestError, refusal
from .wire import Item

__all__ = ["input_items", "message_items", "to_messages"]


_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}
"""The keys each kind of input item may carry (what the API defines for it; the ``id`` and
``status`` of items a client sends back are read and dropped)."""
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _checked(item: object, where: str, keys: set[str]) -> Item:
    if not isinstance(item, dict):
        raise RequestError(f"{where} must be an object", param=where)
    unknown = sorted(set(item) - keys)
    if unknown:
        raise RequestError(
            f"{where}.{unknown[0]} is not a field kvrt reads", param=f"{where}.{unknown[0]}"
        )
    return item


def _text(value: object, where: str) -> str:
    """A string, or a list of text parts joined: what kvrt keeps of content."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{at} of type {kind!r} is not supported: only text parts", param=at)
        _checked(part, at, _PART_KEYS)
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{at}.text must be a string", param=f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: Item, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def to_messages(items: str | Sequence[object], where: str = "input") -> list[kvrt.Message]:
    """Input items as the chat messages kvrt keeps of them, typed: consecutive function
    calls make one assistant message, a function call's output a tool message. An unknown
    key, a non-text part or a wrong type is a 400 naming where (``input[0].output``): what
    is kept is only what the conversation needs, never a client's extra bytes."""
    if isinstance(items, str):
        return [kvrt.Message(role="user", content=items)]
    out: list[Item] = []
    root = where
    for i, item in enumerate(items):
        where = f"{root}[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in _ITEM_KEYS:
            raise RequestError(f"{where} of type {kind!r} is not supported by kvrt", param=where)
        _checked(item, where, _ITEM_KEYS[kind])
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(
                    f"{where}.role {role!r} is not a message role", param=f"{where}.role"
                )
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise RequestError(
                    f"{where}.arguments must be a string", param=f"{where}.arguments"
                )
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
    if not out:
        return []
    try:
        return kvrt.read_messages(out, param=root)
    except kvrt.KvrtError as exc:
        raise refusal(exc, default=root) from None


def message_items(message: kvrt.Message, id_of: Callable[[str], str]) -> list[Item]:
    """A kept message as the items the API lists: its text (a message), then each of its
    calls (``function_call``); a tool message is a ``function_call_output``. ``id_of``
    gives each item's id from its kind's prefix (``msg``, ``fc``, ``fco``)."""
    if message.role == "tool":
        return [
            {
                "type": "function_call_output",
                "id": id_of("fco"),
                "call_id": message.tool_call_id,
                "output": message.content,
                "status": "completed",
            }
        ]
    found: list[Item] = []
    if message.content or not message.tool_calls:
        kind = "output_text" if message.role == "assistant" else "input_text"
        found.append(
            {
                "type": "message",
                "id": id_of("msg"),
                "role": message.role,
                "content": [{"type": kind, "text": message.content}],
                "status": "completed",
            }
        )
    for cid, name, arguments in message.tool_calls:
        found.append(
            {
                "type": "function_call",
                "id": id_of("fc"),
                "call_id": cid,
                "name": name,
                "arguments": arguments,
                "status": "completed",
            }
        )
    return found


def input_items(rid: str, inputs: Sequence[kvrt.Message]) -> list[Item]:
    """The items a kept response's request gave as ``inputs``, as the API lists them (ids
    derived from the response's: ``{rid}_in_{n}``)."""
    n = itertools.count()

    def id_of(_: str) -> str:
        return f"{rid}_in_{next(n)}"

    return [item for m in inputs for item in message_items(m, id_of)]
