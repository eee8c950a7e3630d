"""Three agent sessions at once on one model, under asyncio, sharing one cold store.

    python examples/concurrent_sessions.py [llama|openvino]

Each session's context (a system prompt, a repository map, two files and a question) is
larger than its 512-token hot window. The second turn sends a different question; the
third sends the first file again, which comes back from the cold store.
"""

from __future__ import annotations

import asyncio
import sys

import kvrt

SYSTEM = "You are a code reviewer. Answer in one sentence."
REPO_MAP = "Repository map:\n" + "\n".join(
    f"- pkg/mod_{i}.py: utilities for step {i}" for i in range(16)
)


def source(name: str, op: str) -> str:
    body = "".join(f"def {op}_{i}(x):\n    return x {op_symbol(op)} {i}\n\n" for i in range(24))
    return f"# {name}\n{body}"


def op_symbol(op: str) -> str:
    return {"add": "+", "sub": "-", "mul": "*"}[op]


async def agent(rt: kvrt.Runtime, name: str, op: str) -> None:
    files = [
        kvrt.Segment(f"file:{op}.py", source(f"{op}.py", op)),
        kvrt.Segment("file:util.py", source("util.py", "mul")),
    ]
    async with rt.open_session(hot_tokens=512, name=name) as session:
        for turn, question in enumerate(
            [f"What does {op}_3 return?", "Which function is largest?", f"Explain {op}_5."], 1
        ):
            segments = [
                rt.chat_segment(
                    "system", "system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED
                ),
                rt.chat_segment("repo_map", "user", REPO_MAP, cache_class=kvrt.CacheClass.REPO_MAP),
                *(files if turn != 2 else files[1:]),
                rt.chat_segment("question", "user", question, generation_prompt=True),
            ]
            status = await session.ensure_context(segments)
            text = await session.generate_text(24)
            print(
                f"[{name} turn {turn}] context {status.logical_tokens}, hot {status.hot_tokens}: "
                f"reused {status.reused_tokens}, restored {status.restored_tokens}, "
                f"prefilled {status.prefilled_tokens}, evicted {status.evicted_tokens}\n"
                f"    {text.strip()!r}"
            )
        report = session.explain()
        cold = [b for b in report.blocks if b.residency is kvrt.Residency.COLD]
        print(
            f"[{name}] {len(report.blocks)} blocks, {len(cold)} cold, consistent: {report.consistent}"
        )


async def main(backend: str) -> None:
    async with kvrt.open_runtime(backend=backend) as rt:
        async with asyncio.TaskGroup() as tg:
            for name, op in (("adder", "add"), ("subtracter", "sub"), ("multiplier", "mul")):
                tg.create_task(agent(rt, name, op))
        stats = rt.cold_stats()
        print(
            f"cold store: {stats.entries} blocks, {stats.bytes / 1e6:.1f} MB, {stats.exact_hits} exact hits"
        )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "llama"))
