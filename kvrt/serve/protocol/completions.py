"""Completions (``POST /v1/completions``): a request body read into one typed kvrt call
(:func:`read_completion`), and the call's result written as the API's response
(:func:`completion_response`) or stream chunks (:class:`CompletionStream`). Pure: no
server, no event loop. ``n`` above 1, penalties and ``echo`` are refused with a 400
naming them."""

from __future__ import annotations

import time

import msgspec
from msgspec import UNSET, UnsetType

import kvrt

from .call import Limits, Prompt, Turn, sampled
from .errors import RequestError
from .wire import (
    FINISH,
    STREAM_END,
    CommonRequest,
    StreamEnd,
    UsageBody,
    decode_request,
    usage_body,
)

__all__ = [
    "CompletionAsked",
    "CompletionRequest",
    "CompletionStream",
    "TextCompletion",
    "completion_response",
    "read_completion",
]


class CompletionRequest(CommonRequest, kw_only=True):
    prompt: str | list[str]
    echo: bool | None = None


class CompletionAsked(msgspec.Struct, frozen=True, kw_only=True):
    """A completions request, read: its turn, and how it is answered."""

    turn: Turn
    include_usage: bool = False
    """A stream ends with a usage chunk."""


def read_completion(body: bytes, limits: Limits) -> CompletionAsked:
    """``POST /v1/completions``'s body as the ``session.complete`` call it asks for."""
    req = decode_request(body, CompletionRequest)
    req.check()
    if req.echo:
        raise RequestError("echo is not supported by kvrt", param="echo")
    limits.check_model(req.model)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise RequestError("prompt must be one string", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise RequestError("prompt is empty", param="prompt")
    logprobs = req.logprobs
    if logprobs is None or logprobs is False:
        logprobs = None
    elif isinstance(logprobs, bool) or not 0 <= logprobs <= 5:
        raise RequestError("logprobs must be an integer from 0 to 5", param="logprobs")
    s = sampled(
        limits,
        max_tokens=req.max_tokens,
        default=16,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        logit_bias=req.logit_bias,
        logprobs=logprobs,
    )
    call = Prompt(
        prompt=prompt,
        max_tokens=s.max_tokens,
        sampling=s.sampling,
        stop=s.stop,
        logprobs=s.logprobs,
    )
    turn = Turn(call=call, stream=req.stream, cache_salt=req.cache_salt)
    return CompletionAsked(turn=turn, include_usage=req.include_usage)


class TextLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int] | UnsetType = UNSET


class TextChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str
    logprobs: TextLogprobs | None
    finish_reason: str | None


class TextCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A text completion object, or one chunk of a streamed one."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageBody | UnsetType = UNSET


def _logprobs(tokens: tuple[kvrt.TokenLogprob, ...], *, offsets: bool) -> TextLogprobs:
    at, offset = 0, []
    for t in tokens:
        offset.append(at)
        at += len(t.text)
    return TextLogprobs(
        tokens=[t.text for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[{a.text: a.logprob for a in t.top} for t in tokens],
        text_offset=offset if offsets else UNSET,
    )


def completion_response(rid: str, model: str, done: kvrt.Completion) -> TextCompletion:
    logprobs = None if done.logprobs is None else _logprobs(done.logprobs, offsets=True)
    choice = TextChoice(text=done.text, logprobs=logprobs, finish_reason=FINISH[done.finish_reason])
    return TextCompletion(
        id=rid, created=int(time.time()), model=model, choices=[choice], usage=usage_body(done)
    )


class CompletionStream:
    """The chunks of one streamed completion, built from what the server feeds it:
    :meth:`start` (nothing), :meth:`piece` for each piece, :meth:`finish` with the
    completion."""

    def __init__(self, rid: str, model: str, *, include_usage: bool) -> None:
        self.rid, self.model, self.include_usage = rid, model, include_usage
        self.created = int(time.time())

    def _chunk(
        self, choices: list[TextChoice], used: UsageBody | UnsetType = UNSET
    ) -> TextCompletion:
        return TextCompletion(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=used
        )

    def start(self) -> list[TextCompletion]:
        return []

    def piece(self, piece: kvrt.Piece) -> list[TextCompletion]:
        if not (piece.text or piece.logprob is not None):
            return []
        logprobs = None
        if piece.logprob is not None:
            logprobs = _logprobs((piece.logprob,), offsets=False)
        choice = TextChoice(text=piece.text, logprobs=logprobs, finish_reason=None)
        return [self._chunk([choice])]

    def finish(self, done: kvrt.Completion) -> list[TextCompletion | StreamEnd]:
        """The finish chunk, the usage chunk when asked for, and the end."""
        ended = TextChoice(text="", logprobs=None, finish_reason=FINISH[done.finish_reason])
        out: list[TextCompletion | StreamEnd] = [self._chunk([ended])]
        if self.include_usage:
            out.append(self._chunk([], usage_body(done)))
        out.append(STREAM_END)
        return out
