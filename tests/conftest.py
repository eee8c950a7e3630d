"""Shared fixtures: the real embedded model on the real llama.cpp engine."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvrt import AdmitMode, EngineConfig, EvictMode
from kvrt.adapters.llama import LlamaEngine

from ._agent import close_loaded
from .redis_server import RedisServer, start_redis

STORY = (
    "The lighthouse keeper of Arden Point kept a logbook. Every evening she wrote down the "
    "colour of the sky, the height of the waves and the names of the ships that passed. "
    "In the winter of the great storm, the lamp failed twice, and twice she climbed the "
    "tower with a lantern in her hand. "
)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real ``redis-server`` on a free loopback port, stopped after the test."""
    server = start_redis(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _close_loaded_engines() -> Iterator[None]:
    yield
    close_loaded()


@pytest.fixture(scope="session")
def engine() -> Iterator[LlamaEngine]:
    eng = LlamaEngine.open(EngineConfig())
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Gemma 3 270M assembled once from its package (``kvrt[gemma]``) for the whole run."""
    import kvrt.models

    return str(kvrt.models.gemma3_270m(tmp_path_factory.mktemp("gemma")))


@pytest.fixture(scope="session")
def engine_q8() -> Iterator[LlamaEngine]:
    eng = LlamaEngine.open(EngineConfig(kv_type="q8_0"))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def engine_q4() -> Iterator[LlamaEngine]:
    eng = LlamaEngine.open(EngineConfig(kv_type="q4_0"))
    yield eng
    eng.close()


def words(engine: LlamaEngine, text: str) -> list[int]:
    """Tokens of ``text`` without BOS, for splicing into a longer sequence."""
    return engine.tokenize(text, add_special=False)


MIDDLE = " The keeper's daughter painted the door of the tower bright red that spring."
TAIL = " Ships from the north saw the red door before they saw the lamp."


def slide_then_tail_admit(
    engine: LlamaEngine, head: list[int], probe: str, n_ctx: int
) -> tuple[np.ndarray, np.ndarray]:
    """Prefill ``head`` + a middle sentence + a tail sentence, slide-evict the middle, admit it
    at the tail (keys re-rotated) and return the probe's logits next to those of computing
    ``head + tail + middle`` afresh."""
    middle, tail, probe_tokens = words(engine, MIDDLE), words(engine, TAIL), words(engine, probe)
    ctx = engine.open_context(n_ctx)
    ctx.prefill(head + middle + tail)
    a, b = len(head), len(head) + len(middle)
    block = ctx.export(a, b)
    ctx.evict(a, b, EvictMode.SLIDE)
    assert list(ctx.positions) == list(range(len(head) + len(tail)))
    assert ctx.admit(block, AdmitMode.TAIL) == len(head) + len(tail)
    assert list(ctx.tokens) == head + tail + middle
    got = ctx.prefill(probe_tokens)
    ctx.close()
    fresh_ctx = engine.open_context(n_ctx)
    fresh = fresh_ctx.prefill(head + tail + middle + probe_tokens)
    fresh_ctx.close()
    return got, fresh


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every anyio test runs on asyncio and on trio."""
    return str(request.param)


@pytest.fixture(scope="session")
def _built_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the whole run where OpenVINO's converted IRs are kept: a model is
    converted once, not once a test (7 s for SmolLM2)."""
    return tmp_path_factory.mktemp("openvino-builds")


@pytest.fixture(autouse=True)
def cache_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, _built_models: Path
) -> str:
    """Each test gets a cache folder of its own (the disk tier's default lives there), so
    no test finds blocks another test wrote; its ``openvino`` folder of built models is
    the run's (tests of the build itself point KVRT_CACHE_DIR elsewhere)."""
    folder = tmp_path_factory.mktemp("kvrt-cache")
    (folder / "openvino").symlink_to(_built_models, target_is_directory=True)
    monkeypatch.setenv("KVRT_CACHE_DIR", str(folder))
    return str(folder)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Engine-neutral tests run llama.cpp on both event loops and OpenVINO on trio alone
    (as do the OpenVINO module's own tests).

    Engines are called from worker threads, so what differs between loops is kvrt's own
    code, which the llama.cpp runs cover on both; this keeps the suite near 15 minutes.
    """
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        openvino = params.get("backend") == "openvino" or item.path.name == "test_openvino.py"
        if openvino and params.get("anyio_backend") == "asyncio":
            drop.append(item)
            continue
        keep.append(item)
        if openvino:
            item.add_marker(pytest.mark.openvino)
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _interrupted() -> Generator[None, object, object]:
    """Ctrl-C ends the run at once, with pytest's own summary: an event loop's task group
    hands the KeyboardInterrupt on inside an exception group, which pytest would report
    as one failed test before going on to the next."""
    try:
        return (yield)
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:
            raise KeyboardInterrupt from group
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _interrupted())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _interrupted())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    return (yield from _interrupted())
