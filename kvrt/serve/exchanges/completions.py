"""The Chat Completions and Completions surfaces: a request read into its turn in a
worker thread (its grammars compiled there), answered with a completion object or its
chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import msgspec

import kvrt

from ..protocol import Turn, chat, completions
from ..protocol.wire import completion_id
from ..streaming import Started
from .exchange import Desk

__all__ = ["ChatCompletions", "Completions"]


class _Chunks(Protocol):
    def start(self) -> Sequence[msgspec.Struct]: ...

    def piece(self, piece: kvrt.Piece) -> Sequence[msgspec.Struct]: ...

    def finish(self, done: kvrt.Completion) -> Sequence[msgspec.Struct]: ...


class _Streamed:
    """A request answered with one object, or streamed as its chunks."""

    error_event = None

    def __init__(self, turn: Turn, answer: _Answer, chunks: _Chunks) -> None:
        self.turn, self._answer, self._chunks = turn, answer, chunks

    async def reply(self, done: kvrt.Completion) -> msgspec.Struct:
        return self._answer(done)

    async def events(self, answer: Started) -> AsyncIterator[msgspec.Struct]:
        for chunk in self._chunks.start():
            yield chunk
        async for piece in answer:
            for chunk in self._chunks.piece(piece):
                yield chunk
        for chunk in self._chunks.finish(await answer):
            yield chunk


class _Answer(Protocol):
    def __call__(self, done: kvrt.Completion) -> msgspec.Struct: ...


class ChatCompletions:
    """``POST /v1/chat/completions``."""

    name = "chat"

    async def open(self, body: bytes, tenant: str | None, desk: Desk) -> _Streamed:
        asked = await desk.off_loop(chat.read_chat, body, desk.limits)
        rid, model = completion_id("chatcmpl"), desk.limits.model

        def answer(done: kvrt.Completion) -> msgspec.Struct:
            return chat.chat_response(rid, model, done, legacy=asked.legacy)

        stream = chat.ChatStream(rid, model, include_usage=asked.include_usage, legacy=asked.legacy)
        return _Streamed(asked.turn, answer, stream)


class Completions:
    """``POST /v1/completions``."""

    name = "completions"

    async def open(self, body: bytes, tenant: str | None, desk: Desk) -> _Streamed:
        asked = await desk.off_loop(completions.read_completion, body, desk.limits)
        rid, model = completion_id("cmpl"), desk.limits.model

        def answer(done: kvrt.Completion) -> msgspec.Struct:
            return completions.completion_response(rid, model, done)

        stream = completions.CompletionStream(rid, model, include_usage=asked.include_usage)
        return _Streamed(asked.turn, answer, stream)
