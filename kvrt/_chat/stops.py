"""Generated tokens to released text: stop sequences found, and text held back while it
could still begin one.

Pure and synchronous: the session actor feeds it each token's bytes and streams what it
releases. A reader never sees text that turns out to be part of a stop sequence, and
never sees half a UTF-8 character.
"""

from __future__ import annotations

import codecs

__all__ = ["TextTail"]


class TextTail:
    """The text of one generation, token by token.

    >>> tail = TextTail(("\\n\\n",))
    >>> tail.feed(b"Hi\\n"), tail.feed(b"\\nBye")
    ('Hi', '')
    >>> tail.stopped, tail.text, tail.kept_tokens
    (True, 'Hi', 0)
    """

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._all = ""  # every decoded character so far
        self._released = 0  # characters handed out
        self._ends: list[int] = []  # per token: where its text ends in ``_all``
        self._whole: list[bool] = []  # per token: no character left incomplete after it
        self._stop_at: int | None = None

    @property
    def stopped(self) -> bool:
        """A stop sequence was generated."""
        return self._stop_at is not None

    @property
    def text(self) -> str:
        """The text released so far (everything before the stop sequence, once found)."""
        return self._all[: self._released]

    @property
    def holding(self) -> bool:
        """Text (or part of a character) is held back, to be released later or dropped."""
        return self._released < len(self._all) or self._decoder.getstate()[0] != b""

    @property
    def kept_tokens(self) -> int:
        """How many leading tokens lie wholly before the stop sequence (all of them when no
        stop was found): the tokens that stay in the context."""
        if self._stop_at is None:
            return len(self._ends)
        kept = 0
        for i, (end, whole) in enumerate(zip(self._ends, self._whole, strict=True)):
            if end > self._stop_at:
                break
            if whole:
                kept = i + 1
        return kept

    @property
    def kept_text(self) -> str:
        """The text of the :attr:`kept_tokens` (a prefix of :attr:`text`)."""
        kept = self.kept_tokens
        return self._all[: self._ends[kept - 1]] if kept else ""

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; the text released by it (possibly empty)."""
        if self._stop_at is not None:
            raise RuntimeError("generation already stopped")
        self._all += self._decoder.decode(data)
        self._ends.append(len(self._all))
        self._whole.append(self._decoder.getstate()[0] == b"")
        found = [i for i in (self._all.find(s, self._released) for s in self.stops) if i >= 0]
        if found:
            self._stop_at = min(found)
            return self._release(self._stop_at)
        return self._release(len(self._all) - self._stop_prefix())

    def finish(self) -> str:
        """Generation ended without a stop sequence: release everything still held."""
        if self._stop_at is not None:
            return ""
        self._all += self._decoder.decode(b"", final=True)
        if self._ends:
            self._ends[-1] = len(self._all)
            self._whole[-1] = True
        return self._release(len(self._all))

    def _release(self, upto: int) -> str:
        out = self._all[self._released : upto]
        self._released = max(self._released, upto)
        return out

    def _stop_prefix(self) -> int:
        """Length of the longest end of the text that begins some stop sequence."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self._all) - self._released), best, -1):
                if self._all.endswith(stop[:k]):
                    best = k
                    break
        return best
