"""Hostile and odd usage of the public API: every answer is a result or a kvrt error, in
bounded time, and the session works afterwards.

Arbitrary values (wrong types, NaN, infinities, negatives, huge numbers, empty and junk
text, NUL bytes) go into every argument of the public entry points of a real session on
the real engines (llama.cpp on asyncio and trio, OpenVINO on trio), each call under a
deadline.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvrt
import kvrt._config
from tests.support.models import loaded

pytestmark = pytest.mark.model

DEADLINE = 60.0

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308]),
    st.text(max_size=12),
    st.sampled_from(["", "\x00", "\ud800", "volatile", "assistant", "a\x00b", "🦀" * 3]),
    st.binary(max_size=6),
    st.tuples(st.integers(-(2**40), 2**40), st.integers(-(2**40), 2**40)),
    st.lists(st.integers(-5, 600), max_size=3),
    st.dictionaries(st.sampled_from(["temperature", "top_p", "seed", "x"]), st.integers(-2, 2)),
    st.builds(object),
)
"""Any value a caller could pass by mistake or on purpose."""

CONTEXT = [
    kvrt.Segment("system", "You are terse.", cache_class=kvrt.CacheClass.TASK_PINNED),
    kvrt.Segment("notes", "The lamp failed twice in the winter of the great storm. " * 12),
    kvrt.Segment("user", "What failed?"),
]


class Harness:
    """A runtime and a session held open in a portal's event loop across examples."""

    def __init__(self, portal: BlockingPortal, rt: kvrt.Runtime, session: kvrt.Session) -> None:
        self.portal = portal
        self.rt = rt
        self.session = session

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` (sync or async) under the deadline; it may return or raise a kvrt
        error and nothing else. Then the session must still serve a valid call."""

        async def attempt() -> None:
            with anyio.fail_after(DEADLINE):
                try:
                    result = fn()
                    if hasattr(result, "__anext__"):
                        await _read_a_little(result)
                    elif hasattr(result, "__await__"):
                        await result
                    elif isinstance(result, kvrt.Prefetch):
                        result.cancel()
                except kvrt.KvrtError:
                    pass
            with anyio.fail_after(DEADLINE):
                status = await self.session.ensure_context(CONTEXT)
                assert status.logical_tokens > 0
                assert len(await self.session.generate_text(1)) >= 0
                assert self.session.explain().consistent

        self.portal.call(attempt)


async def _read_a_little(stream: Any) -> None:
    try:
        for _ in range(2):
            await stream.__anext__()
    except StopAsyncIteration:
        pass
    finally:
        await stream.aclose()


@pytest.fixture(
    scope="module", params=[("asyncio", "llama"), ("trio", "llama"), ("trio", "openvino")]
)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    event_loop, backend = request.param
    with (
        start_blocking_portal(event_loop) as portal,
        portal.wrap_async_context_manager(kvrt.open_runtime(engine=loaded(backend))) as rt,
        portal.wrap_async_context_manager(rt.open_session(hot_tokens=512)) as s,
    ):
        yield Harness(portal, rt, s)


fuzz = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@fuzz
@given(
    field=st.sampled_from(
        ["max_tokens", "sampling", "segment", "cache_class", "stop_at_end", "buffer"]
    ),
    value=junk,
)
def test_generate_any_argument(harness: Harness, field: str, value: object) -> None:
    s = harness.session
    if field == "max_tokens":
        harness.call(lambda: s.generate(value))  # type: ignore[arg-type]
    else:
        harness.call(lambda: s.generate(4, **{field: value}))  # type: ignore[arg-type]


@fuzz
@given(field=st.sampled_from(["temperature", "top_k", "top_p", "seed"]), value=junk)
def test_sampling_any_field(harness: Harness, field: str, value: object) -> None:
    s = harness.session
    harness.call(lambda: s.generate(3, sampling=kvrt.SamplingParams(**{field: value})))  # type: ignore[arg-type]


@fuzz
@given(method=st.sampled_from(["evict", "admit"]), target=junk)
def test_evict_and_admit_any_target(harness: Harness, method: str, target: object) -> None:
    harness.call(lambda: getattr(harness.session, method)(target))


@fuzz
@given(
    field=st.sampled_from(["name", "text", "cache_class", "parse_special", "score", "markup"]),
    value=junk,
)
def test_segments_with_any_field(harness: Harness, field: str, value: object) -> None:
    def ensure() -> Any:
        seg = kvrt.Segment(
            **{"name": "extra", "text": "More notes.", field: value}  # type: ignore[arg-type]
        )
        return harness.session.ensure_context([*CONTEXT[:2], seg, CONTEXT[2]])

    harness.call(ensure)


@fuzz
@given(segments=junk, hold=junk)
def test_ensure_and_prefetch_any_argument(harness: Harness, segments: object, hold: object) -> None:
    s = harness.session
    harness.call(lambda: s.ensure_context(segments))  # type: ignore[arg-type]
    harness.call(lambda: s.prefetch(CONTEXT, hold=hold))  # type: ignore[arg-type]
    harness.call(lambda: s.prefetch(segments))  # type: ignore[arg-type]


@fuzz
@given(
    field=st.sampled_from(
        ["hot_tokens", "name", "hot_eviction", "cold_admission", "restore", "approximate"]
    ),
    value=junk,
)
def test_open_session_any_argument(harness: Harness, field: str, value: object) -> None:
    async def open_one() -> None:
        async with harness.rt.open_session(**{field: value}) as other:  # type: ignore[arg-type]
            await other.ensure_context(CONTEXT[:1])

    harness.call(open_one)


@fuzz
@given(kind=junk, name=junk, role=junk, content=junk)
def test_runtime_helpers_any_argument(
    harness: Harness, kind: object, name: object, role: object, content: object
) -> None:
    rt = harness.rt
    harness.call(lambda: rt.policy(kind, name))  # type: ignore[arg-type]
    harness.call(lambda: rt.chat_segment(name, role, content))  # type: ignore[arg-type]
    harness.call(lambda: rt.chat_segment("m", "user", content))  # type: ignore[arg-type]


def test_errors_are_also_the_builtin_kind() -> None:
    with pytest.raises(TypeError, match=r"sampling\.seed must be an integer, got str '5'"):
        kvrt.SamplingParams(seed="5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sampling\.top_p must be a finite number in"):
        kvrt.SamplingParams(top_p=2)
    with pytest.raises(
        kvrt.InvalidArgumentError,
        match=r"Segment\.cache_class must be one of 'volatile', 'repo_map', 'task_pinned', got 'bogus'",
    ):
        kvrt.Segment("a", "b", cache_class="bogus")  # type: ignore[arg-type]
    assert kvrt.Segment("a", "b", cache_class="repo_map").cache_class is kvrt.CacheClass.REPO_MAP  # type: ignore[arg-type]
    with pytest.raises(
        kvrt.ArgumentTypeError, match=r"Segment\.parse_special must be True or False"
    ):
        kvrt.Segment("a", "b", parse_special="no")  # type: ignore[arg-type]
    with pytest.raises(kvrt.InvalidArgumentError, match="is not valid Unicode text"):
        kvrt.Segment("a", "\ud800")


text_junk = st.one_of(
    st.text(max_size=16),
    st.sampled_from(["", " ", "-1", "0", "1e400", "nan", "inf", "10%", "200%", "8GiB", "1 TB"]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
)


@settings(max_examples=300, deadline=None)
@given(
    setting=st.sampled_from(kvrt._config.SETTINGS),
    value=text_junk,
    as_flag=st.booleans(),
)
def test_every_setting_any_value(setting: kvrt._config.Setting, value: str, as_flag: bool) -> None:
    """A setting from the environment or a flag gives a Config or one ConfigError naming it."""
    try:
        if as_flag:
            kvrt.load_config(env={}, flags={setting.name: value})
        else:
            kvrt.load_config(env={setting.env: value})
    except kvrt.ConfigError as exc:
        assert setting.path in str(exc), str(exc)
        assert (setting.flag if as_flag else setting.env) in str(exc), str(exc)


@settings(max_examples=200, deadline=None)
@given(
    path=st.one_of(st.none(), junk),
    env=st.one_of(junk, st.dictionaries(st.sampled_from(["KVRT_BATCH", "KVRT_MEM_COLD"]), junk)),
    flags=st.one_of(junk, st.dictionaries(st.sampled_from(["batch", "cold", "nope", 5]), junk)),
)
def test_load_config_any_argument(path: object, env: object, flags: object) -> None:
    with contextlib.suppress(kvrt.KvrtError):
        kvrt.load_config(path, env=env, flags=flags)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(backend=st.one_of(st.just("llama"), junk), model=junk, config=st.one_of(st.none(), junk))
def test_open_runtime_any_argument(backend: object, model: object, config: object) -> None:
    async def open_one() -> None:
        with anyio.fail_after(DEADLINE):
            try:
                async with kvrt.open_runtime(backend, model=model, config=config) as rt:  # type: ignore[arg-type]
                    assert rt.model_info.capacity.hot_context_tokens > 0
            except kvrt.KvrtError:
                pass

    anyio.run(open_one)
