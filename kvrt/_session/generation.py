"""Generation: the context's continuation, token by token, streamed to its reader.

Generated tokens join the context as they are computed. A stop sequence ends generation
and leaves the context (with the tokens it overlaps); the end-of-generation token never
enters it. Text that could still begin a stop sequence is held back, so a reader never
sees part of one. The reply's tokens are remembered by text, so the reply sent back as a
message next turn is placed with them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import anyio
import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectSendStream

from .._chat.call_formats import CallFormat, CallStream
from .._chat.grammar import Constraint, Grammar
from .._chat.sampling import Sampler, log_softmax
from .._chat.stops import TextTail
from .._chat.tools import ToolCall, ToolCallDelta
from .._engine.contract import Logits, SamplingParams
from .._errors import ContextNotPlacedError, InvalidRangeError
from .._paging.gate import EngineGate, Tally, Written
from .._paging.long import LongContext
from .._paging.moves import Paging
from .._paging.placement import Placement
from .._paging.segments import Segment
from .._paging.tokens import ReplyTokens
from .._reports import ContextStatus, Piece, TokenLogprob, TokenOrigins
from .._threads import in_thread
from .._types import CacheClass, Residency

__all__ = ["Generate", "Generated", "Generation"]


@dataclass(frozen=True, slots=True)
class Generate:
    max_tokens: int
    sampling: SamplingParams
    segment: str
    cache_class: CacheClass
    stop_at_end: bool
    stop: tuple[str, ...]
    out: MemoryObjectSendStream[Piece]
    context: tuple[Segment, ...] | None = None
    """A context to place first, in the same call (``chat``, ``complete``)."""
    replies: Mapping[str, ReplyTokens] | None = None
    recall: Mapping[str, str] | None = None
    """Segments holding a reply not remembered here (name -> its text): another replica
    sharing the remote server may have generated it."""
    grammar: Grammar | None = None
    """What the generated text must match (enforced by a token mask)."""
    logprobs: int | None = None
    """Report each token's log-probability and this many likeliest alternatives."""
    calls: CallFormat | None = None
    """The format the reply's tool calls are written in (:mod:`kvrt._chat.call_formats`), when
    it may call tools."""


@dataclass(frozen=True, slots=True)
class Generated:
    """What one generation did; the session handle makes a ``Completion`` of it."""

    text: str
    """The reply's content (with tools, without the envelope)."""
    raw_text: str
    """The text as generated."""
    tool_calls: tuple[ToolCall, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    tokens: tuple[int, ...]
    """The generated tokens that stayed in the context."""
    produced: int
    finish_reason: str
    prompt_tokens: int
    prompt: TokenOrigins
    """Where each prompt token's KV came from when generation began."""
    visible_tokens: int
    invisible_segments: tuple[str, ...]
    placed: ContextStatus | None
    """What placing ``Generate.context`` did, when one came with the call."""
    status: ContextStatus
    """What generating did (restores or recomputes it needed), and the context after it."""
    began: float
    placed_at: float
    first_token_at: float | None
    ended: float


class Generation:
    """Continues the context, streaming pieces."""

    def __init__(
        self, gate: EngineGate, paging: Paging, placement: Placement, contexts: LongContext
    ) -> None:
        self.gate, self.paging, self.placement = gate, paging, placement
        self.contexts = contexts
        self.engine, self.ctx, self.window = gate.engine, gate.ctx, gate.window

    async def generate(self, cmd: Generate) -> Generated:
        began = time.perf_counter()
        sampler = Sampler(cmd.sampling, self.engine.facts.n_vocab)  # a bad bias: before any work
        placed = None
        placing = Tally()
        self.gate.served.left = cmd.max_tokens
        if cmd.context is not None:
            replies = await self._recalled(cmd)
            placed, placing = await self.contexts.ensure(cmd.context, replies=replies)
        placed_at = time.perf_counter()
        self.gate.counters.generate_calls += 1
        tally = Tally()
        tail = TextTail(cmd.stop if cmd.calls is None else ())
        stream = cmd.calls.stream() if cmd.calls is not None else None
        constraint = None
        if cmd.grammar is not None:  # the first one on an engine reads its vocabulary
            constraint = await in_thread(Constraint, self.engine, cmd.grammar)
        chosen: list[TokenLogprob] = []
        produced, first_at, finish = 0, None, "length"
        pending: Piece | None = None
        async with cmd.out:
            self.check_placed()
            start = self.window.length
            tally += await self.placement.last_logits()
            prompt = self.gate.origins([placing, tally], end=start)
            visible = self.gate.residency_tokens()[Residency.HOT]
            invisible = self.gate.invisible_segments()
            hidden = self.contexts.hidden_tokens  # a long context: the rest of its window
            if hidden:
                prompt = msgspec.structs.replace(prompt, not_hot=prompt.not_hot + hidden)
                invisible = self.contexts.hidden_segments
            if self.gate.override is not None:
                logits: Logits = self.gate.override
            else:
                logits = await self.gate.logits()
            self.gate.override = None
            label = self.gate.label_at(self.window.length)[0]
            while produced < cmd.max_tokens:
                if constraint is not None:
                    logits = constraint.mask(logits)
                token = sampler.choose(logits)
                logprob = None
                if cmd.logprobs is not None:
                    logprob = self._logprob(logits, token, cmd.logprobs)
                if cmd.stop_at_end and self.engine.is_end_of_generation(token):
                    finish = "eos"
                    break
                if self.window.length >= self.window.planner_context:
                    break
                if constraint is not None:
                    constraint.consume(token)
                last = self.window.blocks[-1]
                moved = await self.paging.make_room(1, {last.id})
                tally += moved
                at = self.window.length
                if moved.evicted:  # the window lost earlier tokens
                    label = self.gate.label_at(at)[0]
                place = self.window.append_place(cmd.segment)
                marks = [Written(at, at + 1, label, "generated", place, frozenset({at}))]
                logits = await self.gate.call(
                    "step", self.ctx.step, token, writes=marks, join=self.gate.joint_step(token)
                )
                tally.wrote(marks)
                self.window.append_token(token, cmd.segment, cmd.cache_class)
                produced += 1
                self.gate.served.left = cmd.max_tokens - produced
                self.gate.counters.generated_tokens += 1
                if logprob is not None:
                    chosen.append(logprob)
                text, calls = _split(stream, tail.feed(self.engine.token_bytes(token)))
                piece = Piece(
                    text=text, token=token, index=produced - 1, tool_calls=calls, logprob=logprob
                )
                first_at = first_at or time.perf_counter()
                if self.gate.fault is not None:
                    self.gate.fault("stream")
                # A piece whose text is partly held back waits for the next one, which may
                # release the rest: the last piece then carries everything released.
                if pending is not None and not await _send(cmd.out, pending):
                    pending, finish = None, "closed"
                    break
                pending = None
                if tail.stopped:
                    pending, finish = piece, "stop"
                    break
                if tail.holding:
                    pending = piece
                elif not await _send(cmd.out, piece):
                    finish = "closed"
                    break
                if constraint is not None and constraint.done:
                    finish = "stop"  # the grammar admits nothing more
                    break
                if stream is not None and stream.repeated:
                    finish = "stop"  # a call again, as it was: the reply ends at it
                    break
            text, calls = _split(stream, tail.finish())
            if pending is not None:
                pending = msgspec.structs.replace(
                    pending, text=pending.text + text, tool_calls=pending.tool_calls + calls
                )
                await _send(cmd.out, pending)
        await self.gate.settle()
        kept = tail.kept_tokens
        tokens = tuple(t for b in self.window.blocks for t in b.tokens)[start : start + kept]
        if tail.stopped:
            tally += await self._drop_from(start + kept)
        content, tool_calls = tail.text, cast(tuple[ToolCall, ...], ())
        if stream is not None:
            # The calls as they were streamed (each distinct complete one, even when
            # max_tokens cut the envelope short); the content from the whole text.
            tool_calls = tuple(stream.calls)
            if tool_calls:
                content = ""
            elif stream.decided:
                content = stream.content  # complete, or cut short by max_tokens
            else:
                content = stream.undecided(tail.text)
            # Cut by max_tokens (or a full window), the reply says so, whatever calls it
            # completed before (a call cut short is not one: its arguments are not JSON).
            if tool_calls and finish not in ("closed", "length"):
                finish = "tool_calls"
        called = [(call.id, call.name, call.arguments) for call in tool_calls]
        remembered = tail.text  # the reply's text as the memory holds it
        if stream is None or not stream.repeated:
            self.gate.replies.remember(
                tail.text,
                list(tokens),
                tail.kept_text,
                content=content if stream is not None and content != tail.text else None,
                calls=called,
            )
        elif cmd.calls is not None and tool_calls:
            # A reply cut at a repeated call is sent back as its distinct calls, rendered
            # whole (a closed envelope), not as the cut text: the context keeps the tokens
            # it shares with that rendering, and the next turn places them and the rest
            # (the envelope's close), so the calls' KV is reused, not computed again.
            rendered = cmd.calls.render("", [(name, args) for _, name, args in called])
            shared, shared_text = _shared_prefix(self.engine.token_bytes, tokens, rendered)
            if shared < len(tokens):
                tally += await self._drop_from(start + shared)
                tokens = tokens[:shared]
            self.gate.replies.remember(rendered, list(tokens), shared_text, calls=called)
            remembered = rendered
        if self.gate.share:  # another replica continues as this one would
            await self.gate.replies.publish(remembered)
            await self.paging.share(self.window.blocks)
        self.gate.record(tally)
        status = self.contexts.told(self.gate.status(tally))
        return Generated(
            text=content,
            raw_text=tail.text,
            tool_calls=tool_calls,
            logprobs=tuple(chosen) if cmd.logprobs is not None else None,
            tokens=tokens,
            produced=produced,
            finish_reason=finish,
            prompt_tokens=start + hidden,
            prompt=prompt,
            visible_tokens=visible,
            invisible_segments=invisible,
            placed=placed,
            status=status,
            began=began,
            placed_at=placed_at,
            first_token_at=first_at,
            ended=time.perf_counter(),
        )

    async def _recalled(self, cmd: Generate) -> Mapping[str, ReplyTokens] | None:
        """``cmd.replies``, with the replies of ``cmd.recall`` another replica generated."""
        if not cmd.recall:
            return cmd.replies
        await self.gate.replies.recall(cmd.recall.values(), self._makes)
        found = dict(cmd.replies or {})
        for name, text in cmd.recall.items():
            tokens = self.gate.replies.lookup(text)
            if tokens is not None:
                found[name] = (text, *tokens)
        return found

    def _makes(self, tokens: list[int], text: str, rest: str) -> bool:
        """Whether ``tokens`` are this model's tokens of ``text`` less its ``rest``."""
        if not all(0 <= t < self.engine.facts.n_vocab for t in tokens):
            return False
        made = b"".join(self.engine.token_bytes(t) for t in tokens)
        return made.decode("utf-8", errors="replace") == text[: len(text) - len(rest)]

    def check_placed(self) -> None:
        """Refuse to continue a context that is empty or was not placed whole."""
        if self.window.length == 0:
            raise InvalidRangeError("nothing to continue: call ensure_context first")
        if not self.gate.placed:
            raise ContextNotPlacedError(
                "the last ensure_context was cancelled or failed before its context was in "
                "place: send the context again (ensure_context, chat or complete)"
            )

    def _logprob(self, logits: Logits, token: int, top: int) -> TokenLogprob:
        """``token``'s log-probability under ``logits`` (masked, if a grammar applies),
        with the ``top`` likeliest tokens."""
        lp = log_softmax(logits)
        best: list[TokenLogprob] = []
        if top:
            ids = np.argpartition(-lp, min(top, len(lp) - 1))[:top]
            ids = ids[np.argsort(-lp[ids], kind="stable")]
            best = [self._token_logprob(int(t), float(lp[t])) for t in ids if lp[t] > -np.inf]
        return msgspec.structs.replace(
            self._token_logprob(token, float(lp[token])), top=tuple(best)
        )

    def _token_logprob(self, token: int, logprob: float) -> TokenLogprob:
        raw = self.engine.token_bytes(token)
        return TokenLogprob(
            token=token, text=raw.decode("utf-8", errors="replace"), raw=raw, logprob=logprob
        )

    async def _drop_from(self, position: int) -> Tally:
        """Remove the context from ``position`` on (a stop sequence): nothing to keep."""
        self.window.truncate(position)
        tail = [p for p in self.ctx.positions if p >= position]
        return await self.gate.drop(tail[0], tail[-1] + 1) if tail else Tally()


def _shared_prefix(
    token_bytes: Callable[[int], bytes], tokens: Sequence[int], text: str
) -> tuple[int, str]:
    """How many of ``tokens`` spell a prefix of ``text``, and that prefix."""
    want, have, kept = text.encode(), b"", 0
    for token in tokens:
        more = have + token_bytes(token)
        if not want.startswith(more):
            break
        have, kept = more, kept + 1
    while kept:  # a prefix that ends inside a character is cut before it
        try:
            return kept, have.decode()
        except UnicodeDecodeError:
            kept -= 1
            have = have[: len(have) - len(token_bytes(tokens[kept]))]
    return 0, ""


def _split(stream: CallStream | None, released: str) -> tuple[str, tuple[ToolCallDelta, ...]]:
    """Released text as a piece's content and tool-call deltas (all content without an
    envelope)."""
    if stream is None:
        return released, ()
    deltas = list(stream.feed(released)) if released else []
    text = "".join(d for d in deltas if isinstance(d, str))
    return text, tuple(d for d in deltas if not isinstance(d, str))


async def _send(out: MemoryObjectSendStream[Piece], piece: Piece) -> bool:
    """Hand ``piece`` to the reader; False when the reader has gone (stop, keeping what
    was generated)."""
    try:
        await out.send(piece)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False
    return True
