"""Shared fixtures: the real embedded model on the real llama.cpp engine."""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from kvrt import EngineConfig
from kvrt._engine.embedded import embedded_model_path
from kvrt.adapters.llama import LlamaEngine
from kvrt.backend import physical_cores
from tests.support.environments import Background
from tests.support.models import close_loaded
from tests.support.redis import RedisServer, start_redis


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # a serial run, or the controller of the run's workers
        return
    # The CPUs are shared out among the workers: each runs on its own (and so do the
    # servers and programs its tests start), and its engines size their threads to them,
    # as on a machine that size, not two workers' threads spinning on one core.
    cpus = sorted(os.sched_getaffinity(0))
    workers, index = int(workerinput["workercount"]), int(workerinput["workerid"][2:])
    mine = cpus[index * len(cpus) // workers : (index + 1) * len(cpus) // workers]
    os.sched_setaffinity(0, mine or cpus)
    # Ctrl-C reaches every process of the run. A worker would finish its test and wait
    # for the controller's shutdown, which gives up on it after 10 s: it ends at once
    # (the signal's own action, even inside an engine call), and the controller prints
    # the run's summary.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per physical core, at most four (each loads its own models)."""
    return max(1, min(physical_cores(), 4))


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


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every anyio test runs on asyncio and on trio."""
    return str(request.param)


@pytest.fixture(scope="session", autouse=True)
def _pinning_build(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Background | None]:
    """The pinning environment's build, started with the run (in the background) when a
    selected test needs it: once for all of the run's workers, in the folder they share."""
    if not any("pinning_python" in getattr(i, "fixturenames", ()) for i in request.session.items):
        yield None
        return
    shared = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # a worker's is popen-gwN in the run's own
        shared = shared.parent
    build = Background(shared / "pinning-env")
    yield build
    build.join()  # pytest's own rotation of its temporary folders removes it


@pytest.fixture(scope="session")
def pinning_python(_pinning_build: Background | None) -> str:
    """A fresh environment's Python with kvrt and the frameworks that pin what the test
    environment's others cannot share (LlamaIndex, Instructor), built once a run."""
    assert _pinning_build is not None
    return _pinning_build.python()


@pytest.fixture(scope="session")
def _built_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the whole run where OpenVINO's converted IRs are kept: a model is
    converted once, not once a test (7 s for SmolLM2)."""
    return tmp_path_factory.mktemp("openvino-builds")


@pytest.fixture(scope="session", autouse=True)
def _embedded_model() -> Path:
    """The embedded model's file, taken from the package index into the user's own cache
    folder once (a fresh machine's first run): every test's cache folder finds it there."""
    return embedded_model_path()


@pytest.fixture(scope="session")
def _kernel_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the whole run where the kernel probe keeps its records: a model,
    KV type and thread count is probed once, not once a test (seconds for SmolLM2). The
    run's workers share it (the probe takes a lock per record)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "kernel-records"
        folder.mkdir(exist_ok=True)
        return folder
    return tmp_path_factory.mktemp("kernel-records")


@pytest.fixture(autouse=True)
def cache_dir(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    _built_models: Path,
    _kernel_records: Path,
) -> str:
    """Each test gets a cache folder of its own (the disk tier's default lives there), so
    no test finds blocks another test wrote; its ``openvino`` folder of built models and
    its ``kernels`` folder of kernel probe records are the run's (tests of either point
    KVRT_CACHE_DIR elsewhere)."""
    folder = tmp_path_factory.mktemp("kvrt-cache")
    (folder / "openvino").symlink_to(_built_models, target_is_directory=True)
    (folder / "kernels").symlink_to(_kernel_records, target_is_directory=True)
    monkeypatch.setenv("KVRT_CACHE_DIR", str(folder))
    return str(folder)


REAL_MODEL_FIXTURES = {"engine", "engine_q8", "engine_q4", "gemma_path"}
"""Fixtures that load a real model (SmolLM2 or Gemma 3)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Engine-neutral tests run llama.cpp on both event loops and OpenVINO on trio alone
    (as do the OpenVINO module's own tests).

    Engines are called from worker threads, so what differs between loops is kvrt's own
    code, which the llama.cpp runs cover on both; this keeps the suite within its time (docs/development.md).
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
        fixtures = set(getattr(item, "fixturenames", ()))
        if "redis_server" in fixtures:
            item.add_marker(pytest.mark.redis)
        if fixtures & REAL_MODEL_FIXTURES:  # modules that load one themselves say so
            item.add_marker(pytest.mark.model)
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
    try:
        return (yield from _interrupted())
    finally:
        if item.get_closest_marker("frameworks") is not None:
            # A framework leaves clients behind (an AsyncOpenAI it built and never
            # closed): collected now, with no event loop running, its finalizer does
            # nothing; left to a later asyncio test, it schedules its close on that
            # test's loop, where its connections' closed loop fails the test.
            gc.collect()
