"""An asyncio chat agent on ``session.chat``: OpenAI-style messages in, the reply out.

Each turn sends the whole conversation; kvrt reuses what the session already holds (the
replies included, placed with the tokens that were generated), so only the new message is
computed. Run: ``python examples/chat_agent.py [llama|openvino]``.
"""

from __future__ import annotations

import asyncio
import sys

import kvrt

QUESTIONS = [
    "What is a lighthouse for?",
    "Who keeps one running?",
    "Write two lines of a poem about one.",
]


async def main(backend: str) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
    ]
    async with kvrt.open_runtime(backend) as rt, rt.open_session(hot_tokens=1024) as session:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            print(f"> {question}")
            reply = session.chat(messages, max_tokens=60, temperature=0)
            async for piece in reply:
                print(piece.text, end="", flush=True)
            done = await reply
            u = done.usage
            print(
                f"\n  [{done.finish_reason}: {u.prompt_tokens} prompt tokens, "
                f"{u.cached_tokens} cached, {u.prefilled_tokens} computed, "
                f"{u.completion_tokens} generated]"
            )
            messages.append({"role": "assistant", "content": done.text})


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "llama"))
