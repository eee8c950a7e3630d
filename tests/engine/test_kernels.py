"""The kernel probe: measured once per CPU, build, model, KV type and thread count, kept,
shown by ``describe``; a configuration it found inexact is never labelled exact."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import numpy as np
import pytest

import kvrt
from kvrt.backend import KernelProbe
from kvrt.cli.describe import _kernels
from kvrt.policy import KernelTrial
from tests.support.models import zoo_path

pytestmark = pytest.mark.model

TEXT = "The harbour master logs every ship that comes in at dawn. " * 30


def _records(folder: Path) -> list[Path]:
    return sorted((folder / "kernels").glob("*.json"))


def test_the_probe_runs_once_and_describe_shows_its_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRT_CACHE_DIR", str(tmp_path))  # no record kept yet
    config = kvrt.load_config(flags={"model": zoo_path("llama"), "threads": 1})
    first = kvrt.load_engine("llama", config=config)
    verdict = first.facts.kernels
    assert verdict is not None and verdict.probe is not None and verdict.setting is not None
    [record] = _records(tmp_path)
    stamp = record.stat().st_mtime_ns
    probe = verdict.probe
    assert probe.threads == 1 and probe.kv_type == "f16" and probe.seconds > 0
    # flash attention off, then on; each cut in pieces and each lone cut measured
    assert [s.flash_attention for s in probe.settings] == [False, True]
    for setting in probe.settings:
        assert any(t.lone for t in setting.trials) and any(not t.lone for t in setting.trials)
        assert [s.sequences for s in setting.steps] == [1, 2, 4, 8]
        assert setting.prefill_tps > 0 and setting.decode_tps > 0
    assert first.facts.flash_attention is verdict.flash_attention
    assert first.facts.exact_in_place is verdict.exact
    again = kvrt.load_engine("llama", config=config)
    assert again.facts.kernels == verdict and record.stat().st_mtime_ns == stamp
    assert _records(tmp_path) == [record]
    # another thread count is another record
    two = kvrt.load_config(flags={"model": zoo_path("llama"), "threads": 2})
    other = kvrt.load_engine("llama", config=two)
    assert len(_records(tmp_path)) == 2
    text = _kernels(verdict, 1)
    assert text.startswith(f"flash attention {'on' if verdict.flash_attention else 'off'}")
    assert "probed once in" in text and "sequences decoded together" in text
    assert "each session steps alone" in text
    info = kvrt.describe_model(config)
    assert info.model.kernels == verdict
    # sessions step together where the probe found it exact, as engine.together bounds it
    assert info.together == (8 if verdict.batch_exact else 1)
    assert ("up to 8 a step" in _kernels(verdict, info.together)) == verdict.batch_exact
    # what the streams may hold, beside the windows: 8 streams of a hot window and room
    m, hot = info.model, info.hot_context_tokens
    cells = -(-min(hot + 1 + 512, m.trained_context or hot) // 256) * 256
    assert info.together_bytes == (8 * cells * m.kv_bytes_per_token if verdict.batch_exact else 0)
    text = _kernels(verdict, info.together, info.together_bytes)
    assert ("their streams hold up to" in text) == verdict.batch_exact
    alone = kvrt.load_config(flags={"model": zoo_path("llama"), "threads": 1, "together": 1})
    lone = kvrt.describe_model(alone)
    assert lone.together == 1 and lone.together_bytes == 0
    for engine in (first, again, other):
        engine.close()


def test_an_unreadable_record_is_probed_again_and_an_unknown_policy_refused_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged record is said and measured again, never trusted or fatal; a kernel
    policy nobody registered is refused before anything is probed, naming what is."""
    monkeypatch.setenv("KVRT_CACHE_DIR", str(tmp_path))
    config = kvrt.load_config(flags={"model": zoo_path("llama"), "threads": 1})
    kvrt.load_engine("llama", config=config).close()
    [record] = _records(tmp_path)
    record.write_text('{"key": "half a record')
    with caplog.at_level(logging.WARNING, logger="kvrt"):
        engine = kvrt.load_engine("llama", config=config)
    assert "unreadable" in caplog.text and "probing again" in caplog.text
    verdict = engine.facts.kernels
    assert verdict is not None and verdict.probe is not None
    assert msgspec.json.decode(record.read_bytes(), type=KernelProbe) == verdict.probe
    engine.close()
    record.unlink()
    monkeypatch.setenv("KVRT_KERNEL_POLICY", "slowest_first")
    with pytest.raises(kvrt.UnknownPolicyError, match=r"slowest_first.*fastest_exact"):
        kvrt.load_engine("llama", config=kvrt.load_config(flags={"model": zoo_path("llama")}))
    assert _records(tmp_path) == []  # refused before probing


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_configuration_the_probe_rejects_is_never_labelled_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    monkeypatch.setenv("KVRT_CACHE_DIR", str(tmp_path))
    path = zoo_path("llama")
    kvrt.load_engine("llama", config=kvrt.load_config(flags={"model": path})).close()
    [record] = _records(tmp_path)
    # Whatever this CPU measured, the record now says flash attention's cuts differ, as
    # they do on some CPUs: forced on, nothing computed is labelled exact.
    probe = msgspec.json.decode(record.read_bytes(), type=KernelProbe)
    worse = KernelTrial(name="72 tokens in pieces of 8", max_delta=0.25)
    settings = tuple(
        msgspec.structs.replace(s, trials=(worse, *s.trials)) if s.flash_attention else s
        for s in probe.settings
    )
    record.write_bytes(msgspec.json.encode(msgspec.structs.replace(probe, settings=settings)))
    for flash in ("on", "auto"):
        config = kvrt.load_config(flags={"model": path, "flash_attention": flash})
        config = msgspec.structs.replace(config, disk=kvrt.DiskConfig(budget=0))
        async with kvrt.open_runtime("llama", config=config) as rt:
            verdict = rt.model_info.model.kernels
            assert verdict is not None
            exact = verdict.exact
            assert verdict.flash_attention is (flash == "on")
            assert exact is (flash != "on" and settings[0].exact)
            async with rt.open_session(hot_tokens=1024, write_through="all") as s:
                context = [kvrt.Segment("a", TEXT), kvrt.Segment("q", "Who logs the ships?")]
                status = await s.ensure_context(context)
                assert status.prefilled_tokens == status.logical_tokens
                assert status.exact is exact
                assert await s.evict("a") > 0
                status = await s.ensure_context(context)
                assert status.restored_tokens > 0 and status.exact is exact
                report = s.explain()
                assert report.capabilities.exact_compute is exact
                assert report.exact_restores is exact
                note = (
                    "kernels: flash attention on, inexact (72 tokens in pieces of 8 differ by 0.25)"
                )
                assert any(n.startswith(note) for n in report.capabilities.notes) is not exact
    assert _records(tmp_path) == [record]  # the record was read, not probed again


def test_a_sized_llama_is_written_with_the_shape_asked(tmp_path: Path) -> None:
    """The writer of the peer benchmark's realistic-size model, at a small size: llama.cpp
    loads it with the shape asked and computes finite logits."""
    from kvrt.testing import sized

    path = sized.write(tmp_path, width=256, layers=3, heads=4, kv_heads=2, ffn=512)
    assert sized.write(tmp_path, width=256, layers=3, heads=4, kv_heads=2, ffn=512) == path
    engine = kvrt.load_engine("llama", config=kvrt.load_config(flags={"model": str(path)}))
    try:
        f = engine.facts
        assert (f.n_layers, f.n_head, f.n_head_kv, f.head_dim) == (3, 4, 2, 64)
        ctx = engine.open_context(256)
        logits = ctx.prefill(engine.tokenize("The harbour master logs every ship."))
        assert logits.shape == (f.n_vocab,) and bool(np.isfinite(logits).all())
        ctx.close()
    finally:
        engine.close()
    with pytest.raises(ValueError, match="quant must be one of"):
        sized.write(tmp_path, quant="q2")
