"""Sessions in a trio program: a nursery of agents, a timeout, and an explain() report.

python examples/trio_sessions.py
"""

from __future__ import annotations

import sys

import trio

import kvrt

NOTES = "\n".join(
    f"Note {i}: the {w} service restarts nightly at 0{i % 6}:00."
    for i, w in enumerate(["api", "db", "cache", "queue", "auth", "search"] * 6)
)


async def agent(rt: kvrt.Runtime, name: str, question: str) -> None:
    async with rt.open_session(hot_tokens=512, name=name) as session:
        segments = [
            rt.chat_segment(
                "system",
                "system",
                "Answer from the notes, briefly.",
                cache_class=kvrt.CacheClass.TASK_PINNED,
            ),
            rt.chat_segment("notes", "user", NOTES, cache_class=kvrt.CacheClass.REPO_MAP),
            rt.chat_segment("question", "user", question, generation_prompt=True),
        ]
        status = await session.ensure_context(segments)
        print(f"[{name}] prefilled {status.prefilled_tokens}, restored {status.restored_tokens}")
        with trio.move_on_after(2.0):  # a deadline: whatever arrives in time is kept
            async for piece in session.generate(48):
                print(f"[{name}] {piece.text!r}")
        report = session.explain()
        print(
            f"[{name}] hot {report.hot_tokens}/{report.hot_budget}, context {report.logical_tokens}, consistent {report.consistent}"
        )


async def main(backend: str) -> None:
    async with kvrt.open_runtime(backend) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(agent, rt, "oncall", "When does the db service restart?")
        nursery.start_soon(agent, rt, "auditor", "Which services restart at 04:00?")


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "llama")
