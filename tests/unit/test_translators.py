"""The API translators without a server or a model (the shape of h11): a request body in,
one typed kvrt call out, or a refusal naming the parameter as the client sent it; a
reply's pieces and completion in, the Responses API's events out."""

from __future__ import annotations

import json
from typing import Any

import pytest

import kvrt
from kvrt.serve.protocol import Limits, RequestError, Turn, conversations, responses, sse
from kvrt.serve.protocol import chat as chat_api
from kvrt.serve.protocol import completions as completions_api
from kvrt.serve.protocol.response_events import ResponseEvents

LIMITS = Limits(model="m", context=2048, n_vocab=1000, default_max_tokens=64)
BAD_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**30}}}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def chat_body(**fields: Any) -> bytes:
    return body(messages=[{"role": "user", "content": "Hi"}], **fields)


def refused(read: Any, *args: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        read(*args)
    return info.value


def test_a_chat_request_is_one_typed_call() -> None:
    asked = chat_api.read_chat(
        chat_body(stream=True, stream_options={"include_usage": True}, cache_salt="s"), LIMITS
    )
    turn = asked.turn
    assert isinstance(turn, Turn) and isinstance(turn.call, kvrt.ChatCall)
    assert turn.call.messages == (kvrt.Message(role="user", content="Hi"),)
    assert turn.call.max_tokens == 64 and turn.call.sampling.temperature == 1.0
    assert turn.stream and asked.include_usage and turn.cache_salt == "s"
    assert turn.history == turn.call.messages
    completion = completions_api.read_completion(body(prompt=["Once"]), LIMITS).turn
    assert completion.history == "Once"
    assert not isinstance(completion.call, kvrt.ChatCall) and completion.call.max_tokens == 16


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": "other"}, "model"),
        ({"max_tokens": 4096}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"logit_bias": {"5000": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"stop": ["", "x"]}, "stop[0]"),
        ({"stop": ["x"] * 17}, "stop"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_bad_chat_request_names_its_parameter(fields: dict[str, Any], param: str) -> None:
    """kvrt's errors carry the parameter they are about; the message names it the same way
    (nothing rewrites it)."""
    sent = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    error = refused(chat_api.read_chat, body(**sent), LIMITS)
    assert error.status == 400 and error.param == param, (error.param, str(error))
    if "[" in param or "." in param:
        assert param in str(error)


def responses_request(**fields: Any) -> responses.ResponsesRequest:
    return responses.read_request(body(**{"input": "Hi", **fields}), LIMITS)


def test_a_responses_request_continues_what_it_is_given() -> None:
    before = [
        kvrt.Message(role="user", content="Earlier"),
        kvrt.Message(role="assistant", content="Yes"),
    ]
    req = responses_request(instructions="Be brief.", max_output_tokens=8, top_logprobs=2)
    turn, given = responses.responses_call(req, before, LIMITS)
    call = turn.call
    assert given == [kvrt.Message(role="user", content="Hi")]
    assert isinstance(call, kvrt.ChatCall)
    assert [m.content for m in call.messages] == ["Be brief.", "Earlier", "Yes", "Hi"]
    assert call.max_tokens == 8 and call.logprobs == 2


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"type": "message", "role": "wizard", "content": "x"}]}, "input[0].role"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}]},
            "tools[0].parameters",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
            "text.format.schema",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools"),
    ],
)
def test_a_bad_responses_request_names_its_parameter_in_its_own_shape(
    fields: dict[str, Any], param: str
) -> None:
    """The Responses API's tools are flat and its format is ``text.format``: errors say so,
    with no chat-shaped name in them."""
    with pytest.raises(RequestError) as info:
        responses.responses_call(responses_request(**fields), [], LIMITS)
    error = info.value
    assert error.param == param, (error.param, str(error))
    assert "response_format" not in str(error) and ".function." not in str(error)


def test_conversation_items_are_named_where_they_are() -> None:
    items = [
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": 7},
    ]
    error = refused(conversations.canonical_items, items)
    assert error.param == "items[1].arguments" and "items[1]" in str(error)
    kept = conversations.canonical_items(items[:1])
    assert kept[0]["role"] == "user" and kept[0]["id"].startswith("msg_")


def test_the_responses_events_follow_the_reply() -> None:
    """Fed a reply's pieces and completion, the translator says what the Agents SDK reads:
    created, in progress, the message added, its deltas, its parts done, completed."""
    req = responses_request()
    events = ResponseEvents("resp_1", "m", req, created=0.0)
    out = events.start()
    for i, text in enumerate(("Hel", "lo")):
        out += events.piece(kvrt.Piece(text=text, token=1, index=i))
    usage = kvrt.Usage(
        prompt_tokens=3,
        completion_tokens=2,
        total_tokens=5,
        cached_tokens=0,
        reused_tokens=0,
        restored_tokens=0,
        prefilled_tokens=3,
        approximate_tokens=0,
        visible_tokens=5,
    )
    done = kvrt.Completion(
        text="Hello",
        finish_reason="stop",
        usage=usage,
        timings=kvrt.Timings(
            time_to_first_token=0.1,
            prompt_seconds=0.1,
            decode_seconds=0.1,
            decode_tokens_per_second=20.0,
            total_seconds=0.2,
        ),
        tokens=(1, 1),
        invisible_segments=(),
        context=kvrt.ContextStatus(
            reused_tokens=0,
            restored_tokens=0,
            prefilled_tokens=3,
            evicted_tokens=0,
            hot_tokens=3,
            logical_tokens=3,
            cold_tokens=0,
            dropped_tokens=0,
            exact_restores=True,
        ),
    )
    ended, final = events.finish(done)
    out += [*ended, events.completed(final)]
    sent = [json.loads(sse(e).split(b"data: ", 1)[1]) for e in out]
    assert [sse(e).split(b"\n")[0] for e in out] == [f"event: {e['type']}".encode() for e in sent]
    kinds = [e["type"] for e in sent]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in sent] == list(range(len(out)))
    assert sent[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"
    assert sent[-1]["response"]["usage"]["input_tokens"] == 3
    failed = json.loads(sse(events.failed(final, "state_full", "no room")).split(b"data: ")[1])
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "state_full", "message": "no room"}


def _stream_calls(events: list[bytes]) -> list[list[Any]]:
    """Each event's ``tool_calls`` entries, as the client reads them."""
    entries: list[list[Any]] = []
    for e in events:
        assert e.startswith(b"data: ") and e.endswith(b"\n\n")
        delta = json.loads(e[6:])["choices"][0]["delta"]
        entries.append(delta.get("tool_calls", [None]))
    return entries


def test_a_streamed_tool_call_sends_one_entry_a_chunk() -> None:
    piece = kvrt.Piece(
        text="",
        token=1,
        index=0,
        tool_calls=(
            kvrt.ToolCallDelta(index=0, id="call_a", name="add", arguments='{"a": 3'),
            kvrt.ToolCallDelta(index=0, arguments=', "b": 4}'),
            kvrt.ToolCallDelta(index=1, id="call_b", name="neg", arguments='{"x": 1}'),
        ),
    )
    stream = chat_api.ChatStream("r", "m", include_usage=False, legacy=False)
    events = [sse(chunk) for chunk in stream.piece(piece)]
    per_chunk = _stream_calls(events)
    assert [len(e) for e in per_chunk] == [1] * len(events)
    entries = [e[0] for e in per_chunk]
    # OpenAI's shape: a call opens with its id, type, name and empty arguments
    assert entries[0] == {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "add", "arguments": ""},
    }
    # An assembler that reads only the first entry of a chunk (LlamaIndex's) gets it all.
    calls: list[dict[str, Any]] = []
    for e in entries:
        if not calls or calls[-1]["index"] != e["index"]:
            calls.append(
                {"index": e["index"], "id": e["id"], "name": e["function"]["name"], "arguments": ""}
            )
        calls[-1]["arguments"] += e["function"].get("arguments", "")
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("call_a", "add", {"a": 3, "b": 4}),
        ("call_b", "neg", {"x": 1}),
    ]


def test_a_streamed_legacy_function_call_keeps_its_arguments() -> None:
    piece = kvrt.Piece(
        text="",
        token=1,
        index=0,
        tool_calls=(kvrt.ToolCallDelta(index=0, id="c", name="f", arguments='{"n": 1}'),),
    )
    stream = chat_api.ChatStream("r", "m", include_usage=False, legacy=True)
    events = [sse(chunk) for chunk in stream.piece(piece)]
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events]
    assert deltas == [
        {"function_call": {"name": "f", "arguments": ""}},
        {"function_call": {"arguments": '{"n": 1}'}},
    ]
