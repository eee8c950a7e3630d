"""One loaded engine, many runtimes: what a test suite does with a session fixture."""

from __future__ import annotations

import anyio
import pytest

import kvrt

pytestmark = [pytest.mark.anyio, pytest.mark.model]


async def test_runtimes_open_on_a_loaded_engine_and_leave_it_open(anyio_backend: str) -> None:
    engine = await anyio.to_thread.run_sync(kvrt.load_engine, "llama")
    try:
        texts = []
        for _ in range(2):
            async with kvrt.open_runtime(engine=engine) as rt:
                assert (
                    rt.engine is engine
                )  # no second model loaded and rt.config.engine == engine.config
                async with rt.open_session(hot_tokens=512) as s:
                    done = await s.chat([{"role": "user", "content": "Say hi."}], max_tokens=8)
                    texts.append(done.text)
        assert texts[0] == texts[1]
        assert engine.tokenize("still open", add_special=False)  # the runtime left it open
        async with (
            kvrt.open_runtime(engine=engine) as a,
            kvrt.open_runtime(engine=engine) as b,
            a.open_session(hot_tokens=512) as s,
            b.open_session(hot_tokens=512) as t,
        ):
            one = await s.chat([{"role": "user", "content": "Say hi."}], max_tokens=8)
            two = await t.chat([{"role": "user", "content": "Say hi."}], max_tokens=8)
        assert one.text == two.text == texts[0]
    finally:
        engine.close()


async def test_engine_arguments_are_checked(anyio_backend: str) -> None:
    with pytest.raises(kvrt.ArgumentTypeError, match=r"kvrt\.load_engine"):
        async with kvrt.open_runtime(engine="llama"):  # type: ignore[arg-type]
            pass
    engine = await anyio.to_thread.run_sync(kvrt.load_engine, "llama")
    try:
        with pytest.raises(kvrt.ConfigError, match="not both"):
            async with kvrt.open_runtime("llama", engine=engine):
                pass
    finally:
        engine.close()
    with pytest.raises(kvrt.ConfigError):
        kvrt.load_engine("nonesuch")
