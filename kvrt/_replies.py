"""The token ids of recent replies, by their text.

A reply sent back as an assistant message is placed with the tokens that were generated
(and whose KV was computed), not with a fresh tokenization of its text, which may differ:
so the reply and everything before it are reused, not recomputed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["ReplyMemory"]


class ReplyMemory:
    """A bounded map from reply text to the generated tokens, shared by a runtime's
    sessions; safe from any thread (sessions tokenize in worker threads).

    >>> memory = ReplyMemory(2)
    >>> memory.remember("Hello!", [9906, 0], "Hello!")
    >>> memory.lookup("Hello!"), memory.lookup("Hello")
    (([9906, 0], ''), None)
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[list[int], str]] = OrderedDict()
        self._shown: OrderedDict[str, str] = OrderedDict()
        """What a caller saw of a reply (its content, or its tool calls' ids) -> the text
        generated (a tool-call envelope)."""
        self._lock = threading.Lock()

    def remember(
        self,
        text: str,
        tokens: list[int],
        tokens_text: str,
        *,
        content: str | None = None,
        calls: list[str] | tuple[str, ...] = (),
    ) -> None:
        """``text`` was generated as ``tokens`` (whose own text is ``tokens_text``, a
        prefix of ``text`` when a stop sequence cut the last token short). ``content`` and
        ``calls`` (the ids of its tool calls) are what the caller got of it, when that is
        not ``text`` itself (a tool-call envelope)."""
        if not text or not tokens or not text.startswith(tokens_text):
            return
        with self._lock:
            self._entries[text] = (list(tokens), text[len(tokens_text) :])
            self._entries.move_to_end(text)
            shown = [_calls_key(calls)] if calls else []
            if content and content != text:
                shown.append(content)
            for key in shown:
                self._shown[key] = text
                self._shown.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            while len(self._shown) > self.capacity:
                self._shown.popitem(last=False)

    def lookup(self, text: str) -> tuple[list[int], str] | None:
        """The generated tokens of a reply whose text is exactly ``text``, and the text
        after them still to tokenize; None when no such reply is remembered."""
        with self._lock:
            found = self._entries.get(text)
            if found is not None:
                self._entries.move_to_end(text)
        return None if found is None else (list(found[0]), found[1])

    def generated(self, *, content: str = "", calls: tuple[str, ...] = ()) -> str | None:
        """The text generated for a reply the caller saw as ``content``, or as the tool
        calls with ids ``calls``; None when not remembered."""
        with self._lock:
            return self._shown.get(_calls_key(calls) if calls else content)


def _calls_key(ids: list[str] | tuple[str, ...]) -> str:
    return "\0calls\0" + "\0".join(ids)
