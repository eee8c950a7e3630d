"""``kvrt serve --long-context true``: a chat request past the model's trained context
(the zoo's llama trained on 256 tokens) is answered, through the real ``openai`` client,
its usage counting the whole prompt; the same request to a server without the setting is
a 400 naming the planner context."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.support.models import zoo_path
from tests.support.server import kvrt_serve, post

pytestmark = [pytest.mark.subprocess, pytest.mark.model]

DOCUMENT = "The grass is green. The sky is blue. " * 300


def test_a_request_past_the_trained_context_is_served_with_long_context(tmp_path: Path) -> None:
    flags = [
        *("--model", zoo_path("llama", context=256), "--hot-tokens", "256"),
        *("--block-tokens", "32", "--disk-budget", "0", "--state", "none"),
    ]
    messages = [{"role": "user", "content": DOCUMENT + "What colour is the sky?"}]
    with kvrt_serve(tmp_path / "long.log", *flags, "--long-context", "true") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="llama-256",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
        )
        assert reply.usage is not None and reply.usage.prompt_tokens > 8 * 256
        assert reply.choices[0].finish_reason in ("length", "stop")
    with kvrt_serve(tmp_path / "plain.log", *flags) as url:
        body = {"model": "llama-256", "messages": messages, "max_tokens": 4}
        status, answer, _ = post(url, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and "planner context" in answer["error"]["message"]
