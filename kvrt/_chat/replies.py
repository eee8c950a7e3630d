"""The token ids of recent replies, by their text.

A reply sent back as an assistant message is placed with the tokens that were generated
(and whose KV was computed), not with a fresh tokenization of its text, which may differ:
so the reply and everything before it are reused, not recomputed.

Remembered replies are scoped like blocks: a session opened with a cache salt finds only
the replies of sessions with the same salt (another tenant's reply, or what it called a
tool with, is never placed in its context).

Replicas sharing a remote server share the memory too (:meth:`ReplyMemory.publish`,
:meth:`ReplyMemory.recall`): a reply one replica generated is placed with its generated
tokens on every replica, so its KV — computed alone, as generated — is the generating
replica's, and every replica answers what comes after it as that one would.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from .._cold import SharedStore
from .._errors import SharedValueError

__all__ = ["SHARED_REPLY_TTL", "ReplyMemory"]

SHARED_REPLY_TTL = 24 * 3600.0
"""Seconds a reply stays in the shared store after it was generated."""

MAX_SHARED_REPLY = 4 * 2**20
"""The largest shared reply read back (its text and token ids)."""


class _Shared(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A reply as replicas share it."""

    scope: str | None
    text: str
    tokens: list[int]
    rest: str


@dataclass
class _Entries:
    """What every scope of one memory shares: bounded maps and their lock."""

    capacity: int
    shared: SharedStore | None = None
    """The remote server's values, when replicas share one."""
    replies: OrderedDict[tuple[str | None, str], tuple[list[int], str]] = field(
        default_factory=OrderedDict
    )
    shown: OrderedDict[tuple[str | None, str], tuple[str, list[int], str]] = field(
        default_factory=OrderedDict
    )
    """What a caller saw of a reply (its content, or its tool calls: ids, names and
    arguments) -> the text generated (a tool-call envelope), its tokens and the rest.
    Calls carry ids of their own, so two generations of the same calls keep their own
    tokens (tokens of one text differ between generations)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class ReplyMemory:
    """A bounded map from reply text to the generated tokens, shared by a runtime's
    sessions; safe from any thread (sessions tokenize in worker threads).

    >>> memory = ReplyMemory(2)
    >>> memory.remember("Hello!", [9906, 0], "Hello!")
    >>> memory.lookup("Hello!"), memory.lookup("Hello")
    (([9906, 0], ''), None)
    >>> memory.scoped("tenant-b").lookup("Hello!") is None
    True
    """

    def __init__(
        self,
        capacity: int = 256,
        *,
        shared: SharedStore | None = None,
        _entries: _Entries | None = None,
        _scope: str | None = None,
    ) -> None:
        self._entries = _entries or _Entries(capacity, shared)
        self._scope = _scope

    @property
    def capacity(self) -> int:
        return self._entries.capacity

    def scoped(self, salt: str | None) -> ReplyMemory:
        """The same memory as a session with cache salt ``salt`` sees it: only replies
        remembered under that salt (None: the unsalted sessions' scope). Every scope counts
        against one capacity."""
        return ReplyMemory(_entries=self._entries, _scope=salt)

    def remember(
        self,
        text: str,
        tokens: list[int],
        tokens_text: str,
        *,
        content: str | None = None,
        calls: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        """``text`` was generated as ``tokens`` (whose own text is ``tokens_text``, a
        prefix of ``text`` when a stop sequence cut the last token short). ``content`` and
        ``calls`` (its tool calls: id, name, arguments in their canonical form) are what
        the caller got of it, when that is not ``text`` itself (a tool-call envelope)."""
        if not text or not tokens or not text.startswith(tokens_text):
            return
        e, scope = self._entries, self._scope
        with e.lock:
            e.replies[scope, text] = (list(tokens), text[len(tokens_text) :])
            e.replies.move_to_end((scope, text))
            shown = [_calls_key(calls)] if calls else []
            if content and content != text:
                shown.append(content)
            for key in shown:
                e.shown[scope, key] = (text, list(tokens), text[len(tokens_text) :])
                e.shown.move_to_end((scope, key))
            while len(e.replies) > e.capacity:
                e.replies.popitem(last=False)
            while len(e.shown) > e.capacity:
                e.shown.popitem(last=False)

    def lookup(self, text: str) -> tuple[list[int], str] | None:
        """The generated tokens of a reply whose text is exactly ``text``, and the text
        after them still to tokenize; None when no such reply is remembered."""
        e, key = self._entries, (self._scope, text)
        with e.lock:
            found = e.replies.get(key)
            if found is not None:
                e.replies.move_to_end(key)
        return None if found is None else (list(found[0]), found[1])

    def _ident(self, text: str) -> bytes:
        scope = "-" if self._scope is None else "+" + self._scope
        return f"{scope}\0{text}".encode()

    async def publish(self, text: str) -> bool:
        """Share the remembered reply ``text`` with the replicas of the remote server (for
        :data:`SHARED_REPLY_TTL`); whether the server holds it (False without one)."""
        shared = self._entries.shared
        found = self.lookup(text)
        if shared is None or found is None:
            return False
        value = msgspec.msgpack.encode(_Shared(self._scope, text, found[0], found[1]))
        return await shared.put("reply", self._ident(text), value, ttl=SHARED_REPLY_TTL)

    async def recall(
        self, texts: Iterable[str], check: Callable[[list[int], str, str], bool]
    ) -> int:
        """Learn which of ``texts`` (replies not remembered here) another replica generated,
        from the shared store; how many. ``check(tokens, text, rest)`` says whether the
        tokens make the text less its rest (a value from a store that trusts every writer
        is taken only then)."""
        shared = self._entries.shared
        if shared is None:
            return 0
        learnt = 0
        for text in dict.fromkeys(t for t in texts if self.lookup(t) is None):
            try:
                raw = await shared.get("reply", self._ident(text), max_bytes=MAX_SHARED_REPLY)
            except SharedValueError:
                continue  # refused (and deleted): the reply is placed as text
            if raw is None:
                continue
            try:
                got = msgspec.msgpack.decode(raw, type=_Shared)
            except msgspec.DecodeError:
                continue
            if got.scope != self._scope or got.text != text or not got.tokens:
                continue
            if not check(got.tokens, got.text, got.rest) or not text.endswith(got.rest):
                continue
            tokens_text = text[: len(text) - len(got.rest)]
            self.remember(text, got.tokens, tokens_text)
            learnt += 1
        return learnt

    def generated(
        self, *, content: str = "", calls: Sequence[tuple[str, str, str]] = ()
    ) -> tuple[str, list[int], str] | None:
        """The reply the caller saw as ``content``, or as the tool calls ``calls`` (id,
        name, canonical arguments: all three must match): the text generated, the tokens
        it was generated as and the text after them; None when not remembered."""
        e, key = self._entries, (self._scope, _calls_key(calls) if calls else content)
        with e.lock:
            found = e.shown.get(key)
            if found is not None:
                e.shown.move_to_end(key)
        return None if found is None else (found[0], list(found[1]), found[2])


def _calls_key(calls: Sequence[tuple[str, str, str]]) -> str:
    return "\0calls\0" + "\0\0".join("\0".join(call) for call in calls)
