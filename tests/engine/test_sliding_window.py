"""Gemma 3 270M on the real llama.cpp engine: 15 of its 18 layers attend over a 512-token
sliding window with their own RoPE base. Restores stay bit-exact inside and beyond the
window, cold blocks serve other sessions, and greedy output equals ``llama_cpp.Llama``'s."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

import kvrt
from kvrt import AdmitMode, EngineConfig, EvictMode
from kvrt.adapters.llama import LlamaEngine, LlamaEngineContext
from kvrt.native_bridge.llama_context import MAIN_SEQ, LlamaContext
from kvrt.native_bridge.llama_keys import state_parts, unrotate
from kvrt.native_bridge.rope import ROPE_NEOX, Rope
from tests.support.models import NO_DISK, greedy, llama_cpp_greedy
from tests.support.text import STORY, slide_then_tail_admit, words

pytestmark = pytest.mark.model

WINDOW = 512


@pytest.fixture(scope="session")
def gemma(gemma_path: str) -> Iterator[LlamaEngine]:
    engine = LlamaEngine.open(EngineConfig(model=gemma_path))
    yield engine
    engine.close()


def _story(engine: LlamaEngine, n: int) -> list[int]:
    tokens = engine.tokenize(STORY * (n // 40 + 2))[:n]
    assert len(tokens) == n
    return tokens


def test_describe_reports_the_layer_profile(gemma: LlamaEngine, tmp_path: Path) -> None:
    facts = gemma.facts
    assert (facts.architecture, facts.n_layers, facts.sliding_window_live) == ("gemma3", 18, 512)
    # Measured from the engine's own cache layout: three global layers, fifteen windowed,
    # 1,024 bytes a token each at f16 (one KV head of 256).
    assert facts.n_swa_layers == 15
    assert (facts.kv_bytes_per_token, facts.kv_bytes_per_token_swa) == (18 * 1024, 15 * 1024)
    assert facts.rope_freq_base == 1_000_000 and facts.rope_freq_base_swa == 10_000
    assert facts.swa_full  # kept full size, so the capacity is dense
    info = kvrt.ModelInfo(
        model=facts,
        capacity=kvrt.resolve_capacity(
            kvrt.CapacityInputs(
                trained_context=facts.trained_context,
                kv_bytes_per_token=facts.kv_bytes_per_token,
                layers=kvrt.LayerProfile(
                    n_layers=18, n_swa_layers=15, sliding_window=512, swa_full=True
                ),
                memory=kvrt.MemoryReading(free_bytes=1 << 34, total_bytes=1 << 35),
            )
        ),
        memory=kvrt.MemoryReading(),
    )
    assert any("15 of 18 layers" in note for note in info.capacity.notes)

    # The shorthand name through the command line, assembled into kvrt's cache folder.
    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", "--model", "gemma3-270m", "--kv-type", "q8_0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    table = subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", "--json", "--model", "gemma3-270m"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    model = json.loads(table.stdout)["model"]
    assert model["n_swa_layers"] == 15 and model["kv_bytes_per_token"] == 18 * 1024
    assert "18: 3 global, 15 sliding-window" in proc.stdout
    assert "q8_0" in proc.stdout and "9,792" in proc.stdout  # 18 layers x 2 x 272 bytes


def _check_gap_restores(ctx: LlamaEngineContext, probe: list[int], n: int) -> list[str]:
    """Evict and restore in place a block far beyond the window and one inside it; the
    probe's logits after each restore must equal those before any eviction."""
    expected = ctx.prefill(probe)
    ctx.evict(n, n + len(probe))
    failures = []
    for a, b in [(64, 192), (n - 300, n - 172)]:
        block = ctx.export(a, b)
        ctx.evict(a, b, EvictMode.GAP)
        evicted = ctx.prefill(probe)
        ctx.evict(n, n + len(probe))
        ctx.admit(block, AdmitMode.IN_PLACE)
        restored = ctx.prefill(probe)
        ctx.evict(n, n + len(probe))
        if np.array_equal(evicted, expected):
            failures.append(f"n={n} [{a},{b}): evicting did not change the logits")
        if not np.array_equal(restored, expected):
            delta = float(np.abs(restored - expected).max())
            failures.append(f"n={n} [{a},{b}): restored logits differ by {delta}")
    return failures


def test_gap_restores_inside_and_beyond_the_window_are_bit_exact(gemma: LlamaEngine) -> None:
    # At 1,024 and 2,048 tokens: the first block is 832 and more behind the probe, beyond
    # the 512-token window; the second inside it.
    tokens = _story(gemma, 2048)
    probe = words(gemma, " She")
    ctx = gemma.open_context(2048 + 64)
    ctx.prefill(tokens[:1024])
    failures = _check_gap_restores(ctx, probe, 1024)
    ctx.prefill(tokens[1024:])
    failures += _check_gap_restores(ctx, probe, 2048)
    ctx.close()
    assert not failures, failures


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_quantized_kv_gap_restores_are_bit_exact(
    gemma_path: str, kv_type: Literal["q8_0", "q4_0"]
) -> None:
    engine = LlamaEngine.open(EngineConfig(model=gemma_path, kv_type=kv_type))
    try:
        tokens = _story(engine, 1024)
        ctx = engine.open_context(1024 + 64)
        ctx.prefill(tokens)
        failures = _check_gap_restores(ctx, words(engine, " She"), 1024)
        # The cold copy holds the cache's own quantized bytes: 18 layers of K and V rows.
        block = ctx.export(0, 128)
        ctx.close()
    finally:
        engine.close()
    assert not failures, failures
    assert engine.facts.kv_bytes_per_token == {"q8_0": 9792, "q4_0": 5184}[kv_type]
    per_token = block.meta.n_bytes / 128
    assert engine.facts.kv_bytes_per_token <= per_token < engine.facts.kv_bytes_per_token * 1.05


def _keys_by_kind(data: np.ndarray, n_cells: int) -> list[np.ndarray]:
    """Keys ``[layer, cell, dim]`` of each cache in state bytes: global layers, then windowed."""
    out = []
    for part in state_parts(data):
        assert part.positions.size == n_cells
        rows = [
            data[layer.k_offset : layer.k_offset + layer.k_row * n_cells].view(np.float16)
            for layer in part.layers
        ]
        out.append(np.stack(rows).reshape(len(part.layers), n_cells, -1).astype(np.float32))
    return out


def test_a_shift_re_rotates_each_layer_by_its_own_base(gemma: LlamaEngine) -> None:
    """Keys shifted by +1000 in the cache (what slide eviction and tail admission do) are
    the unshifted keys rotated by 1000 positions with each layer kind's own base: 10^6 in
    the global layers, 10^4 in the windowed ones. The other kind's base gives other keys."""
    model = gemma._model  # the bridge's model: this test reads raw state bytes
    tokens = gemma.tokenize(STORY)
    n, shift = len(tokens), 1000

    def keys(moved: int) -> list[np.ndarray]:
        ctx = LlamaContext(model, n_ctx=2048)
        try:
            ctx.decode(tokens, 0)
            if moved:
                ctx.seq_add(MAIN_SEQ, 0, n, moved)
            return _keys_by_kind(ctx.state_get(MAIN_SEQ), n)
        finally:
            ctx.close()

    def gap(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a - b).max() / np.abs(b).max())

    bases = {"global": 1_000_000.0, "windowed": 10_000.0}
    positions = np.full(n, -shift, dtype=np.int64)  # un-rotating by -shift rotates by +shift
    for kind, before, after in zip(bases, keys(0), keys(shift), strict=True):
        assert gap(before, after) > 0.1, kind  # the shift did rotate them (measured 0.18+)
        for name, base in bases.items():
            rope = Rope(n_rot=256, rope_type=ROPE_NEOX, base=base)
            turned = unrotate(before, positions, rope, head_dim=256)
            rotated = turned.transpose(0, 2, 1, 3).reshape(before.shape)
            if name == kind:
                assert gap(rotated, after) < 0.005, (kind, name, gap(rotated, after))
            else:  # measured: 0.28 and more
                assert gap(rotated, after) > 0.1, (kind, name, gap(rotated, after))


def test_moved_blocks_are_approximate_and_labelled(gemma: LlamaEngine) -> None:
    """Slide eviction and tail admission move keys: never exact, and said so. The gap to
    computing afresh is of the order of the model's own sensitivity to absolute position
    (the same tokens computed at 0 and at 1000 differ by as much), measured, not asserted."""
    ctx = gemma.open_context(64)
    caps = ctx.capabilities
    ctx.close()
    assert caps.position_shift and caps.exact_in_place and not caps.exact_tail
    got, fresh = slide_then_tail_admit(gemma, _story(gemma, 600), " The door was", 1024)
    delta = float(np.abs(got - fresh).max())
    print(f"\nGemma 3 slide evict + tail admit vs fresh prefill: max |Δlogit| = {delta:.4f}")
    assert 0 < delta < 20


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.anyio
async def test_sessions_restore_exactly_and_match_llama_cpp(gemma_path: str) -> None:
    """A 1.5k-token context through the public API: two segments evicted (one beyond the
    window, one reaching into it) come back from cold; a second session is served from the cold
    store; greedy output equals a never-evicting session's and ``llama_cpp.Llama``'s."""
    text = STORY * 10  # 630 tokens
    segments = [
        kvrt.Segment("notes", STORY * 4, cache_class=kvrt.CacheClass.TASK_PINNED),
        kvrt.Segment("log", text.replace("lighthouse", "harbour")),
        kvrt.Segment("chart", text.replace("keeper", "pilot")),
        kvrt.Segment("question", " Who climbed the tower with a lantern? The answer is"),
    ]
    config = kvrt.Config(engine=EngineConfig(model=gemma_path), disk=NO_DISK.disk)
    async with kvrt.open_runtime("llama", config=config) as rt:
        async with rt.open_session(hot_tokens=4096) as s:
            first = await s.ensure_context(segments)
            assert 1300 < first.logical_tokens < 1800
            expected = await greedy(s, 16)
            # "log" ends ~640 tokens before the question, "chart" reaches into its window.
            evicted = await s.evict("log") + await s.evict("chart")
            again = await s.ensure_context(segments)
            assert again.restored_tokens == evicted
            # The question's last token, for its logits (a reply followed it, so none were kept
            # with its block), with the one before it: never a one-token batch.
            assert again.prefilled_tokens == 2
            assert await greedy(s, 16) == expected
            engine = rt.engine
            tokens = engine.tokenize(segments[0].text)
            for segment in segments[1:]:
                tokens += engine.tokenize(segment.text, add_special=False)
                if segment.name == "log":  # it ends more than a window before the end
                    assert first.logical_tokens - len(tokens) > WINDOW
            assert len(tokens) == first.logical_tokens
        async with rt.open_session(hot_tokens=4096) as other:
            served = await other.ensure_context(segments)
            assert served.restored_tokens >= first.logical_tokens - 64
            assert other.explain().cold_store.exact_hits >= 3
            assert await greedy(other, 16) == expected
    assert expected == llama_cpp_greedy(gemma_path, tokens, 16, n_ctx=4096, config=config.engine)


def test_model_names_resolve_and_say_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvrt import ModelLoadError
    from kvrt.backend import resolve_model_path

    assert resolve_model_path("smollm2-135m") == kvrt.embedded_model_path()
    with pytest.raises(ModelLoadError, match=r"model names kvrt knows: smollm2-135m, gemma3-270m"):
        resolve_model_path("gemma3-27m")
    first = kvrt.models.gemma3_270m(tmp_path)
    assert first.stat().st_mode & 0o777 == 0o644
    assert kvrt.models.gemma3_270m(tmp_path) == first  # assembled once, verified after
    first.write_bytes(b"GGUF damaged")
    assert kvrt.models.gemma3_270m(tmp_path).stat().st_size > 200 * 2**20  # put right
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    real_import = __import__("importlib").import_module

    def without_gemma(name: str, *args: object) -> object:
        if name == kvrt.models.GEMMA3_PACKAGE:
            raise ImportError(name)
        return real_import(name, *args)

    monkeypatch.setattr("importlib.import_module", without_gemma)
    with pytest.raises(ModelLoadError, match=r"pip install 'kvrt\[gemma\]'.*Gemma terms"):
        resolve_model_path("gemma3-270m")


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.anyio
async def test_blocks_wider_than_the_window_are_refused(gemma: LlamaEngine) -> None:
    """llama.cpp writes a windowed layer's KV only for the last 512 positions of a range:
    a wider block could not be restored, so none is made."""
    ctx = gemma.open_context(1024)
    ctx.prefill(_story(gemma, 700))
    with pytest.raises(kvrt.InvalidRangeError, match="on this model a block holds at most 512"):
        ctx.export(0, 600)
    assert ctx.export(0, 512).meta.n_tokens == 512
    ctx.close()
    wide = kvrt.Config(session=kvrt.SessionConfig(block_tokens=1024))
    with pytest.raises(
        kvrt.ConfigError, match="block_tokens of 1024 is more than this model's 512"
    ):
        async with kvrt.open_runtime(engine=gemma, config=wide):
            pass


def test_flash_attention_settings_are_checked(gemma_path: str) -> None:
    with pytest.raises(kvrt.ConfigError, match="a q8_0 KV cache needs flash attention"):
        LlamaEngine.open(EngineConfig(model=gemma_path, kv_type="q8_0", flash_attention="off"))
    with pytest.raises(kvrt.ConfigError, match="OpenVINO takes only auto"):
        kvrt.open_engine(EngineConfig(backend="openvino", flash_attention="on"))
    flash = LlamaEngine.open(EngineConfig(model=gemma_path, flash_attention="on"))
    plain = LlamaEngine.open(EngineConfig(model=gemma_path))
    try:
        # Flash attention lays V rows out untransposed: its blocks fit only such engines.
        assert flash.facts.flash_attention and not plain.facts.flash_attention
        assert flash.facts.fingerprint != plain.facts.fingerprint
    finally:
        flash.close()
        plain.close()


def test_the_command_line_jobs_run_on_a_base_model() -> None:
    """Gemma 3 270M has no chat template: `kvrt run` sends it plain text."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrt",
            "run",
            "--model",
            "gemma3-270m",
            "--sessions",
            "1",
            "--max-tokens",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (session,) = json.loads(proc.stdout)["sessions"]
    assert session["turns"][2]["status"]["restored_tokens"] > 0
