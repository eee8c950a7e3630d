"""The OpenVINO backend on the embedded model's IR: exact where promised, honest where not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import numpy.typing as npt
import openvino as ov
import openvino_genai
import pytest

import kvrt
from kvrt import (
    AdmitMode,
    ColdBlock,
    ColdBlockMismatchError,
    ConfigError,
    EngineConfig,
    EvictMode,
    InvalidRangeError,
    ModelLoadError,
)
from kvrt._describe import model_info
from kvrt.adapters.openvino import OpenVinoEngine, _probe
from kvrt.adapters.openvino._context import OpenVinoEngineContext
from kvrt.adapters.openvino._rows import Rows
from kvrt.backend import KeySketching, load_probe
from kvrt.native_bridge.openvino import DETERMINISTIC
from tests.support.text import STORY

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def ov_engine() -> Iterator[OpenVinoEngine]:
    eng = OpenVinoEngine.open(EngineConfig(backend="openvino", kv_type="f32"))
    yield eng
    eng.close()


def words(engine: OpenVinoEngine, text: str) -> list[int]:
    return engine.tokenize(text, add_special=False)


def test_greedy_equals_llm_pipeline(ov_engine: OpenVinoEngine) -> None:
    prompt = ov_engine.apply_chat_template([("user", "Why is the sky blue?")])
    tokens = ov_engine.tokenize(prompt, add_special=False)
    ctx = ov_engine.open_context(512)
    ctx.prefill(tokens)
    ours = ctx.generate(32)
    ctx.close()
    pipe = openvino_genai.LLMPipeline(ov_engine.facts.path, "CPU", **DETERMINISTIC)
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = 32
    config.do_sample = False
    ids = ov.Tensor(np.array([tokens], dtype=np.int64))
    mask = ov.Tensor(np.ones((1, len(tokens)), dtype=np.int64))
    theirs = [
        int(t) for t in pipe.generate(openvino_genai.TokenizedInputs(ids, mask), config).tokens[0]
    ]
    assert len(ours) >= 8
    assert ours == theirs, (ov_engine.detokenize(ours), ov_engine.detokenize(theirs))


def story_and_reference(
    engine: OpenVinoEngine,
) -> tuple[list[int], list[int], npt.NDArray[np.float32], OpenVinoEngineContext]:
    """The story's tokens, a probe, the probe's logits after the whole story (the
    reference), and a fresh context holding the story."""
    tokens = engine.tokenize(STORY * 2)
    probe = words(engine, " She")
    ref = engine.open_context(512)
    ref.prefill(tokens)
    expected = ref.prefill(probe)
    ctx = engine.open_context(512)
    ctx.prefill(tokens)
    return tokens, probe, expected, ctx


def test_gap_evict_then_in_place_admit_is_bit_exact(ov_engine: OpenVinoEngine) -> None:
    tokens, probe, expected, ctx = story_and_reference(ov_engine)
    n = len(tokens)
    block = ctx.export(30, 70)
    assert block.meta.n_bytes == 40 * ov_engine.facts.kv_bytes_per_token
    ctx.evict(30, 70, EvictMode.GAP)
    while_evicted = ctx.prefill(probe)
    ctx.evict(n, n + 1)
    assert ctx.admit(block, AdmitMode.IN_PLACE) == 30
    restored = ctx.prefill(probe)
    assert not np.array_equal(while_evicted, expected)
    assert np.array_equal(restored, expected), f"max |Δ| {np.abs(restored - expected).max()}"
    assert ctx.capabilities.exact_in_place


def test_slide_evict_then_tail_admit_matches_fresh_prefill_argmax(
    ov_engine: OpenVinoEngine,
) -> None:
    head = ov_engine.tokenize(STORY * 2)
    middle = words(
        ov_engine, " The keeper's daughter painted the door of the tower bright red that spring."
    )
    tail = words(ov_engine, " Ships from the north saw the red door before they saw the lamp.")
    probe = words(ov_engine, " The")
    ctx = ov_engine.open_context(512)
    ctx.prefill(head + middle + tail)
    a, b = len(head), len(head) + len(middle)
    block = ctx.export(a, b)
    ctx.evict(a, b, EvictMode.SLIDE)
    assert ctx.admit(block, AdmitMode.TAIL) == len(head) + len(tail)
    got = ctx.prefill(probe)
    fresh = ov_engine.open_context(512).prefill(head + tail + middle + probe)
    delta = float(np.abs(got - fresh).max())
    print(f"\nOpenVINO slide evict + tail admit vs fresh prefill: max |Δlogit| = {delta:.4f}")
    assert int(got.argmax()) == int(fresh.argmax())


def test_u8_kv_is_labelled_and_is_approximate() -> None:
    engine = OpenVinoEngine.open(EngineConfig(backend="openvino", kv_type="u8"))
    tokens = engine.tokenize(STORY * 2)
    probe = words(engine, " She")
    ctx = engine.open_context(512)
    ctx.prefill(tokens)
    expected = ctx.prefill(probe)
    ctx.evict(len(tokens), len(tokens) + 1)
    block = ctx.export(20, 60)
    ctx.evict(20, 60)
    ctx.admit(block)
    restored = ctx.prefill(probe)
    caps = ctx.capabilities
    assert not caps.exact_in_place
    assert any("approximate" in note for note in caps.notes)
    assert not np.array_equal(restored, expected)  # the label is true: not bit-exact
    assert int(restored.argmax()) == int(expected.argmax())
    # The cache holds a byte a value; its cold blocks hold what the state reads back (f32),
    # and the planner counts the cold store with that.
    facts = engine.facts
    assert facts.cold_bytes_per_token == 4 * facts.kv_bytes_per_token
    assert block.meta.n_bytes == 40 * facts.cold_bytes_per_token
    cap = model_info(facts, kvrt.Config(engine=engine.config)).capacity
    assert cap.cold_store_tokens == cap.host_cold_budget_bytes // facts.cold_bytes_per_token
    assert any("cold blocks take 46,080 bytes a token against 11,520" in n for n in cap.notes)


def test_bad_input(ov_engine: OpenVinoEngine, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="holds no OpenVINO IR"):
        OpenVinoEngine.open(EngineConfig(backend="openvino", model=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"invalid engine\.kv_type for OpenVINO: 'q8_0'"):
        OpenVinoEngine.open(EngineConfig(backend="openvino", kv_type="q8_0"))
    ctx = ov_engine.open_context(256)
    ctx.prefill(ov_engine.tokenize(STORY))
    block = ctx.export(0, 10)
    ctx.evict(0, 10)
    wrong = ColdBlock(
        meta=msgspec.structs.replace(
            block.meta, tokens=block.meta.tokens[:5], n_bytes=block.meta.n_bytes // 2
        ),
        data=np.ascontiguousarray(block.data[: block.meta.n_bytes // 2 + 4]),
    )
    with pytest.raises(ColdBlockMismatchError):
        ctx.admit(wrong)
    shape = ColdBlock(
        meta=msgspec.structs.replace(block.meta, tokens=block.meta.tokens[:5]),
        data=block.data,
    )
    with pytest.raises(ColdBlockMismatchError, match="5 tokens of this model take"):
        ctx.admit(shape)
    ctx.admit(block)
    assert list(ctx.positions)[:10] == list(range(10))


@pytest.mark.anyio
@pytest.mark.parametrize(("kv_type", "exact"), [("f32", True), ("u8", False)])
async def test_session_reports_restore_precision(kv_type: str, exact: bool) -> None:
    import kvrt

    config = kvrt.Config(engine=EngineConfig(backend="openvino", kv_type=kv_type))  # type: ignore[arg-type]
    async with kvrt.open_runtime(config=config) as rt, rt.open_session(hot_tokens=512) as s:
        segments = [
            kvrt.Segment("story", STORY * 2),
            kvrt.Segment("question", " Who climbed the tower?"),
        ]
        await s.ensure_context(segments)
        await s.evict("story")
        status = await s.ensure_context(segments)
        assert status.restored_tokens > 0
        assert status.exact_restores is exact
        report = s.explain()
        assert report.exact_restores is exact and report.capabilities.exact_in_place is exact


def test_a_precision_that_cannot_be_exact_is_refused_when_exactness_is_required() -> None:
    with pytest.raises(
        ConfigError, match="require_exact is set but a u8 KV cache re-quantizes on import"
    ):
        OpenVinoEngine.open(EngineConfig(backend="openvino", kv_type="u8", require_exact=True))


def test_user_ir_folder_in_the_export_layout(ov_engine: OpenVinoEngine, tmp_path: Path) -> None:
    built = Path(ov_engine.facts.path)
    for name in ("openvino_model", "openvino_tokenizer", "openvino_detokenizer"):
        for ext in (".xml", ".bin"):
            (tmp_path / f"{name}{ext}").symlink_to(built / f"{name}{ext}")
    with pytest.raises(ModelLoadError, match=r"add a config\.json with max_position_embeddings"):
        OpenVinoEngine.open(EngineConfig(backend="openvino", model=str(tmp_path)))
    (tmp_path / "config.json").write_text(
        '{"max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9}'
    )
    engine = OpenVinoEngine.open(
        EngineConfig(backend="openvino", model=str(tmp_path), kv_type="f32")
    )
    assert (engine.facts.trained_context, engine.facts.n_head, engine.facts.n_layers) == (
        8192,
        9,
        30,
    )
    tokens = engine.tokenize(STORY)
    a, b = engine.open_context(256), ov_engine.open_context(256)
    assert np.array_equal(a.prefill(tokens), b.prefill(tokens))


def test_interrupted_build_leaves_no_half_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvrt.adapters.openvino import prepare_ir

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Exception from src/gguf_modeling.cpp:166:\nconversion interrupted\n")

    monkeypatch.setenv("KVRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(openvino_genai, "LLMPipeline", fail)
    # OpenVINO's "Exception from <file>:<line>:" line is left out; its reason is kept.
    with pytest.raises(
        ModelLoadError, match=r"cannot convert .*\(architecture 'llama'\): conversion interrupted;"
    ):
        prepare_ir(None)
    assert list((tmp_path / "openvino").iterdir()) == []  # no half model, no build folder


def test_describe_openvino() -> None:
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", "--backend", "openvino", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)["model"]
    assert (m["backend"], m["n_layers"], m["n_head_kv"], m["head_dim"], m["trained_context"]) == (
        "openvino",
        30,
        3,
        64,
        8192,
    )
    assert m["kv_type"] == "f16" and m["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    kernels = m["kernels"]  # the kernel probe's verdict, with what it measured
    assert kernels["exact"] and kernels["reason"].startswith("OpenVINO ")
    assert [s["sequences"] for s in kernels["setting"]["steps"]] == [1, 2, 4, 8]
    rows_exact = all(s["max_delta"] == 0 for s in kernels["setting"]["steps"])
    assert json.loads(proc.stdout)["together"] == (8 if rows_exact else 1)


def test_kernel_probe_measures_cuts_and_rows(ov_engine: OpenVinoEngine) -> None:
    """The verdict is the probe's measurement, kept for the next open; what it says of
    cuts holds when the same cut is computed again here, and where rows of one request
    are not each alone's, bit for bit, sessions step alone and say why."""
    k = ov_engine.facts.kernels
    assert k is not None and k.setting is not None and k.probe is not None
    s = k.setting
    assert k.exact and k.cut_invariant == s.exact
    assert k.batch_exact == all(st.max_delta == 0 for st in s.steps)
    info = model_info(ov_engine.facts, kvrt.Config(), engine=ov_engine)
    assert info.together == (ov_engine.config.together if k.batch_exact else 1)
    assert (info.together_bytes > 0) is k.batch_exact

    tokens = (words(ov_engine, STORY) * 8)[: _probe.SEED + _probe.CUT]
    assert len(tokens) == _probe.SEED + _probe.CUT
    seeded = _probe._Seeded(ov_engine._model, tokens)
    one, _ = seeded.cut([_probe.CUT])
    pieces, _ = seeded.cut((8,) * (_probe.CUT // 8))
    trial = next(t for t in s.trials if t.name.endswith(f"pieces of 8 after {_probe.SEED} cells"))
    assert (trial.max_delta == 0) == np.array_equal(one, pieces)

    notes = ov_engine.open_context(64).capabilities.notes
    assert f"kernels: {k.reason}" in notes
    assert _probe.stepping(k, joins=k.batch_exact) in notes


def test_kernel_probe_record_is_kept_by_what_it_depends_on(
    ov_engine: OpenVinoEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = ov_engine.facts.kernels
    assert k is not None and k.setting is not None
    measured: list[str] = []

    def measure(model: object, tokens: object) -> object:
        measured.append("probe")
        return k.setting

    monkeypatch.setattr(_probe, "measure", measure)
    tokens = words(ov_engine, STORY) * 8
    config = ov_engine.config
    first = _probe.kernel_verdict(ov_engine._model, config, tokens, model_key="ir-a")
    assert first.probe is not None and load_probe(first.probe.key) == first.probe
    again = _probe.kernel_verdict(ov_engine._model, config, tokens, model_key="ir-a")
    assert again == first and measured == ["probe"]  # read back, not probed again
    other = msgspec.structs.replace(config, threads=(config.threads or 1) + 1)
    _probe.kernel_verdict(ov_engine._model, other, tokens, model_key="ir-a")
    _probe.kernel_verdict(ov_engine._model, config, tokens, model_key="ir-b")
    assert measured == ["probe"] * 3


def test_rows_are_offered_only_where_the_probe_found_them_exact(
    ov_engine: OpenVinoEngine,
) -> None:
    k = ov_engine.facts.kernels
    assert k is not None and k.probe is not None and k.setting is not None
    for delta, streams, offered in ((0.0, 8, True), (0.0, 1, False), (1e-5, 8, False)):
        steps = tuple(msgspec.structs.replace(st, max_delta=delta) for st in k.setting.steps)
        setting = msgspec.structs.replace(k.setting, steps=steps)
        verdict = _probe.settle(msgspec.structs.replace(k.probe, settings=(setting,)))
        facts = msgspec.structs.replace(ov_engine.facts, kernels=verdict)
        assert Rows(ov_engine._model, facts, streams=streams).offered is offered
        requantized = msgspec.structs.replace(facts, kv_type="u8", exact_in_place=False)
        assert not Rows(ov_engine._model, requantized, streams=streams).offered
        words_ = _probe.stepping(verdict, joins=offered)
        assert ("beside other sessions'" in words_) is offered
        assert ("differ from each alone" in words_) is (delta > 0)


def test_windows_stepping_as_rows_get_what_they_get_alone(ov_engine: OpenVinoEngine) -> None:
    """Windows of other lengths step together in varying sets (a window left out of a
    step comes home first; one settles midway), then on alone: every logit equals the
    same window's stepped alone, bit for bit."""
    k = ov_engine.facts.kernels
    if k is None or not k.batch_exact:
        pytest.skip("the kernel probe found rows of one request inexact here")
    prompts = [words(ov_engine, STORY[: 40 + 37 * i]) for i in range(4)]

    def run(together: bool) -> list[list[npt.NDArray[np.float32]]]:
        ctxs = [ov_engine.open_context(512) for _ in prompts]
        last = [c.prefill(p) for c, p in zip(ctxs, prompts, strict=True)]
        seen: list[list[npt.NDArray[np.float32]]] = [[] for _ in ctxs]
        for n in range(10):
            which = [i for i in range(len(ctxs)) if (n + i) % 3 or not together]
            steps = [(ctxs[i], int(np.argmax(last[i]))) for i in which]
            got = ov_engine.step_together(steps) if together else [c.step(t) for c, t in steps]
            for i, logits in zip(which, got, strict=True):
                assert not isinstance(logits, Exception), logits
                last[i] = logits
                seen[i].append(logits)
            if together and n == 5:
                ov_engine.settle(ctxs[1])
                assert not ov_engine.away(ctxs[1])
        for i, c in enumerate(ctxs):
            seen[i].append(c.step(int(np.argmax(last[i]))))  # home again
            c.close()
        return seen

    before = ov_engine.joint_steps
    together = run(True)
    assert ov_engine.joint_steps - before >= 8 and ov_engine.stream_bytes == 0
    alone = run(False)
    for i, rows in enumerate(together):
        for n, logits in enumerate(rows):
            assert np.array_equal(logits, alone[i][n]), (i, n)


@pytest.mark.parametrize(("kv_type", "value_bytes"), [("f16", 2), ("bf16", 4)])
def test_half_precision_caches_restore_exactly(kv_type: str, value_bytes: int) -> None:
    engine = OpenVinoEngine.open(EngineConfig(backend="openvino", kv_type=kv_type))  # type: ignore[arg-type]
    tokens = engine.tokenize(STORY * 2)
    probe = words(engine, " She")
    ctx = engine.open_context(512)
    ctx.prefill(tokens)
    expected = ctx.prefill(probe)
    ctx.evict(len(tokens), len(tokens) + 1)
    block = ctx.export(20, 60)
    # f16 values are stored as f16 (the model's KV bytes per token); bf16 ones as f32.
    assert block.meta.n_bytes == 40 * 30 * 2 * 3 * 64 * value_bytes
    ctx.evict(20, 60)
    ctx.admit(block)
    assert np.array_equal(ctx.prefill(probe), expected)


def test_export_run_reads_once_and_equals_one_export_per_block(
    ov_engine: OpenVinoEngine,
) -> None:
    tokens, probe, expected, ctx = story_and_reference(ov_engine)
    n = len(tokens)
    ranges = [(16, 48), (48, 80), (80, 90)]
    run = ctx.export_run(ranges)
    single = [ctx.export(a, b) for a, b in ranges]
    assert [b.meta for b in run] == [b.meta for b in single]
    assert all(np.array_equal(r.data, s.data) for r, s in zip(run, single, strict=True))
    with pytest.raises(InvalidRangeError, match="not adjacent"):
        ctx.export_run([(16, 48), (50, 60)])
    ctx.evict(16, 90, EvictMode.GAP)
    assert not np.array_equal(ctx.prefill(probe), expected)
    ctx.evict(n, n + 1)
    ctx.admit_run(run)
    assert np.array_equal(ctx.prefill(probe), expected)


MEMORY_CYCLES = """
import gc, anyio, psutil, kvrt
STORY = "The lighthouse keeper kept a logbook of ships and storms. " * 20

async def main():
    process = psutil.Process()
    for cycle in range(6):
        async with kvrt.open_runtime("openvino") as rt:
            async with rt.open_session(hot_tokens=512) as s:
                await s.ensure_context([kvrt.Segment("a", STORY)])
                await s.generate_text(2)
                inside = process.memory_info().rss
        gc.collect()
        print(cycle, inside, process.memory_info().rss, flush=True)

anyio.run(main)
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_closing_a_runtime_returns_its_memory() -> None:
    """The compiled model goes with its runtime, and nothing piles up across runtimes
    (the CPU plugin's runtime cache kept ~16 MB per compiled model before)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_CYCLES], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [tuple(map(int, line.split())) for line in proc.stdout.split("\n") if line]
    assert len(rows) == 6
    for _, inside, after in rows:
        assert after < inside - 500 * 2**20, rows  # the model's ~1.3 GB is given back
    assert rows[-1][2] - rows[1][2] < 40 * 2**20, rows


def test_no_home_directory_asks_for_a_cache_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrt.adapters.openvino import _prepare

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("KVRT_CACHE_DIR", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(
        ConfigError, match="no home directory to keep built OpenVINO models in: set KVRT_CACHE_DIR"
    ):
        _prepare.cache_root()
    monkeypatch.setenv("KVRT_CACHE_DIR", "/somewhere")
    assert _prepare.cache_root() == Path("/somewhere/openvino")


def test_keys_do_not_depend_on_their_position(ov_engine: OpenVinoEngine) -> None:
    """As on llama.cpp: the same tokens computed alone at position 0 (the query's probe)
    and at position 600 (in the window) give the same keys once RoPE is undone, and the
    cold bytes give the same sketch as the hot range — so ``relevance`` scores by keys on
    OpenVINO too."""
    tokens = words(ov_engine, "The pass key is 71432. Remember it.")
    ctx = ov_engine.open_context(1024)
    try:
        assert isinstance(ctx, KeySketching)
        ctx.prefill(tokens, start=600)
        query = np.asarray(ctx.query_sketch(tokens))
        facts = ov_engine.facts
        assert query.shape == (facts.n_layers, facts.n_head_kv, len(tokens), facts.head_dim)
        scale = float(np.abs(query).max())
        block = ctx.export(600, 600 + len(tokens))
        (hot,) = ctx.key_sketches([(600, 600 + len(tokens))])
        assert np.abs(np.asarray(hot)[:, :, 0] - query.mean(axis=2)).max() < 0.01 * scale
        assert np.array_equal(np.asarray(ctx.cold_key_sketch(block)), np.asarray(hot))
        ctx.query_sketch(tokens[:5])  # the probe then computes only the rest
        assert np.abs(np.asarray(ctx.query_sketch(tokens)) - query).max() < 0.01 * scale
    finally:
        ctx.close()
