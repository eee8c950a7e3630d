"""Every architecture llama.cpp runs, on tiny random-weight models the suite writes itself
(:mod:`kvrt.testing.zoo`): exact wherever kvrt says exact, keys turned as the model turns
them wherever a block moves, and refused for the true reason where kvrt cannot page a
model.

Each claim is checked against what the engine computes without kvrt in the way: logits
bit for bit against a context that never evicted (computed in the same pieces), greedy
tokens against ``llama_cpp.Llama`` itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvrt
from kvrt import AdmitMode, ColdBlockMismatchError, EvictMode, Segment
from kvrt._paging.tokens import context_tokens
from kvrt.backend import KeySketching
from kvrt.testing import zoo
from tests.support.churn import churn
from tests.support.models import NO_DISK, llama_cpp_greedy, next_logits, tiny, zoo_path
from tests.support.partial import check_exact, files_context, in_pieces, partial_blocks
from tests.support.redis import RedisServer

pytestmark = pytest.mark.model

ATTENTION = [n for n, v in zoo.VARIANTS.items() if not v.recurrent and v.layers > 1]
ONE_LAYER = [n for n, v in zoo.VARIANTS.items() if v.layers == 1]
RECURRENT = [n for n, v in zoo.VARIANTS.items() if v.recurrent]
CONTEXT = files_context(words=200)
"""A system prompt, three files and a question: about 700 tokens."""
SMALL = kvrt.load_config(
    flags={"session.block_tokens": "64", "session.recent_tokens": "64", "disk.budget": "0"}
)
"""Blocks of 64 tokens and no disk tier: windows of 256 tokens under the context."""


def test_the_zoo_holds_every_architecture_the_issue_names() -> None:
    arches = {v.architecture for v in zoo.VARIANTS.values()}
    assert {"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"} <= arches
    assert {"mamba2", "granitehybrid", "lfm2"} <= arches
    path = Path(zoo_path("llama"))
    assert path.stat().st_size < 16_000_000  # tiny: a second to write, milliseconds a call


# -- exact wherever kvrt says exact --


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("name", ATTENTION)
def test_churn_equals_never_evicting_and_fresh_contexts(name: str, kv_type: str) -> None:
    """Random evictions, restores in random order, rollbacks, prefills and greedy steps:
    every logit and the new tokens' KV bit-identical to a context that never evicted, and,
    for sequences without generation, to a fresh context computing it all at once."""
    churn(tiny(name, kv_type), seeds=[0], fresh_seeds=[1], steps=16)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("name", ATTENTION)
async def test_sessions_restore_exactly_and_match_llama_cpp(name: str, anyio_backend: str) -> None:
    """Evicted files re-sent come back from cold in place; a new session restores the whole
    context from the shared cold store; both bit-identical to computing it, and the greedy
    continuation is llama_cpp.Llama's own."""
    engine = tiny(name)
    files = [s.name for s in CONTEXT if s.name.startswith("file")]
    async with kvrt.open_runtime(engine=engine, config=NO_DISK) as rt:
        async with rt.open_session(hot_tokens=2048, write_through="all") as first:
            status = await first.ensure_context(CONTEXT)
            assert status.exact and status.prefilled_tokens == status.logical_tokens
            want = (
                await next_logits(first),
                list((await first.generate(8, stop_at_end=False)).tokens),
            )
            evicted = await first.evict(files[0])
            assert evicted > 0 and await first.admit(files[0]) == evicted  # explicit admit
            status = await first.ensure_context(CONTEXT)  # the admitted file is in place
            assert status.restored_tokens == 0 and status.prefilled_tokens <= 2
            await check_exact(first, want)
            for file in files:
                assert await first.evict(file) > 0
            again = await first.ensure_context(CONTEXT)
            # The last tokens' logits went with the generated ones: two are computed again.
            assert again.exact and again.restored_tokens > 0 and again.prefilled_tokens <= 2
            await check_exact(first, want)
        async with rt.open_session(hot_tokens=2048) as second:
            status = await second.ensure_context(CONTEXT)
            assert status.exact and status.prefilled_tokens == 0
            assert status.restored_tokens == status.logical_tokens
            await check_exact(second, want)
    prompt = context_tokens(engine, CONTEXT)
    assert llama_cpp_greedy(zoo_path(name), prompt, 8) == want[1]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("name", ATTENTION)
async def test_only_exact_kv_crosses_from_a_partial_window(name: str, anyio_backend: str) -> None:
    """A 256-token window computes the context and labels what it computed with part of its
    prefix cold; a 2048-token session gets only what the first computed with its whole
    prefix hot, bit-identical to computing the context in those pieces."""
    engine = tiny(name)
    async with kvrt.open_runtime(engine=engine, config=SMALL) as rt:
        async with rt.open_session(hot_tokens=256) as small:
            status = await small.ensure_context(CONTEXT)
            assert status.evicted_tokens > 0 and not status.exact
            assert status.partial_window_tokens > 0
            labelled = partial_blocks(small.explain())
            assert labelled and all("partial" in (b.choice or "") for b in labelled)
            exact_end = min(b.start for b in labelled)
        if engine.facts.context_dependent_kv:  # LongRoPE: the larger window uses other factors
            exact_end = 0
        async with rt.open_session(hot_tokens=2048) as big:
            status = await big.ensure_context(CONTEXT)
            assert status.restored_tokens == exact_end
            assert status.exact and status.partial_window_tokens == 0
            await check_exact(big, in_pieces(engine, CONTEXT, [exact_end] if exact_end else []))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("name", ATTENTION)
async def test_disk_redis_and_a_restart_restore_exactly(
    name: str, redis_server: RedisServer, tmp_path: Path, anyio_backend: str
) -> None:
    """Blocks written through to the disk and Redis tiers come back exact in a runtime
    opened afterwards (a restart) from each tier alone."""
    engine = tiny(name)
    disk = str(tmp_path / "blocks")
    both = kvrt.load_config(flags={"disk.path": disk, "remote.url": redis_server.url})
    async with (
        kvrt.open_runtime(engine=engine, config=both) as rt,
        rt.open_session(hot_tokens=2048, write_through="all") as s,
    ):
        await s.ensure_context(CONTEXT)
        want = (await next_logits(s), list((await s.generate(8, stop_at_end=False)).tokens))
    for tier, flags in (
        ("disk", {"disk.path": disk}),
        ("remote", {"disk.budget": "0", "remote.url": redis_server.url}),
    ):
        async with (
            kvrt.open_runtime(engine=engine, config=kvrt.load_config(flags=flags)) as rt,
            rt.open_session(hot_tokens=2048) as s,
        ):
            status = await s.ensure_context(CONTEXT)
            assert status.exact and status.prefilled_tokens == 0, tier
            choices = {b.choice for b in s.explain().blocks}
            assert any(f"restored from cold ({tier})" in (c or "") for c in choices), choices
            await check_exact(s, want)


APPROXIMATE_TEXT = (
    "The keeper's daughter painted the door of the tower bright red that spring. " * 8
)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("name", ATTENTION)
async def test_approximate_hits_are_labelled_and_never_stored(
    name: str, anyio_backend: str
) -> None:
    """The same file after another prefix comes back with its keys turned only where the
    session allows it, labelled approximate, and never enters the cold store."""
    head = [Segment("system", "You answer briefly.", cache_class=kvrt.CacheClass.TASK_PINNED)]
    original = [*head, Segment("file", APPROXIMATE_TEXT), Segment("user", "What colour?")]
    moved = [*head, Segment("other", "A preface. " * 10), *original[1:]]
    async with (
        kvrt.open_runtime(engine=tiny(name), config=NO_DISK) as rt,
        rt.open_session(hot_tokens=1024, approximate="allow") as s,
    ):
        await s.ensure_context(original)
        await s.evict("file")
        status = await s.ensure_context(moved)
        assert status.approximate_tokens > 0 and not status.exact
        report = s.explain()
        file_blocks = [b for b in report.blocks if b.segment == "file"]
        assert all(b.approximate for b in file_blocks)
        assert all((b.choice or "").startswith("restored approximately") for b in file_blocks)
        puts = report.cold_store.puts
        await s.evict("file")
        assert s.explain().cold_store.puts == puts


# -- keys turned as the model turns them --

STORY = (
    "The lighthouse keeper of Arden Point kept a logbook. Every evening she wrote down the "
    "colour of the sky, the height of the waves and the names of the ships that passed. "
) * 4
MIDDLE = (30, 50)


def _moved_and_fresh(engine: kvrt.backend.Engine) -> tuple[np.ndarray, np.ndarray]:
    """A middle range slid out and admitted at the tail (keys turned twice over), then a
    probe; and the same tokens at the same positions computed afresh."""
    tokens = engine.tokenize(STORY)
    probe = engine.tokenize(" The keeper", add_special=False)
    a, b = MIDDLE
    ctx = engine.open_context(512)
    fresh = engine.open_context(512)
    try:
        ctx.prefill(tokens)
        block = ctx.export(a, b)
        ctx.evict(a, b, EvictMode.SLIDE)
        assert ctx.admit(block, AdmitMode.TAIL) == len(tokens) - (b - a)
        got = ctx.prefill(probe)
        want = fresh.prefill([*tokens[:a], *tokens[b:], *tokens[a:b], *probe])
        return got, want
    finally:
        ctx.close()
        fresh.close()


ROUNDING = 0.06
"""The most a one-layer model's next-token logits move when its keys were turned instead
of computed at their positions: f16 rounding of keys and values (measured 0.008-0.037 on
the zoo; llama.cpp's own shift of YaRN and LongRoPE keys gives 1.4-2.4)."""


@pytest.mark.parametrize("name", ONE_LAYER)
def test_moved_keys_equal_keys_computed_there_up_to_rounding(name: str) -> None:
    """With one layer, keys and values depend only on a token and its position: turned
    keys must equal freshly computed ones up to rounding, on every RoPE scaling."""
    got, want = _moved_and_fresh(tiny(name))
    assert float(np.abs(got - want).max()) < ROUNDING


@pytest.mark.parametrize("name", ["qwen2-yarn-1l", "phi3-longrope-1l"])
def test_llama_cpp_alone_scales_yarn_and_longrope_keys_again(name: str) -> None:
    """What the test above guards against: llama.cpp's own key shift (seq_add) multiplies
    keys by the attention factor again, far past rounding."""
    from kvrt.native_bridge.llama import LlamaModel
    from kvrt.native_bridge.llama_context import MAIN_SEQ, LlamaContext

    engine = tiny(name)
    tokens = engine.tokenize(STORY)
    model = LlamaModel(zoo_path(name))
    try:
        shifted, fresh = (LlamaContext(model, n_ctx=512, n_batch=512) for _ in range(2))
        shifted.decode(tokens, 0)
        shifted.seq_rm(MAIN_SEQ, 0, 20)
        shifted.seq_add(MAIN_SEQ, 20, len(tokens), -20)
        probe = engine.tokenize(" The keeper", add_special=False)
        shifted.decode(probe, len(tokens) - 20)
        fresh.decode([*tokens[20:], *probe], 0)
        assert float(np.abs(shifted.logits() - fresh.logits()).max()) > 10 * ROUNDING
    finally:
        model.close(close_contexts=True)


@pytest.mark.parametrize("name", ["llama-1l", "llama3-1l", "qwen2-yarn-1l", "phi3-longrope-1l"])
def test_relevance_keys_are_the_same_at_every_position(name: str) -> None:
    """The key sketch undoes the RoPE the model applies (Llama 3's factors, YaRN's ramp,
    LongRoPE's table for the context's size): one layer's keys of the same tokens at
    position 0 and at 300 agree to rounding."""
    engine = tiny(name)
    tokens = engine.tokenize("The pass key is 71432. Remember it.", add_special=False)
    ctx = engine.open_context(1024)
    try:
        assert isinstance(ctx, KeySketching)
        ctx.prefill(tokens, start=300)
        query = np.asarray(ctx.query_sketch(tokens))
        (hot,) = ctx.key_sketches([(300, 300 + len(tokens))])
        mean = np.asarray(hot)[:, :, 0]
        want = query.mean(axis=2)
        cosine = float(np.sum(mean * want) / np.linalg.norm(mean) / np.linalg.norm(want))
        assert cosine > 0.9999, cosine
    finally:
        ctx.close()


# -- settings that change what the engine computes --


def test_longrope_blocks_never_cross_between_short_and_long_contexts() -> None:
    """LongRoPE picks its table by context size (short up to 512 tokens here): a block a
    384-token context computed is refused by a 2048-token one, accepted by another small
    one."""
    engine = tiny("phi3-longrope")
    tokens = engine.tokenize(STORY)[:100]
    small, other, large = (engine.open_context(n) for n in (384, 512, 2048))
    try:
        small.prefill(tokens)
        block = small.export(0, 100)
        assert small.fingerprint == other.fingerprint != large.fingerprint
        with pytest.raises(ColdBlockMismatchError, match="another model or KV layout"):
            large.admit(block)
        other.admit(block)
        fresh = engine.open_context(384)
        assert np.array_equal(other.prefill(tokens[:3]), fresh.prefill([*tokens, *tokens[:3]]))
        fresh.close()
    finally:
        for c in (small, other, large):
            c.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_large_longrope_session_computes_what_a_small_one_left(
    anyio_backend: str, tmp_path: Path
) -> None:
    """The issue's case: a 384-token window computed the context; a 2048-token session
    restores none of it (another table) and equals a fresh 2048-token context; the small
    session saved and resumed in a large window is computed again, exactly."""
    engine = tiny("phi3-longrope")
    saved = tmp_path / "small.json"
    async with kvrt.open_runtime(engine=engine, config=SMALL) as rt:
        async with rt.open_session(hot_tokens=384, write_through="all") as small:
            await small.ensure_context(CONTEXT)
        async with rt.open_session(hot_tokens=2048) as big:
            status = await big.ensure_context(CONTEXT)
            assert status.restored_tokens == 0 and status.exact
            await check_exact(big, in_pieces(engine, CONTEXT, []))
    async with kvrt.open_runtime(engine=engine, config=SMALL) as rt:  # a cold store anew
        async with rt.open_session(hot_tokens=384, write_through="all") as small:
            await small.ensure_context(CONTEXT)
            await small.save(saved)
        async with rt.open_session(resume=saved, hot_tokens=2048) as resumed:
            assert resumed.resumed is not None and resumed.resumed.restored_tokens == 0
            assert resumed.resumed.exact
            await check_exact(resumed, in_pieces(engine, CONTEXT, []))


# -- refused for the true reason --


@pytest.mark.parametrize("name", RECURRENT)
def test_a_recurrent_model_says_which_layers_are_recurrent_and_what_a_checkpoint_costs(
    name: str,
) -> None:
    """(Its paging is tested in test_hybrid_sessions.) A hybrid whose every layer has
    attention heads runs attention beside a recurrent mixer (Falcon-H1)."""
    v = zoo.VARIANTS[name]
    engine = kvrt.load_engine("llama", model=zoo_path(name))
    try:
        facts = engine.facts
        assert facts.checkpoint_bytes > 0 and facts.key_shift == "none"
        if v.architecture == "mamba2":
            assert facts.recurrent == "recurrent" and facts.kv_bytes_per_token == 0
            assert facts.layer_kinds == ("recurrent",) * v.layers and facts.head_dim == 0
            assert facts.rope == "none: no attention layers"
            return
        heads = [v.kv_heads_of(i) for i in range(v.layers)]
        kinds = ["global" if n else "recurrent" for n in heads]
        if all(heads):
            kinds = ["global+recurrent"] * v.layers
        assert facts.recurrent == "hybrid" and list(facts.layer_kinds) == kinds
        assert facts.kv_bytes_per_token > 0
    finally:
        engine.close()


CRASH = """
import sys
from kvrt.native_bridge.llama import LlamaModel
from kvrt.native_bridge.llama_context import MAIN_SEQ, LlamaContext
model = LlamaModel(sys.argv[1])
ctx = LlamaContext(model, n_ctx=256, n_batch=64, kv_type=sys.argv[2])
tokens = model.tokenize("The keeper wrote down the colour of the sky every evening.",
                        add_special=True, parse_special=False)
ctx.decode(tokens, 0)
ctx.seq_rm(MAIN_SEQ, 2, 5)
ctx.seq_add(MAIN_SEQ, 5, len(tokens), -3)
ctx.decode([10], len(tokens) - 3)
print("survived")
"""


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("name", "kv_type"), [("qwen3-hd32", "q8_0"), ("llama", "bf16"), ("gemma3-windowed", "f16")]
)
def test_what_crashes_llama_cpp_slides_in_kvrt(name: str, kv_type: str) -> None:
    """llama.cpp's key shift kills the process on quantized keys with 32-wide heads, on
    bf16 keys and on a model whose every layer is windowed (measured in a child process);
    kvrt turns those keys itself and the same slide works, close to a fresh computation."""
    done = subprocess.run(
        [sys.executable, "-c", CRASH, zoo_path(name), kv_type], capture_output=True, timeout=120
    )
    assert done.returncode != 0 and b"survived" not in done.stdout
    engine = tiny(name, kv_type)
    assert engine.facts.key_shift == "kvrt"
    got, want = _moved_and_fresh(engine)
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_a_kv_type_kvrt_cannot_turn_where_llama_cpp_crashes_is_refused() -> None:
    with pytest.raises(kvrt.ConfigError, match=r"q4_0 KV cache with 32-wide key heads"):
        kvrt.load_engine(
            "llama",
            config=kvrt.Config(
                engine=kvrt.EngineConfig(model=zoo_path("qwen3-hd32"), kv_type="q4_0")
            ),
        )


# -- said what a model is --


def test_the_facts_say_each_layers_kind_and_the_rope() -> None:
    facts = {
        n: tiny(n).facts
        for n in (
            "gemma3",
            "gemma3-windowed",
            "gemma2",
            "llama3",
            "qwen2-yarn",
            "phi3-longrope",
            "mistral",
        )
    }
    assert facts["gemma3"].layer_kinds == ("windowed", "global")
    assert facts["gemma3-windowed"].layer_kinds == ("windowed", "windowed")
    assert facts["gemma2"].layer_kinds == ("windowed", "global")
    assert facts["mistral"].layer_kinds == ("global", "global")  # llama.cpp ignores its window
    assert "frequency factors" in (facts["llama3"].rope or "")
    assert "YaRN x4 over 1,024 tokens" in (facts["qwen2-yarn"].rope or "")
    assert facts["qwen2-yarn"].key_shift == facts["phi3-longrope"].key_shift == "kvrt"
    assert facts["llama3"].key_shift == "engine"
    assert "LongRoPE" in (facts["phi3-longrope"].context_dependent_kv or "")
    assert facts["llama3"].context_dependent_kv is None


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize(
    ("name", "scored"),
    [
        ("llama3", "keys"),
        ("qwen2-yarn", "keys"),
        ("gemma3", "lexical: the engine cannot read this model's keys"),
    ],
)
async def test_explain_says_how_relevance_was_scored(
    name: str, scored: str, anyio_backend: str
) -> None:
    """Key relevance where the model's keys can be read back to position 0; where they
    cannot (two caches with their own RoPE bases), the token score, and explain() says so."""
    async with (
        kvrt.open_runtime(engine=tiny(name), config=SMALL) as rt,
        rt.open_session(hot_tokens=256, hot_eviction="relevance") as s,
    ):
        await s.ensure_context(CONTEXT[:1])  # fits: placed in one go, before any keys
        first = "lexical: no block has key vectors yet" if scored == "keys" else scored
        assert s.explain().relevance_scoring == first
        # Larger than the window: the question is placed after a plan scored with the keys
        # of the blocks computed before it, in the same call.
        await s.ensure_context(CONTEXT)
        assert s.explain().relevance_scoring == scored
        await s.ensure_context([*CONTEXT[:-1], Segment("user", "Which word comes last?")])
        assert s.explain().relevance_scoring == scored
        assert any(b.relevance is not None for b in s.explain().blocks)


def test_quantized_keys_stored_unrotated_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp stores quantized keys Hadamard-rotated unless LLAMA_ATTN_ROT_DISABLE is
    set; then its shift has no rotation to undo (it crashes, as with 32-wide heads): kvrt
    turns the keys itself, reads them unrotated, and keeps such blocks apart from the
    rotated ones (another fingerprint, so a disk tier shared with other runs never mixes
    them)."""
    rotated = tiny("llama", "q8_0").facts
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    config = kvrt.load_config(flags={"model": zoo_path("llama"), "kv_type": "q8_0"})
    engine = kvrt.load_engine("llama", config=config)
    try:
        assert engine.facts.fingerprint != rotated.fingerprint
        assert rotated.key_shift == "engine" and engine.facts.key_shift == "kvrt"
        got, want = _moved_and_fresh(engine)
        assert int(np.argmax(got)) == int(np.argmax(want))
        tokens = engine.tokenize(STORY)
        ctx, mirror = engine.open_context(512), engine.open_context(512)
        for c in (ctx, mirror):
            c.prefill(tokens)
        block = ctx.export(10, 40)
        ctx.evict(10, 40)
        ctx.admit(block)
        probe = engine.tokenize(" The keeper", add_special=False)
        assert np.array_equal(ctx.prefill(probe), mirror.prefill(probe))
    finally:
        engine.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_longrope_blocks_on_disk_serve_only_windows_of_their_table(
    anyio_backend: str, tmp_path: Path
) -> None:
    """Across a restart: what a 384-token window wrote to disk comes back in another
    384-token window, and in a 2,048-token one nothing of it does (the other table)."""
    engine = tiny("phi3-longrope")
    flags = {
        "disk.path": str(tmp_path / "blocks"),
        **{f"session.{k}": "64" for k in ("block_tokens", "recent_tokens")},
    }
    config = kvrt.load_config(flags=flags)
    async with (
        kvrt.open_runtime(engine=engine, config=config) as rt,
        rt.open_session(hot_tokens=512, write_through="all") as s,
    ):
        await s.ensure_context(CONTEXT[:2])
    for hot, restored in ((512, True), (2048, False)):
        async with (
            kvrt.open_runtime(engine=engine, config=config) as rt,
            rt.open_session(hot_tokens=hot) as s,
        ):
            status = await s.ensure_context(CONTEXT[:2])
            assert status.exact and (status.restored_tokens > 0) is restored, (hot, status)
