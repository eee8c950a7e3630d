"""The rest of the OpenAI protocol that frameworks send at their defaults, against
``kvrt serve`` with the real ``openai`` client: kept responses read back, listed and
deleted; ``include`` logprobs and kvrt's usage on Responses; ``logit_bias`` in kvrt's
sampler; the legacy ``functions`` / ``function_call``; what a text model cannot do
refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import openai
import pytest

from tests.support.server import client, off_loop, post, server

pytestmark = [pytest.mark.anyio, pytest.mark.model]


async def model_of(url: str) -> str:
    return str((await off_loop(client(url).models.list)).data[0].id)


def chat(model: str, **fields: Any) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "Name a fruit."}]}
    return json.dumps({**body, "max_tokens": 1, "temperature": 0, **fields}).encode()


async def test_kept_responses_are_read_back_listed_and_deleted(anyio_backend: str) -> None:
    async with server() as (_, url):
        c = client(url)
        model = await model_of(url)
        first = await off_loop(
            lambda: c.responses.create(
                model=model,
                input=[{"role": "user", "content": "Say hello."}],
                max_output_tokens=4,
                temperature=0,
                include=["message.output_text.logprobs"],
            )
        )
        part: Any = cast(Any, first.output[0]).content[0]
        assert part.logprobs and len(part.logprobs) == cast(Any, first.usage).output_tokens
        kvrt_usage = cast(Any, first.usage).model_extra["kvrt"]
        assert kvrt_usage["prefilled_tokens"] + kvrt_usage["reused_tokens"] > 0
        second = await off_loop(
            lambda: c.responses.create(
                model=model,
                input="And goodbye.",
                previous_response_id=first.id,
                max_output_tokens=4,
                temperature=0,
            )
        )
        again = await off_loop(c.responses.retrieve, second.id)
        assert again.id == second.id and again.output_text == second.output_text
        items = await off_loop(lambda: c.responses.input_items.list(second.id, order="asc"))
        assert [cast(Any, i).content[0].text for i in items.data] == [
            "And goodbye."
        ]  # its own input
        listed = await off_loop(lambda: c.responses.input_items.list(first.id, limit=1))
        assert len(listed.data) == 1 and not listed.has_more
        await off_loop(c.responses.delete, first.id)
        with pytest.raises(openai.NotFoundError):
            await off_loop(c.responses.retrieve, first.id)
        with pytest.raises(openai.NotFoundError):
            await off_loop(
                lambda: c.responses.create(
                    model=model, input="Hi", previous_response_id=first.id, max_output_tokens=2
                )
            )
        unkept = await off_loop(
            lambda: c.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
        )
        with pytest.raises(openai.NotFoundError):
            await off_loop(c.responses.retrieve, unkept.id)
        with pytest.raises(openai.BadRequestError, match="not supported by kvrt"):
            await off_loop(
                lambda: c.responses.create(
                    model=model, input="Hi", include=["file_search_call.results"]
                )
            )


async def test_logit_bias_bans_and_forces_tokens(anyio_backend: str) -> None:
    async with server() as (rt, url):
        model = await model_of(url)
        status, plain, _ = await off_loop(post, url, "/v1/chat/completions", chat(model))
        assert status == 200, plain
        chosen = plain["choices"][0]["message"]["content"]
        (token,) = rt.engine.tokenize(chosen, add_special=False, parse_special=False)
        banned = chat(model, logit_bias={str(token): -100})
        status, body, _ = await off_loop(post, url, "/v1/chat/completions", banned)
        assert status == 200 and body["choices"][0]["message"]["content"] != chosen
        forced_token = rt.engine.tokenize(" zebra", add_special=False, parse_special=False)[0]
        forced = chat(model, logit_bias={str(forced_token): 100})
        status, body, _ = await off_loop(post, url, "/v1/chat/completions", forced)
        content = body["choices"][0]["message"]["content"]
        assert status == 200 and content == rt.engine.token_bytes(forced_token).decode()
        for bias, says in (
            ({"abc": 1}, "token ids"),
            ({"5": 101}, "-100"),
            ({str(10**9): 1}, "vocabulary"),
        ):
            status, body, _ = await off_loop(
                post, url, "/v1/chat/completions", chat(model, logit_bias=bias)
            )
            assert status == 400 and body["error"]["param"] == "logit_bias", body
            assert says in body["error"]["message"]


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


async def test_legacy_functions_are_tools_answered_in_their_form(anyio_backend: str) -> None:
    async with server() as (_rt, url):
        model = await model_of(url)
        asked = [{"role": "user", "content": "What is the weather in Paris?"}]
        legacy = {"functions": [WEATHER], "function_call": {"name": "get_weather"}}
        body = json.dumps(
            {"model": model, "messages": asked, "max_tokens": 40, "temperature": 0, **legacy}
        ).encode()
        status, answer, _ = await off_loop(post, url, "/v1/chat/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
        call = choice["message"]["function_call"]
        assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])
        history = [
            *asked,
            {"role": "assistant", "content": None, "function_call": call},
            {"role": "function", "name": "get_weather", "content": "Sunny, 21 C"},
        ]
        body = json.dumps(
            {"model": model, "messages": history, "max_tokens": 4, "functions": [WEATHER]}
        ).encode()
        status, answer, _ = await off_loop(post, url, "/v1/chat/completions", body)
        assert status == 200, answer
        streamed = json.dumps(
            {
                "model": model,
                "messages": asked,
                "max_tokens": 40,
                "temperature": 0,
                "stream": True,
                **legacy,
            }
        ).encode()
        chunks = await off_loop(streamed_chunks, url, streamed)
        deltas = [ch["choices"][0] for ch in chunks if ch.get("choices")]
        assert deltas[-1]["finish_reason"] == "function_call"
        assert any("function_call" in d["delta"] for d in deltas)
        assert not any("tool_calls" in d["delta"] for d in deltas)
        names = [
            d["delta"]["function_call"].get("name") for d in deltas if "function_call" in d["delta"]
        ]
        assert names[0] == "get_weather"
        orphan = [*asked, {"role": "function", "name": "get_weather", "content": "x"}]
        status, answer, _ = await off_loop(
            post, url, "/v1/chat/completions", chat(model, messages=orphan)
        )
        assert status == 400 and answer["error"]["param"] == "messages[1].name", answer


def streamed_chunks(url: str, body: bytes) -> list[dict[str, Any]]:
    import urllib.request

    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


async def test_what_a_local_text_model_cannot_do_is_refused_by_name(anyio_backend: str) -> None:
    async with server() as (_rt, url):
        model = await model_of(url)
        for fields, param in (
            ({"modalities": ["text", "audio"]}, "modalities"),
            ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
            ({"web_search_options": {}}, "web_search_options"),
            (
                {"functions": [WEATHER], "tools": [{"type": "function", "function": WEATHER}]},
                "functions",
            ),
            ({"functions": [1]}, "functions[0]"),
            ({"functions": [WEATHER], "function_call": "bogus"}, "function_call"),
            ({"functions": [WEATHER], "function_call": {"name": "other"}}, "function_call"),
            (
                {
                    "messages": [
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "", "function_call": "get_weather"},
                    ]
                },
                "messages[1].function_call",
            ),
        ):
            status, body, _ = await off_loop(
                post, url, "/v1/chat/completions", chat(model, **fields)
            )
            assert status == 400 and body["error"]["param"] == param, body
        status, body, _ = await off_loop(
            post, url, "/v1/chat/completions", chat(model, modalities=["text"])
        )
        assert status == 200, body
        # A response's message sent back whole carries "function_call": null: no call.
        dumped = {"role": "assistant", "content": "Hi.", "function_call": None, "refusal": None}
        history = [{"role": "user", "content": "Hi"}, dumped, {"role": "user", "content": "Bye"}]
        status, body, _ = await off_loop(
            post, url, "/v1/chat/completions", chat(model, messages=history)
        )
        assert status == 200, body


async def test_conversations_keep_items_and_responses_continue_them(anyio_backend: str) -> None:
    async with server() as (_, url):
        c = client(url)
        model = await model_of(url)
        conv = await off_loop(
            lambda: c.conversations.create(
                items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                metadata={"topic": "names"},
            )
        )
        assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}

        def ask(text: str) -> Any:
            return c.responses.create(
                model=model, input=text, conversation=conv.id, max_output_tokens=8, temperature=0
            )

        first = await off_loop(ask, "What is my name?")
        items = (await off_loop(lambda: c.conversations.items.list(conv.id))).data
        kinds = [(i.type, getattr(i, "role", None)) for i in items]
        assert kinds == [("message", "user"), ("message", "user"), ("message", "assistant")]
        assert items[2].id == first.output[0].id  # the response's own item
        second = await off_loop(ask, "Say it again.")
        kvrt_usage = second.usage.model_extra["kvrt"]
        # Only the new input and the framing were computed: the rest was reused.
        assert kvrt_usage["prefilled_tokens"] < second.usage.input_tokens // 2
        added = await off_loop(
            lambda: c.conversations.items.create(
                conv.id, items=[{"type": "message", "role": "user", "content": "Thanks."}]
            )
        )
        (note,) = cast(Any, added).data
        got = await off_loop(
            lambda: c.conversations.items.retrieve(note.id, conversation_id=conv.id)
        )
        assert cast(Any, got).content[0].text == "Thanks."
        await off_loop(lambda: c.conversations.items.delete(note.id, conversation_id=conv.id))
        assert len((await off_loop(lambda: c.conversations.items.list(conv.id))).data) == 5
        updated = await off_loop(lambda: c.conversations.update(conv.id, metadata={"a": "b"}))
        assert updated.metadata == {"a": "b"}
        with pytest.raises(openai.BadRequestError, match="not both"):
            await off_loop(
                lambda: c.responses.create(
                    model=model, input="x", conversation=conv.id, previous_response_id=first.id
                )
            )
        deleted = await off_loop(c.conversations.delete, conv.id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            await off_loop(c.conversations.retrieve, conv.id)
        with pytest.raises(openai.NotFoundError):
            await off_loop(ask, "Still there?")
        with pytest.raises(openai.BadRequestError) as bad:
            await off_loop(
                lambda: c.conversations.create(
                    items=[cast(Any, {"type": "message", "role": "pirate"})]
                )
            )
        assert bad.value.body["param"].startswith("items[0]")  # type: ignore[index]


async def test_a_conversation_outlives_a_restart_with_its_kv(
    anyio_backend: str, tmp_path: Path
) -> None:
    """The conversation's items come back from the state database, its KV from the disk
    tier: the next turn after the restart restores what the conversation held."""
    folder = str(tmp_path / "state.sqlite3")
    long_note = "Notes: " + " ".join(f"item {i} is kept." for i in range(60))
    async with server(state_path=folder) as (_, url):
        c = client(url)
        model = await model_of(url)
        conv = await off_loop(
            lambda: c.conversations.create(
                items=[{"type": "message", "role": "user", "content": long_note}]
            )
        )
        await off_loop(
            lambda: c.responses.create(
                model=model, input="Name a colour.", conversation=conv.id, max_output_tokens=8
            )
        )
        before = [i.id for i in (await off_loop(lambda: c.conversations.items.list(conv.id))).data]
    async with server(state_path=folder) as (_, url):
        c = client(url)
        after = [i.id for i in (await off_loop(lambda: c.conversations.items.list(conv.id))).data]
        assert after == before
        again = await off_loop(
            lambda: c.responses.create(
                model=model, input="Another one.", conversation=conv.id, max_output_tokens=4
            )
        )
        kvrt_usage = cast(Any, again.usage).model_extra["kvrt"]
        assert kvrt_usage["restored_tokens"] >= 128, kvrt_usage  # its blocks, from disk
        for bad in ("..%2F..%2Fetc%2Fpasswd", "conv_" + "0" * 32):
            with pytest.raises(openai.NotFoundError):
                await off_loop(c.conversations.retrieve, bad)


async def test_another_tenant_cannot_reach_kept_responses_or_conversations(
    anyio_backend: str,
) -> None:
    async with server(api_keys={"key-a": "a", "key-b": "b"}) as (_, url):
        a, b = (openai.OpenAI(base_url=f"{url}/v1", api_key=k) for k in ("key-a", "key-b"))
        model = str((await off_loop(a.models.list)).data[0].id)
        conv = await off_loop(
            lambda: a.conversations.create(items=[{"role": "user", "content": "PIN 4417"}])
        )
        kept = await off_loop(
            lambda: a.responses.create(model=model, input="Hi", max_output_tokens=2)
        )
        for reach in (
            lambda: b.conversations.retrieve(conv.id),
            lambda: b.conversations.items.list(conv.id),
            lambda: b.conversations.delete(conv.id),
            lambda: b.responses.retrieve(kept.id),
            lambda: b.responses.input_items.list(kept.id),
            lambda: b.responses.delete(kept.id),
            lambda: b.responses.create(
                model=model, input="Hi", conversation=conv.id, max_output_tokens=2
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                await off_loop(reach)
        # Still there for its own tenant.
        assert (await off_loop(lambda: a.conversations.items.list(conv.id))).data
        assert (await off_loop(a.responses.retrieve, kept.id)).id == kept.id
