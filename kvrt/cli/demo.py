"""``kvrt run``: several agent sessions on one model whose context outgrows the hot window.

Each session works through three turns over a system prompt, a repository map and files:
turn two swaps its file for another (the first goes to the cold store), turn three sends
the first file again (it comes back from the cold store instead of being recomputed).
"""

from __future__ import annotations

import time

import anyio
import msgspec

from kvrt import CacheClass, Config, ContextStatus, Runtime, Segment, open_runtime
from kvrt.cli.messages import message

__all__ = ["DemoReport", "run_demo"]

SYSTEM = (
    "You are a senior Python reviewer working inside a code assistant. You read the "
    "repository map and the files you are shown, then answer the user's question about "
    "them in two or three precise sentences."
)


def _repo_map() -> str:
    modules = ["parser", "planner", "store", "session", "policy", "bench", "cli", "config"]
    lines = [
        f"src/kvdemo/{m}.py: {m} layer; classes {m.title()}Core, {m.title()}Error" for m in modules
    ]
    return "Repository map:\n" + "\n".join(lines)


def _file(name: str, verb: str) -> str:
    body = "".join(
        f"def {verb}_{i}(items: list[int], k: int = {i}) -> list[int]:\n"
        f'    """{verb.title()} every item by {i} and keep those above k."""\n'
        f"    return [x for x in ({verb}(x, {i}) for x in items) if x > k]\n\n"
        for i in range(9)
    )
    return f"File {name}:\n```python\n{body}```"


FILES = {
    "file:scale.py": _file("scale.py", "scale"),
    "file:shift.py": _file("shift.py", "shift"),
    "file:clip.py": _file("clip.py", "clip"),
}

AGENTS = [
    ("reviewer", "file:scale.py", "file:shift.py"),
    ("tester", "file:shift.py", "file:clip.py"),
    ("documenter", "file:clip.py", "file:scale.py"),
    ("refactorer", "file:scale.py", "file:clip.py"),
]

QUESTIONS = [
    "Which function in this file would you test first, and why?",
    "Is there a bug in this file? Answer briefly.",
    "Back to the first file: summarise what it does.",
]


class TurnReport(msgspec.Struct, frozen=True):
    turn: int
    file: str
    status: ContextStatus
    text: str
    seconds: float


class SessionDemo(msgspec.Struct, frozen=True):
    name: str
    hot_budget: int
    turns: list[TurnReport]


class DemoReport(msgspec.Struct, frozen=True):
    sessions: list[SessionDemo]
    hot_tokens: int
    combined_logical_tokens: int
    cold_entries: int
    cold_bytes: int
    seconds: float


def _context(rt: Runtime, file: str, question: str) -> list[Segment]:
    return [
        message(rt, "system", "system", SYSTEM, cache_class=CacheClass.TASK_PINNED),
        message(rt, "repo_map", "user", _repo_map(), cache_class=CacheClass.REPO_MAP),
        message(rt, file, "user", FILES[file]),
        message(rt, "question", "user", question, generation_prompt=True),
    ]


async def run_demo(
    config: Config,
    *,
    sessions: int = 3,
    hot_tokens: int = 512,
    max_tokens: int = 32,
    on_progress: object = None,
) -> DemoReport:
    """Run the demo; ``on_progress(name, step)`` is called after each step of a session."""
    started = time.perf_counter()
    results: dict[str, SessionDemo] = {}
    async with open_runtime(config=config) as rt:
        if rt.model_info.model.recurrent == "recurrent":
            # A recurrent model pages nothing out of its window (its state has seen every
            # token): the window holds the whole context, and prefixes come back restored.
            hot_tokens = rt.model_info.hot_context_tokens

        async def agent(name: str, first: str, second: str) -> None:
            turns: list[TurnReport] = []
            async with rt.open_session(hot_tokens=hot_tokens, name=name) as session:
                for turn, (file, question) in enumerate(
                    zip((first, second, first), QUESTIONS, strict=True), 1
                ):
                    t = time.perf_counter()
                    status = await session.ensure_context(_context(rt, file, question))
                    text = await session.generate_text(max_tokens)
                    turns.append(
                        TurnReport(turn, file, status, text.strip(), time.perf_counter() - t)
                    )
                    if callable(on_progress):
                        on_progress(name, turn)
                results[name] = SessionDemo(name, hot_tokens, turns)

        async with anyio.create_task_group() as tg:
            for name, first, second in AGENTS[:sessions]:
                tg.start_soon(agent, name, first, second)
        stats = rt.cold_stats()
    ordered = [results[name] for name, _, _ in AGENTS[:sessions]]
    return DemoReport(
        sessions=ordered,
        hot_tokens=hot_tokens,
        combined_logical_tokens=sum(max(t.status.logical_tokens for t in s.turns) for s in ordered),
        cold_entries=stats.entries,
        cold_bytes=stats.bytes,
        seconds=time.perf_counter() - started,
    )
