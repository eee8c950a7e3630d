"""The public session handle: sends commands to the session's actor and awaits replies."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskGroup

from .._chat.call_formats import CallFormat, call_format
from .._chat.grammar import Grammar
from .._chat.tools import Tool
from .._checks import check_bool, check_choice, check_int, check_number, check_text
from .._engine.contract import SamplingParams
from .._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    SessionClosedError,
)
from .._paging.segments import Segment
from .._paging.tokens import ReplyTokens
from .._reports import ContextStatus, Piece, SessionReport
from .._types import CacheClass
from .._util import NoPublicConstructor
from . import arguments
from .actor import Actor, Admit, Ensure, Evict, NextLogits
from .call import ChatCall
from .chat import ChatTemplate, Message, with_tools
from .generation import Generate
from .mailbox import Mailbox
from .prefetch import Prefetch
from .reply import Reply
from .saving import SavedSession, save_session

__all__ = ["Prefetch", "Session"]


class Session(metaclass=NoPublicConstructor):
    """One conversation's context on a shared model: a hot window backed by the cold store.

    Sessions come only from :meth:`kvrt.Runtime.open_session`::

        async with rt.open_session(hot_tokens=512) as session:
            status = await session.ensure_context([kvrt.Segment("user", "Hello")])
            async for piece in session.generate(max_tokens=32):
                print(piece.text, end="")

    Calls run one at a time, in the order they were made. Cancelling a call leaves the
    session consistent and usable, and loses no KV that had left the hot window: a running
    call is stopped at its next await point (at most one engine chunk away) and settled
    before the cancellation reaches the caller. Closing the session leaves its hot blocks
    to the cold store, where the next session with the same context finds them.
    """

    def __init__(self, actor: Actor, name: str, tg: TaskGroup, chat: ChatTemplate) -> None:
        self._actor = actor
        self._mail = Mailbox(actor, name)
        self._chat = chat
        self.name = name
        self.resumed: ContextStatus | None = None
        """What ``open_session(resume=...)`` restored and computed (None otherwise)."""
        self._tg = tg
        self._prefetches: set[Prefetch] = set()
        self._next: Prefetch | None = None
        """The newest prefetch, handed to the next ``ensure_context`` with its command."""

    @property
    def closed(self) -> bool:
        return self._mail.closed

    @property
    def progress(self) -> tuple[int, int] | None:
        """``(tokens computed, tokens to compute)`` of the long context a call is placing
        now (see ``long_context``), updated after each window; None when none is. Safe to
        read from any task: a long document takes minutes on a few cores."""
        return self._actor.contexts.progress

    # -- the API --

    async def ensure_context(
        self, segments: Sequence[Segment], *, require_visible: Iterable[str] = ()
    ) -> ContextStatus:
        """Make the session's context exactly ``segments``, in order.

        The resident prefix is reused, blocks with an exact cold-store hit are restored
        without compute, the rest is prefilled, and the hot window is kept within budget
        by the eviction policy. Returns what was reused, restored, prefilled and evicted.

        ``require_visible`` names segments the model must attend to: they stay hot (like the
        sinks) until the next context, or :class:`~kvrt.NotVisibleError` is raised before
        anything moves when they cannot all be hot at once.
        """
        segments = arguments.segments(segments)
        require = arguments.required(require_visible, segments)
        job, self._next = self._next, None
        if job is None or job.cancelled:
            result: ContextStatus = await self._mail.request(Ensure(segments, require=require))
            return result
        try:
            result = await self._mail.request(Ensure(segments, job.prepared(), require))
        finally:
            job.release()  # the call placed the context, failed or was dropped: unpin
        return result

    def prefetch(self, segments: Sequence[Segment], *, hold: float = 60.0) -> Prefetch:
        """Start preparing the context the next :meth:`ensure_context` will ask for.

        Returns at once; the work runs as a background task of the runtime. Call
        ``cancel()`` on the result to stop it, or ``await result.wait()`` for what it found.
        Prefetching never changes the session's context.
        """
        segments = arguments.segments(segments)
        hold = check_number("hold", hold, low=0.0)
        if self._mail.closed:
            raise SessionClosedError(f"session {self.name!r} is closed")
        job = Prefetch()
        for older in self._prefetches:
            older.cancel()  # the newest prefetch describes the next call
        self._prefetches.add(job)
        self._next = job
        self._tg.start_soon(job.run, self._actor, segments, hold, self._prefetched)
        return job

    def _prefetched(self, job: Prefetch) -> None:
        self._prefetches.discard(job)
        if self._next is job and job.cancelled:
            self._next = None

    def generate(
        self,
        max_tokens: int = 256,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        segment: str = "assistant",
        cache_class: CacheClass | str = CacheClass.VOLATILE,
        stop_at_end: bool = True,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
        buffer: int | None = None,
    ) -> Reply:
        """Continue the context: ``async for piece in reply`` streams one :class:`Piece`
        per token, ``await reply`` gives the :class:`Completion` (text, finish reason,
        usage, timings).

        Generated tokens join the context (as blocks of ``segment``). Generation goes on
        past the hot budget by evicting under policy, up to the planner context. It ends at
        ``max_tokens``, at the model's end-of-generation token (``stop_at_end``; the token
        stays out of the context) or at a ``stop`` sequence (left out of the text and of
        the context). ``temperature``, ``top_p``, ``top_k`` and ``seed`` set sampling
        (greedy by default); ``sampling`` (a :class:`SamplingParams` or a mapping of its
        fields) is the same, the keywords win. Arguments are checked here, before
        anything starts. Stopping early (``break``, ``aclose()``, cancellation) keeps
        what was generated so far.

        ``grammar`` (a :class:`kvrt.Grammar`: JSON Schema, regex, Lark or GBNF) makes the
        text match it: a token mask in kvrt's own sampler, so the same on every engine;
        generation ends when the grammar is complete. ``logprobs=N`` gives each piece
        (and the completion) the token's log-probability after the mask and the ``N``
        likeliest alternatives.

        The reply belongs to the task reading it. If that task calls the session again
        while the reply is open (inside the ``async for``, or after leaving it half-read),
        the reply is closed first: generation stops where it is, keeping what it
        generated, the loop ends, and the new call runs. Other tasks' calls wait their
        turn as usual.
        """
        return self._reply(
            max_tokens,
            arguments.sampling(
                sampling, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
            ),
            stop,
            buffer,
            segment=check_text("segment", segment, empty=False),
            cache_class=check_choice("cache_class", cache_class, CacheClass),
            stop_at_end=check_bool("stop_at_end", stop_at_end),
            grammar=arguments.grammar(grammar),
            logprobs=arguments.logprobs(logprobs),
        )

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Message] | ChatCall,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any] | Tool] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: Mapping[str, Any] | Grammar | None = None,
        logprobs: int | None = None,
        buffer: int | None = None,
    ) -> Reply:
        """Answer a conversation: OpenAI-style ``messages`` become the context, then the
        assistant's reply is generated (see :meth:`generate` for the reply and the other
        arguments).

        Each message is ``{"role": ..., "content": ...}`` (``system``, ``developer``,
        ``user``, ``assistant``, ``tool``; content a string, ``None`` or a list of text
        parts; an assistant's ``tool_calls`` and a tool's ``tool_call_id`` as OpenAI sends
        them). The model's chat template renders them, one segment per message, named
        ``"{index}:{role}"`` and classed ``task_pinned`` for system messages, ``volatile``
        otherwise; the extension keys ``segment`` and ``cache_class`` set a message's own.
        Send the whole conversation each turn: what is already in place is reused, what
        the cold store holds is restored, and a reply this runtime generated, sent back as
        an assistant message (with the same text, or with the tool calls it made), is
        placed with the tokens that were generated — so only the new messages are
        computed.

        ``tools`` (OpenAI function definitions) with ``tool_choice`` (``auto``, ``none``,
        ``required`` or ``{"type": "function", "function": {"name": ...}}``) and
        ``parallel_tool_calls`` (by default several calls, one when ``tool_choice`` names
        a function) let the model call them: the completion's ``tool_calls``
        (``finish_reason`` ``tool_calls``), their arguments valid against each tool's
        schema, enforced by a grammar. ``response_format`` (``json_object``, ``json_schema``,
        or kvrt's ``regex`` and ``grammar``; or a :class:`kvrt.Grammar`) makes the answer
        match it. ``logprobs=N`` reports each token's log-probability and the ``N``
        likeliest alternatives.

        ``messages`` may instead be a :class:`kvrt.ChatCall`, read and checked already
        (``ChatCall.read`` takes the same arguments): it is answered as it is, and the
        other arguments, but ``buffer``, are left out.
        """
        given: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "stop": stop,
            "sampling": sampling,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            "response_format": response_format,
            "logprobs": logprobs,
        }
        given = {name: value for name, value in given.items() if value is not None}
        if not isinstance(messages, ChatCall):
            return self._answer(ChatCall.read(messages, **given), buffer)
        if given:
            name = next(iter(given))
            raise InvalidArgumentError(
                f"{name} is given with a ChatCall, which carries its own: give the call alone",
                param=name,
            )
        return self._answer(messages, buffer)

    def _answer(self, call: ChatCall, buffer: int | None) -> Reply:
        """The reply to ``call``: its messages shown in the model's template, with its
        tools, then generated under its grammar."""
        tool_list, choice, grammar = call.tools, call.tool_choice, call.response_format
        if tool_list and not self._chat.has_template:
            raise InvalidArgumentError(
                "this model has no chat template (a base model), so it cannot be given tools: "
                "use a chat model",
                param="tools",
            )
        read = call.messages
        template = None
        if tool_list or any(m.role == "tool" or m.tool_calls for m in read):
            template = self._chat.tool_template()
        # The tools are shown whatever tool_choice is (the prompt, and its KV, stay the
        # same from step to step); the reply's grammar enforces the choice: under "none",
        # an answer in the form the model was taught, never a call.
        own = grammar is not None and call.response_schema is None  # a regex or grammar
        answered = bool(tool_list) and not own
        calls = call_format(
            template.call_style if template is not None else None,
            tool_list,
            wrapped=answered and call.response_schema is None,
        )
        if answered:
            grammar = calls.grammar(
                tool_list,
                choice,
                parallel=call.parallel_tool_calls,
                response_schema=call.response_schema,
            )
        shown, generated = with_tools(read, tool_list, self._actor.replies, calls)
        if template is not None:
            definitions = [tool.openai() for tool in tool_list] or None
            if definitions:
                self._chat.check_plain("a tool definition", json.dumps(definitions))
        else:
            definitions = None
        conversation = self._chat.conversation(
            shown,
            template=template,
            tools=definitions,
            classify=self._actor.policies.message_class.cache_class,
        )
        replies: dict[str, ReplyTokens] = {}
        recall: dict[str, str] = {}
        for i, (message, seg) in enumerate(zip(shown, conversation.segments, strict=False)):
            content = [text for text, special in seg.pieces() if not special]
            if message.role == "assistant" and content and content[-1]:
                mine = generated.get(i)  # the tokens of this very generation
                if mine is not None and mine[0] == content[-1]:
                    replies[seg.name] = mine
                    continue
                found = self._actor.replies.lookup(content[-1])
                if found is not None:
                    replies[seg.name] = (content[-1], *found)
                else:
                    recall[seg.name] = content[-1]
        return self._reply(
            call.max_tokens,
            call.sampling,
            call.stop,
            buffer,
            segment=conversation.reply,
            context=conversation.segments,
            replies=replies,
            recall=recall if self._actor.share else None,
            grammar=grammar,
            logprobs=call.logprobs,
            calls=calls if answered else None,
        )

    def complete(
        self,
        prompt: str,
        *,
        max_tokens: int = 256,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
        buffer: int | None = None,
    ) -> Reply:
        """Continue a plain-text ``prompt`` (no chat template): it becomes the context, as
        one segment named ``prompt``, and the continuation is generated in the same call
        (see :meth:`generate` for the reply and the other arguments)."""
        segment = Segment("prompt", check_text("prompt", prompt, empty=False))
        return self._reply(
            max_tokens,
            arguments.sampling(
                sampling, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
            ),
            stop,
            buffer,
            segment="completion",
            context=(segment,),
            grammar=arguments.grammar(grammar),
            logprobs=arguments.logprobs(logprobs),
        )

    def _reply(
        self,
        max_tokens: int,
        params: SamplingParams,
        stop: Any,
        buffer: int | None,
        *,
        segment: str,
        cache_class: CacheClass = CacheClass.VOLATILE,
        stop_at_end: bool = True,
        context: tuple[Segment, ...] | None = None,
        replies: dict[str, ReplyTokens] | None = None,
        recall: dict[str, str] | None = None,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
        calls: CallFormat | None = None,
    ) -> Reply:
        """The reply of a generation (with a context to place first), arguments checked."""
        max_tokens = check_int("max_tokens", max_tokens, low=0)
        stops = arguments.stops(stop)
        size = (
            self._actor.config.stream_buffer
            if buffer is None
            else check_int("buffer", buffer, low=1, high=4096)
        )
        send, receive = anyio.create_memory_object_stream[Piece](size)
        command = Generate(
            max_tokens,
            params,
            segment,
            cache_class,
            stop_at_end,
            stops,
            send,
            context=context,
            replies=replies,
            recall=recall,
            grammar=grammar,
            logprobs=logprobs,
            calls=calls,
        )
        return Reply(command, receive, self._mail)

    async def generate_text(self, max_tokens: int = 256, **kwargs: Any) -> str:
        """The whole continuation as one string (see :meth:`generate`)."""
        completion = await self.generate(max_tokens, **kwargs)
        return completion.text

    async def next_logits(self) -> npt.NDArray[np.float32]:
        """The model's logits for the token after the context (a copy, one per vocabulary
        entry): what :meth:`generate` would draw its first token from, before any grammar
        mask or sampling. Computes the context's last token again only when nothing holds
        its logits."""
        result: npt.NDArray[np.float32] = await self._mail.request(NextLogits())
        return result

    async def evict(self, target: str | tuple[int, int]) -> int:
        """Move a segment (by name) or the blocks inside a position range to the cold store.

        Returns the number of tokens that left the hot window.
        """
        result: int = await self._mail.request(Evict(arguments.target(target)))
        return result

    async def admit(self, target: str | tuple[int, int]) -> int:
        """Restore a segment's (or range's) cold blocks into the hot window, in place."""
        result: int = await self._mail.request(Admit(arguments.target(target)))
        return result

    async def save(self, path: str | os.PathLike[str]) -> SavedSession:
        """Write the context's layout (segments, token ids, block keys) to ``path`` once
        its blocks are in the cold tiers, for ``rt.open_session(resume=path)`` in a later
        process; see :mod:`kvrt._session.saving` for what is and is not saved."""
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"path must be a str or a path, got {type(path).__name__}")
        return await save_session(self._actor, self._mail.request, path)

    def explain(self) -> SessionReport:
        """Sizes, every block with its class and residency, cold-store and mailbox figures."""
        return self._actor.report(self.name, closed=self._mail.closed)

    async def aclose(self) -> None:
        """Stop the session: pending calls fail, the hot blocks are offered to the cold
        store (as the cold admission policy allows), then the engine context is freed."""
        if self._mail.closed:
            await self._actor.finished.wait()
            return
        for job in list(self._prefetches):
            job.cancel()
        self._actor.closing()  # another session placing this context waits for its copies
        self._mail.close()  # the actor drains what is queued, then stops
        await self._actor.finished.wait()
