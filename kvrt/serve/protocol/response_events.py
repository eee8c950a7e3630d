"""The event stream of one response (``POST /v1/responses`` with ``stream: true``), as
the OpenAI Agents SDK consumes it: typed events built from the reply's pieces and its
completion by :class:`ResponseEvents`. Pure: no server, no event loop."""

from __future__ import annotations

import msgspec

import kvrt

from .responses import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    Problem,
    ResponseBody,
    ResponsesRequest,
    message_item,
    output_items,
    response_body,
)
from .wire import LogprobBody, logprob_body, object_id

__all__ = ["ResponseEvent", "ResponseEvents"]


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    sequence_number: int


class Created(_Event, frozen=True, kw_only=True, tag="response.created"):
    response: ResponseBody


class InProgress(_Event, frozen=True, kw_only=True, tag="response.in_progress"):
    response: ResponseBody


class Completed(_Event, frozen=True, kw_only=True, tag="response.completed"):
    response: ResponseBody


class Incomplete(_Event, frozen=True, kw_only=True, tag="response.incomplete"):
    response: ResponseBody


class Failed(_Event, frozen=True, kw_only=True, tag="response.failed"):
    response: ResponseBody


class ItemAdded(_Event, frozen=True, kw_only=True, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class ItemDone(_Event, frozen=True, kw_only=True, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class PartAdded(_Event, frozen=True, kw_only=True, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class PartDone(_Event, frozen=True, kw_only=True, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDelta(_Event, frozen=True, kw_only=True, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[LogprobBody]


class TextDone(_Event, frozen=True, kw_only=True, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[LogprobBody]


class ArgumentsDelta(
    _Event, frozen=True, kw_only=True, tag="response.function_call_arguments.delta"
):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(_Event, frozen=True, kw_only=True, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


ResponseEvent = (
    Created
    | InProgress
    | Completed
    | Incomplete
    | Failed
    | ItemAdded
    | ItemDone
    | PartAdded
    | PartDone
    | TextDelta
    | TextDone
    | ArgumentsDelta
    | ArgumentsDone
)
"""An event of a response's stream (its ``type`` is its tag)."""


class ResponseEvents:
    """The event stream of one response, as the Agents SDK reads it, built from what the
    server feeds it (the shape of h11: no I/O here): :meth:`start` (created, in
    progress), :meth:`piece` for each piece of the reply (output items added, deltas),
    :meth:`finish` with the completion (each item done; the response object), then
    :meth:`completed` once what the response adds is kept, or :meth:`failed` when it
    could not be."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, created: float) -> None:
        self.rid, self.model, self.req, self.created = rid, model, req, created
        self._seq = 0
        self._ids: dict[str, str] = {}
        self._index: dict[str, int] = {}

    def _next(self) -> int:
        self._seq += 1
        return self._seq - 1

    def start(self) -> list[ResponseEvent]:
        head = response_body(
            self.rid, self.model, self.req, created=self.created, output=[], done=None
        )
        return [
            Created(sequence_number=self._next(), response=head),
            InProgress(sequence_number=self._next(), response=head),
        ]

    def _open_message(self, mid: str) -> list[ResponseEvent]:
        self._ids["message"] = mid
        self._index["message"] = at = len(self._index)
        return [
            ItemAdded(sequence_number=self._next(), output_index=at, item=message_item(mid, None)),
            PartAdded(
                sequence_number=self._next(),
                item_id=mid,
                output_index=at,
                content_index=0,
                part=OutputText(text=""),
            ),
        ]

    def piece(self, piece: kvrt.Piece) -> list[ResponseEvent]:
        out: list[ResponseEvent] = []
        ids, index = self._ids, self._index
        if piece.text:
            if "message" not in ids:
                out += self._open_message(object_id("msg"))
            logprobs = [] if piece.logprob is None else [logprob_body(piece.logprob)]
            delta = TextDelta(
                sequence_number=self._next(),
                item_id=ids["message"],
                output_index=index["message"],
                content_index=0,
                delta=piece.text,
                logprobs=logprobs,
            )
            out.append(delta)
        for d in piece.tool_calls:
            key = f"call:{d.index}"
            if d.id is not None:
                ids[key] = ids[d.id] = object_id("fc")
                index[key] = len(index)
                item = FunctionCallItem(
                    id=ids[key],
                    call_id=d.id,
                    name=d.name or "",
                    arguments="",
                    status="in_progress",
                )
                out.append(
                    ItemAdded(sequence_number=self._next(), output_index=index[key], item=item)
                )
            if d.arguments:
                out.append(
                    ArgumentsDelta(
                        sequence_number=self._next(),
                        item_id=ids[key],
                        output_index=index[key],
                        delta=d.arguments,
                    )
                )
        return out

    def finish(self, done: kvrt.Completion) -> tuple[list[ResponseEvent], ResponseBody]:
        """Each output item done, and the response object (to keep, then to announce)."""
        out: list[ResponseEvent] = []
        ids, index = self._ids, self._index
        output = output_items(done, ids)
        for item in output:
            if isinstance(item, MessageItem):
                if "message" not in ids:  # no text at all: announce the empty message now
                    out += self._open_message(item.id)
                at = index["message"]
                part = item.content[0]
                out.append(
                    TextDone(
                        sequence_number=self._next(),
                        item_id=item.id,
                        output_index=at,
                        content_index=0,
                        text=part.text,
                        logprobs=[logprob_body(t) for t in done.logprobs or ()],
                    )
                )
                out.append(
                    PartDone(
                        sequence_number=self._next(),
                        item_id=item.id,
                        output_index=at,
                        content_index=0,
                        part=part,
                    )
                )
            else:
                found = [k for k, v in ids.items() if v == item.id and k.startswith("call:")]
                at = index[found[0]] if found else len(index)
                out.append(
                    ArgumentsDone(
                        sequence_number=self._next(),
                        item_id=item.id,
                        output_index=at,
                        arguments=item.arguments,
                    )
                )
            out.append(ItemDone(sequence_number=self._next(), output_index=at, item=item))
        body = response_body(
            self.rid, self.model, self.req, created=self.created, output=output, done=done
        )
        return out, body

    def completed(self, body: ResponseBody) -> ResponseEvent:
        if body.status == "completed":
            return Completed(sequence_number=self._next(), response=body)
        return Incomplete(sequence_number=self._next(), response=body)

    def failed(self, body: ResponseBody, code: str, message: str) -> ResponseEvent:
        """The stream's end when what the response adds could not be kept."""
        problem = Problem(code=code, message=message)
        failed = msgspec.structs.replace(body, status="failed", error=problem)
        return Failed(sequence_number=self._next(), response=failed)
