"""Context pieces for session tests: a system prompt, a repo map, files and questions."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np

import kvrt
from kvrt.testing import zoo

SYSTEM = "You are a careful code reviewer. Answer in one or two sentences."
REPO_MAP = "Repository map:\n" + "".join(
    f"- src/module_{i}.py: helpers for task {i}\n" for i in range(12)
)
FILE_A = "# file a.py\n" + "".join(
    f"def add_{i}(a, b):\n    return a + b + {i}\n\n" for i in range(14)
)
FILE_B = "# file b.py\n" + "".join(
    f"def mul_{i}(a, b):\n    return a * b * {i}\n\n" for i in range(14)
)


def context(*files: tuple[str, str], question: str) -> list[kvrt.Segment]:
    return [
        kvrt.Segment("system", SYSTEM, cache_class=kvrt.CacheClass.TASK_PINNED),
        kvrt.Segment("repo_map", REPO_MAP, cache_class=kvrt.CacheClass.REPO_MAP),
        *(kvrt.Segment(name, text) for name, text in files),
        kvrt.Segment("user", question),
    ]


async def next_logits(session: kvrt.Session) -> np.ndarray:
    """The logits the session's next generated token would be chosen from."""
    return await session.next_logits()


async def greedy(session: kvrt.Session, n: int) -> list[int]:
    return [p.token async for p in session.generate(n, stop_at_end=False)]


_LOADED: dict[str, kvrt.backend.Engine] = {}


def loaded(backend: str = "llama") -> kvrt.backend.Engine:
    """The embedded model on ``backend``, loaded once for the whole test run (closed by
    the suite's end): for tests where loading is not what they are about, as
    ``open_runtime(engine=loaded(backend))`` (an OpenVINO runtime opens in 2.7 s loading
    its own, in milliseconds with this)."""
    if backend not in _LOADED:
        _LOADED[backend] = kvrt.load_engine(backend)
    return _LOADED[backend]


def close_loaded() -> None:
    while _LOADED:
        _LOADED.popitem()[1].close()
    if _ZOO:
        shutil.rmtree(_ZOO.pop(), ignore_errors=True)


_ZOO: list[str] = []


def zoo_path(name: str, *, context: int | None = None) -> str:
    """A tiny random-weight GGUF of the zoo's variant ``name`` (:mod:`kvrt.testing.zoo`),
    written once per test run (trained on ``context`` tokens where given)."""
    if not _ZOO:
        _ZOO.append(tempfile.mkdtemp(prefix="kvrt-zoo-"))
    return str(zoo.write(name, _ZOO[0], context=context))


def tiny(
    name: str = "llama", kv_type: str = "f16", *, backend: str = "llama"
) -> kvrt.backend.Engine:
    """The zoo's ``name`` loaded once for the whole run: a 2-layer model that computes
    ~100x faster than SmolLM2, with its tokenizer and chat template, for what needs an
    engine but no real text. On OpenVINO (``backend``), the zoo's llama converted."""
    key = f"zoo:{name}:{kv_type}:{backend}"
    if key not in _LOADED:
        config = kvrt.load_config(flags={"model": zoo_path(name), "kv_type": kv_type})
        _LOADED[key] = kvrt.load_engine(backend, config=config)
    return _LOADED[key]


NO_DISK = kvrt.Config(disk=kvrt.DiskConfig(budget=0))
"""A runtime with no disk tier: it starts with an empty cold store, whatever ran before."""


def llama_cpp_greedy(
    path: str,
    prompt: list[int],
    n: int,
    *,
    n_ctx: int = 1024,
    config: kvrt.EngineConfig | None = None,
    stop_at_end: bool = False,
) -> list[int]:
    """``n`` greedy tokens of ``llama_cpp.Llama`` itself after ``prompt``, with the KV type
    and flash-attention setting kvrt uses under ``config``: the independent reference."""
    from kvrt.adapters.llama import reference_llama

    llm = reference_llama(path, config, n_ctx=n_ctx, n_batch=512, verbose=False)
    out: list[int] = []
    try:
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            out.append(token)
            if len(out) >= n or (stop_at_end and llm.token_eos() == token):
                break
    finally:
        llm.close()
    return out
