"""A pytest-trio suite for an agent built on kvrt: the model loads once per test session
(a plain sync fixture), and each test opens its own cheap runtime on it.

Run: ``python -m pytest examples/pytest_trio_suite`` (with pytest-trio installed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

import kvrt


@pytest.fixture(scope="session")
def engine() -> Iterator[kvrt.Engine]:
    loaded = kvrt.load_engine("llama")
    yield loaded
    loaded.close()


@pytest.fixture
async def runtime(engine: kvrt.Engine) -> AsyncIterator[kvrt.Runtime]:
    async with kvrt.open_runtime(engine=engine) as rt:
        yield rt
