"""Bad input gives a clear kvrt error and the process lives on."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvrt import (
    AdmitMode,
    ColdBlock,
    ColdBlockMismatchError,
    EngineConfig,
    EngineError,
    HotWindowFullError,
    InvalidRangeError,
    InvalidTokenError,
    ModelLoadError,
    embedded_model_path,
)
from kvrt.adapters.llama import LlamaEngine
from kvrt.backend import EngineContext, EvictMode
from tests.support.text import STORY

pytestmark = pytest.mark.model


@pytest.fixture
def ctx(engine: LlamaEngine) -> Iterator[object]:
    c = engine.open_context(256)
    c.prefill(engine.tokenize(STORY))
    yield c
    c.close()


@pytest.mark.parametrize(
    ("start", "end", "message"),
    [
        (-1, 5, r"range \[-1, 5\) is out of bounds of the hot window \[0, \d+\)"),
        (0, 10_000, r"range \[0, 10000\) is out of bounds"),
        (5, 5, r"range \[5, 5\) is empty or reversed"),
        (9, 3, r"range \[9, 3\) is empty or reversed"),
        (1.5, 3, r"start must be an integer position, got 1.5"),
        (True, 3, r"start must be an integer position, got True"),
    ],
)
def test_ranges_out_of_bounds(ctx: EngineContext, start: Any, end: Any, message: str) -> None:
    with pytest.raises(InvalidRangeError, match=message):
        ctx.evict(start, end, EvictMode.GAP)
    with pytest.raises(InvalidRangeError, match=message):
        ctx.export(start, end)


def test_range_over_a_gap(ctx: EngineContext) -> None:
    ctx.evict(10, 20)
    with pytest.raises(InvalidRangeError, match=r"range \[10, 20\) holds no resident tokens"):
        ctx.evict(10, 20)
    with pytest.raises(InvalidRangeError, match=r"range \[5, 25\) has gaps: only 10 of its 20"):
        ctx.export(5, 25)


def test_admit_in_place_over_resident_tokens(ctx: EngineContext) -> None:
    block = ctx.export(10, 20)
    with pytest.raises(InvalidRangeError, match=r"positions \[10, 20\) are partly resident"):
        ctx.admit(block, AdmitMode.IN_PLACE)


def test_token_ids_outside_vocabulary(engine: LlamaEngine, ctx: EngineContext) -> None:
    n_vocab = engine.facts.n_vocab
    for bad in (n_vocab, -1, 10**9):
        with pytest.raises(
            InvalidTokenError, match=rf"token id {bad} is outside the vocabulary \[0, {n_vocab}\)"
        ):
            ctx.prefill([1, bad])
        with pytest.raises(InvalidTokenError):
            engine.detokenize([bad])
        with pytest.raises(InvalidTokenError):
            ctx.step(bad)
    with pytest.raises(InvalidTokenError, match="token ids must be integers"):
        ctx.prefill(["hello"])  # type: ignore[list-item]
    with pytest.raises(InvalidTokenError, match="nothing to prefill"):
        ctx.prefill([])


def test_hot_window_full(engine: LlamaEngine) -> None:
    small = engine.open_context(64)
    assert small.n_ctx == 64  # the budget, even where llama.cpp allocates more cells
    small.prefill(list(range(100, 160)))
    with pytest.raises(
        HotWindowFullError, match=r"needs 10 KV cells but the hot window has 4 free of 64"
    ):
        small.prefill(list(range(100, 110)))
    assert small.n_resident == 60
    small.close()


def test_window_larger_than_trained_context(engine: LlamaEngine) -> None:
    with pytest.raises(InvalidRangeError, match="exceeds the model's trained context of 8192"):
        engine.open_context(10_000)


def test_closed_context(engine: LlamaEngine) -> None:
    c = engine.open_context(64)
    c.prefill([1, 2, 3])
    c.close()
    with pytest.raises(EngineError, match="the context is closed"):
        c.prefill([4])
    with pytest.raises(EngineError, match="the context is closed"):
        c.logits()


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaEngine]:
    """A different model: the embedded GGUF with one weight byte changed."""
    path = tmp_path_factory.mktemp("models") / "other.gguf"
    shutil.copyfile(embedded_model_path(), path)
    with path.open("r+b") as fh:
        fh.seek(-1024, 2)
        byte = fh.read(1)
        fh.seek(-1024, 2)
        fh.write(bytes([byte[0] ^ 0x01]))
    eng = LlamaEngine.open(EngineConfig(model=str(path)))
    yield eng
    eng.close()


def test_cold_bytes_from_another_model(
    engine: LlamaEngine, other_model: LlamaEngine, ctx: EngineContext
) -> None:
    assert other_model.facts.fingerprint != engine.facts.fingerprint
    foreign = other_model.open_context(256)
    foreign.prefill(engine.tokenize(STORY))
    block = foreign.export(0, 20)
    foreign.close()
    ctx.evict(0, 20)
    with pytest.raises(
        ColdBlockMismatchError, match="cold block belongs to another model or KV layout"
    ):
        ctx.admit(block)
    assert ctx.counters.admitted_tokens == 0 and ctx.positions[0] == 20


def test_cold_bytes_from_another_kv_layout(
    engine: LlamaEngine, engine_q8: LlamaEngine, ctx: EngineContext
) -> None:
    q8 = engine_q8.open_context(256)
    q8.prefill(engine.tokenize(STORY))
    block = q8.export(0, 20)
    q8.close()
    ctx.evict(0, 20)
    with pytest.raises(ColdBlockMismatchError, match="another model or KV layout"):
        ctx.admit(block)
    # Even with forged metadata the bytes never get in: llama.cpp refuses them cleanly.
    forged = ColdBlock(
        meta=msgspec.structs.replace(
            block.meta, fingerprint=engine.facts.fingerprint, kv_type="f16"
        ),
        data=block.data,
    )
    with pytest.raises(EngineError, match="rejected the state bytes"):
        ctx.admit(forged)
    assert ctx.positions[0] == 20
    # The window still works afterwards.
    good = ctx.export(20, 40)
    ctx.evict(20, 40)
    ctx.admit(good)


def test_cold_bytes_with_lying_metadata(engine: LlamaEngine, ctx: EngineContext) -> None:
    block = ctx.export(0, 20)
    ctx.evict(0, 20)
    moved = ColdBlock(meta=msgspec.structs.replace(block.meta, start=30), data=block.data)
    ctx.evict(30, 50)
    with pytest.raises(
        ColdBlockMismatchError,
        match=r"bytes hold positions \[0, 20\), its metadata says \[30, 50\)",
    ):
        ctx.admit(moved)
    truncated = ColdBlock(
        meta=msgspec.structs.replace(block.meta, n_bytes=1000),
        data=np.ascontiguousarray(block.data[:1000]),
    )
    with pytest.raises(EngineError, match="rejected the state bytes"):
        ctx.admit(truncated)
    short = ColdBlock(meta=block.meta, data=np.ascontiguousarray(block.data[:10]))
    with pytest.raises(ColdBlockMismatchError, match="holds 10 bytes for 20 tokens"):
        ctx.admit(short)
    ctx.admit(block)
    assert ctx.positions[0] == 0


def test_missing_and_non_gguf_model_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model file not found"):
        LlamaEngine.open(EngineConfig(model=str(tmp_path / "absent.gguf")))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ModelLoadError, match="is not a GGUF model file"):
        LlamaEngine.open(EngineConfig(model=str(text)))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError):
        LlamaEngine.open(EngineConfig(model=str(broken)))
    with pytest.raises(ModelLoadError, match="model path is not a file"):
        LlamaEngine.open(EngineConfig(model=str(tmp_path)))


def test_cli_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", str(tmp_path / "absent.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kvrt: error: model file not found: {tmp_path / 'absent.gguf'}"


ABORT_PRONE = textwrap.dedent(
    """
    import numpy as np
    from kvrt import native_bridge
    from kvrt.native_bridge.llama import LlamaModel
    from kvrt.native_bridge.llama_context import LlamaContext
    from kvrt.adapters.llama import LlamaEngine
    import kvrt

    caught = []

    def expect(kind, fn):
        try:
            fn()
        except kind as exc:
            caught.append(type(exc).__name__)
            return
        raise SystemExit(f"no error from {fn}")

    model = LlamaModel(str(kvrt.embedded_model_path()))
    ctx = LlamaContext(model, n_ctx=128, n_batch=64)
    ctx.decode(list(range(100, 140)), 0)
    E = native_bridge.BridgeError
    expect(E, lambda: ctx.seq_rm(7, 0, 4))                      # sequence id out of range
    expect(E, lambda: ctx.seq_cp(0, 0, 0, 4))                   # copy onto itself
    expect(E, lambda: ctx.decode([model.n_vocab + 5], 40))      # token outside vocabulary
    expect(E, lambda: ctx.decode([-3], 40))
    expect(E, lambda: ctx.decode([2**32 + 5], 40))               # would wrap into the vocabulary
    expect(E, lambda: ctx.decode([1] * 65, 40))                 # more than n_batch
    expect(E, lambda: ctx.decode([1], 99))                      # positions not continuing
    expect(E, lambda: model.token_piece(10**7))                 # would index past the vocab
    expect(E, lambda: ctx.seq_add(0, 5, 2, 1))                  # reversed range
    expect(E, lambda: ctx.seq_add(0, 0, 10, -5))                # negative positions
    expect(E, lambda: ctx.state_set(1, np.zeros(3, dtype=np.float32)))
    expect(E, lambda: ctx.state_set(1, np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8)))
    expect(E, lambda: model.close())                            # contexts still open
    ctx.seq_cp(0, 1, 10, 20)                                    # partial copy: safe with kv_unified
    data = ctx.state_get(1)
    ctx.seq_clear(1)
    expect(E, lambda: ctx.state_set(0, data))                   # target sequence not empty
    ctx.close()
    expect(E, lambda: ctx.decode([1], 40))                      # use after close
    expect(E, lambda: ctx.logits())
    fresh = LlamaContext(model, n_ctx=64)
    expect(E, lambda: fresh.logits())                           # nothing decoded yet
    fresh.close()
    model.close()
    expect(E, lambda: model.tokenize("x", add_special=True, parse_special=False))
    expect(E, lambda: LlamaContext(model, n_ctx=64))

    engine = LlamaEngine.open(kvrt.EngineConfig())
    c = engine.open_context(64)
    expect(kvrt.InvalidTokenError, lambda: c.prefill([engine.facts.n_vocab]))
    expect(kvrt.InvalidRangeError, lambda: c.evict(0, 1))
    expect(kvrt.EngineError, lambda: c.logits())
    c.close(); engine.close()
    print("ALIVE", len(caught))
    """
)


@pytest.mark.subprocess
def test_abort_prone_calls_do_not_kill_the_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", ABORT_PRONE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = ABORT_PRONE.count("expect(") - 1  # every call but the helper's definition
    assert proc.stdout.split() == ["ALIVE", str(expected)], proc.stdout + proc.stderr[-2000:]
