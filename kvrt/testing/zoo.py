"""Tiny random-weight GGUF models of the architectures users bring, for tests.

Each :class:`Variant` is an architecture as llama.cpp loads it (tensor names and shapes
from its loader, metadata keys from its hyperparameter reader) at a toy size: 1 to 4
layers, 128 wide, f16 weights, about 13 MB. The embedded SmolLM2's ``tokenizer.*``
metadata is copied in, so every variant tokenizes real text and renders SmolLM2's chat
template. The weights are random but deterministic (seeded by the variant's name).

What the weights are for: proving the engine-level properties kvrt claims (a restore
equals a recomputation, bit for bit; a shift re-rotates keys as the model rotates them)
on each architecture's own RoPE scaling, windowing and layer kinds, in milliseconds a
call instead of seconds. The text they write is noise; tests that need real text use the
real models.

Two scales matter (measured): query and key weights near 0.25 and embeddings near 1.0.
At 0.02, attention is close to uniform, and a wrong position or a wrong restore no
longer shows in the logits.

>>> from kvrt.testing import zoo
>>> path = zoo.write("qwen2-yarn", tmp_folder)        # doctest: +SKIP
>>> import kvrt
>>> async with kvrt.open_runtime(model=str(path)) as rt: ...   # doctest: +SKIP
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._engine.embedded import embedded_model_path
from .._engine.gguf_header import read_header

__all__ = ["VARIANTS", "VARIANT_NAMES", "Variant", "write", "write_all"]

Array = npt.NDArray[Any]
Tensors = dict[str, Array]

WIDTH = 128
"""Hidden size of every variant."""
FFN = 256
HEADS = 2
KV_HEADS = 1
"""Two query heads share one key/value head (grouped-query attention); head size 64,
which llama.cpp's quantized KV caches accept (a multiple of 32; its Hadamard rotation of
quantized keys needs 64)."""


@dataclass(frozen=True)
class Variant:
    """One architecture at a toy size: how llama.cpp knows it, and what it is."""

    name: str
    """The zoo's name (``qwen2-yarn``)."""
    architecture: str
    """``general.architecture`` as llama.cpp reads it."""
    about: str
    """What it stands for, in words."""
    layers: int = 2
    context: int = 4096
    """The trained context (``context_length``)."""
    heads: int = HEADS
    kv_heads: int | tuple[int, ...] = KV_HEADS
    """Key/value heads, or one count per layer (0: a recurrent layer)."""
    rope_base: float = 10000.0
    metadata: dict[str, Any] = field(default_factory=dict)
    """Architecture keys beyond the common ones, without the ``<arch>.`` prefix."""
    extra: Callable[[Variant, np.random.Generator], Tensors] | None = None
    """Tensors beyond the layers' (RoPE factor tables)."""
    layer: str = "attention"
    """How the layers are built: ``attention``, or a hybrid's builder."""
    recurrent: bool = False
    """Whether llama.cpp runs it with recurrent state (pure or hybrid)."""
    ffn: int | tuple[int, ...] = FFN
    """Feed-forward size, or one a layer (Nemotron-H: 0 in mixer layers)."""

    @property
    def head_dim(self) -> int:
        return WIDTH // self.heads

    def kv_heads_of(self, layer: int) -> int:
        return self.kv_heads[layer] if isinstance(self.kv_heads, tuple) else self.kv_heads

    def ffn_of(self, layer: int) -> int:
        return self.ffn[layer] if isinstance(self.ffn, tuple) else self.ffn


# -- weights --


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> Array:
    return (rng.standard_normal(shape) * scale).astype(np.float16)


def _ones(n: int) -> Array:
    return np.ones(n, dtype=np.float32)


def _attention(v: Variant, i: int, rng: np.random.Generator, *, qk_norm: bool) -> Tensors:
    """Query, key, value and output projections of layer ``i`` (llama.cpp order
    ``{n_in, n_out}`` is numpy's ``(n_out, n_in)``)."""
    kv = v.kv_heads_of(i) * v.head_dim
    q = v.heads * v.head_dim
    out = {
        f"blk.{i}.attn_q.weight": _normal(rng, (q, WIDTH), 0.1),
        f"blk.{i}.attn_k.weight": _normal(rng, (kv, WIDTH), 0.1),
        f"blk.{i}.attn_v.weight": _normal(rng, (kv, WIDTH), 0.2),
        f"blk.{i}.attn_output.weight": _normal(rng, (WIDTH, q), 0.1),
    }
    if v.architecture == "qwen2":  # Qwen 2 carries biases on q, k and v
        out[f"blk.{i}.attn_q.bias"] = (rng.standard_normal(q) * 0.1).astype(np.float32)
        out[f"blk.{i}.attn_k.bias"] = (rng.standard_normal(kv) * 0.1).astype(np.float32)
        out[f"blk.{i}.attn_v.bias"] = (rng.standard_normal(kv) * 0.1).astype(np.float32)
    if qk_norm:
        out[f"blk.{i}.attn_q_norm.weight"] = _ones(v.head_dim)
        out[f"blk.{i}.attn_k_norm.weight"] = _ones(v.head_dim)
    return out


def _ffn(i: int, rng: np.random.Generator, *, fused_up: bool = False) -> Tensors:
    if fused_up:  # Phi-3: gate and up in one matrix
        return {
            f"blk.{i}.ffn_up.weight": _normal(rng, (2 * FFN, WIDTH), 0.1),
            f"blk.{i}.ffn_down.weight": _normal(rng, (WIDTH, FFN), 0.1),
        }
    return {
        f"blk.{i}.ffn_gate.weight": _normal(rng, (FFN, WIDTH), 0.1),
        f"blk.{i}.ffn_up.weight": _normal(rng, (FFN, WIDTH), 0.1),
        f"blk.{i}.ffn_down.weight": _normal(rng, (WIDTH, FFN), 0.1),
    }


_SSM = {
    "conv_kernel": 4,
    "inner_size": 2 * WIDTH,
    "state_size": 16,
    "time_step_rank": 4,
    "group_count": 1,
}
"""Mamba-2 mixer sizes: inner size twice the width (the only expansion llama.cpp's Granite
hybrid takes), four SSM heads of 64, one group."""


def _mamba2(i: int, rng: np.random.Generator) -> Tensors:
    inner, state, heads, groups = (
        _SSM["inner_size"],
        _SSM["state_size"],
        _SSM["time_step_rank"],
        _SSM["group_count"],
    )
    conv = inner + 2 * groups * state
    d_in = 2 * inner + 2 * groups * state + heads  # z, x, B, C and dt in one projection
    return {
        f"blk.{i}.ssm_in.weight": _normal(rng, (d_in, WIDTH), 0.1),
        f"blk.{i}.ssm_conv1d.weight": (
            rng.standard_normal((conv, _SSM["conv_kernel"])) * 0.3
        ).astype(np.float32),
        f"blk.{i}.ssm_conv1d.bias": np.zeros(conv, dtype=np.float32),
        f"blk.{i}.ssm_dt.bias": (rng.standard_normal(heads) * 0.1).astype(np.float32),
        f"blk.{i}.ssm_a": -np.exp(rng.standard_normal((heads, 1)) * 0.3).astype(np.float32),
        f"blk.{i}.ssm_d": np.ones((heads, 1), dtype=np.float32),
        f"blk.{i}.ssm_norm.weight": np.ones((groups, inner // groups), dtype=np.float32),
        f"blk.{i}.ssm_out.weight": _normal(rng, (WIDTH, inner), 0.1),
    }


_SHORTCONV = 3


def _shortconv(i: int, rng: np.random.Generator) -> Tensors:
    return {
        f"blk.{i}.shortconv.conv.weight": (rng.standard_normal((WIDTH, _SHORTCONV)) * 0.3).astype(
            np.float32
        ),
        f"blk.{i}.shortconv.in_proj.weight": _normal(rng, (3 * WIDTH, WIDTH), 0.1),
        f"blk.{i}.shortconv.out_proj.weight": _normal(rng, (WIDTH, WIDTH), 0.1),
    }


def _layers(v: Variant, rng: np.random.Generator) -> Tensors:
    out: Tensors = {}
    arch = v.architecture
    for i in range(v.layers):
        out[f"blk.{i}.attn_norm.weight"] = _ones(WIDTH)
        recurrent = v.recurrent and v.kv_heads_of(i) == 0
        if arch == "mamba2":
            out.update(_mamba2(i, rng))
            continue
        if arch == "nemotron_h":  # one mixer a layer: Mamba-2, attention or an MLP
            if v.ffn_of(i):
                out[f"blk.{i}.ffn_up.weight"] = _normal(rng, (v.ffn_of(i), WIDTH), 0.1)
                out[f"blk.{i}.ffn_down.weight"] = _normal(rng, (WIDTH, v.ffn_of(i)), 0.1)
            elif recurrent:
                out.update(_mamba2(i, rng))
            else:
                out.update(_attention(v, i, rng, qk_norm=False))
            continue
        if arch == "falcon-h1":  # attention and a Mamba-2 mixer side by side in each layer
            out.update(_mamba2(i, rng))
            out.update(_attention(v, i, rng, qk_norm=False))
            out[f"blk.{i}.ffn_norm"] = _ones(WIDTH)  # no ".weight" on this one
            out.update(_ffn(i, rng))
            continue
        if recurrent and arch == "granitehybrid":
            out.update(_mamba2(i, rng))
        elif recurrent and arch == "lfm2":
            out.update(_shortconv(i, rng))
        else:
            out.update(_attention(v, i, rng, qk_norm=arch in ("qwen3", "gemma3", "lfm2")))
        if arch in ("gemma2", "gemma3"):
            out[f"blk.{i}.post_attention_norm.weight"] = _ones(WIDTH)
            out[f"blk.{i}.post_ffw_norm.weight"] = _ones(WIDTH)
        out[f"blk.{i}.ffn_norm.weight"] = _ones(WIDTH)
        out.update(_ffn(i, rng, fused_up=arch == "phi3"))
    return out


def _tensors(v: Variant) -> Tensors:
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(v.name.encode()).digest()[:8]))
    vocab = len(_tokenizer()["tokenizer.ggml.tokens"][0])
    out: Tensors = {"token_embd.weight": _normal(rng, (vocab, WIDTH), 1.0)}
    out["token_embd_norm.weight" if v.architecture == "lfm2" else "output_norm.weight"] = _ones(
        WIDTH
    )
    out.update(_layers(v, rng))
    if v.extra is not None:
        out.update(v.extra(v, rng))
    return out


def _llama3_freqs(v: Variant, rng: np.random.Generator) -> Tensors:
    """Llama 3.1's frequency factors (factor 8, low 1, high 4, original context 8192)
    for this head size, as its converter computes them."""
    base, dim, factor, low, high, old = v.rope_base, v.head_dim, 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    factors = np.where(
        wavelen < old / high,
        1.0,
        np.where(wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    return {"rope_freqs.weight": factors.astype(np.float32)}


def _longrope_factors(v: Variant, rng: np.random.Generator) -> Tensors:
    """Phi-3's LongRoPE tables: short factors near 1, long ones rising to 8 along the
    head, so the two give clearly different keys."""
    n = v.head_dim // 2
    return {
        "rope_factors_short.weight": np.linspace(1.0, 1.2, n, dtype=np.float32),
        "rope_factors_long.weight": np.geomspace(1.0, 8.0, n, dtype=np.float32),
    }


# -- the variants --


def _attention_variants() -> list[Variant]:
    longrope = {
        "rope.scaling.type": "longrope",
        "rope.scaling.original_context_length": 512,
        "rope.scaling.attn_factor": float(np.sqrt(1 + np.log(8) / np.log(512))),
    }
    return [
        Variant("llama", "llama", "Llama 2 / SmolLM: plain RoPE", context=8192),
        Variant(
            "llama3",
            "llama",
            "Llama 3.1 / 3.2: RoPE with per-dimension frequency factors (rope_freqs)",
            context=16384,
            rope_base=500000.0,
            extra=_llama3_freqs,
        ),
        Variant(
            "llama-linear",
            "llama",
            "linear RoPE scaling (factor 2)",
            context=8192,
            metadata={"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
        ),
        Variant(
            "mistral",
            "llama",
            "Mistral 7B v0.1: a sliding window in the metadata, which llama.cpp ignores",
            metadata={"attention.sliding_window": 256},
        ),
        Variant("qwen2", "qwen2", "Qwen 2 / 2.5: q, k, v biases", rope_base=1000000.0),
        Variant(
            "qwen2-yarn",
            "qwen2",
            "Qwen 2.5 with YaRN (factor 4 over 1,024 tokens)",
            rope_base=1000000.0,
            metadata={
                "rope.scaling.type": "yarn",
                "rope.scaling.factor": 4.0,
                "rope.scaling.original_context_length": 1024,
            },
        ),
        Variant("qwen3", "qwen3", "Qwen 3: per-head q/k RMS norms", rope_base=1000000.0),
        Variant(
            "qwen3-hd32",
            "qwen3",
            "Qwen 3 with 32-wide heads (four query, two key/value)",
            heads=4,
            kv_heads=2,
            rope_base=1000000.0,
        ),
        Variant("phi3", "phi3", "Phi-3 mini 4k: fused gate/up, plain RoPE"),
        Variant(
            "phi3-longrope",
            "phi3",
            "Phi-3 / 3.5 / 4-mini 128k: LongRoPE, short factors up to 512 tokens, long beyond",
            metadata=longrope,
            extra=_longrope_factors,
        ),
        Variant(
            "gemma2",
            "gemma2",
            "Gemma 2: every other layer windowed (128), logit soft-capping",
            metadata={
                "attention.sliding_window": 128,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
            },
        ),
        Variant(
            "gemma3",
            "gemma3",
            "Gemma 3: windowed layers (128) with their own RoPE base, one global layer",
            rope_base=1000000.0,
            metadata={
                "attention.sliding_window": 128,
                "attention.sliding_window_pattern": 2,
                "rope.freq_base_swa": 10000.0,
            },
        ),
        Variant(
            "gemma3-windowed",
            "gemma3",
            "Gemma 3 with every layer windowed (128)",
            rope_base=1000000.0,
            metadata={
                "attention.sliding_window": 128,
                "attention.sliding_window_pattern": [True, True],
                "rope.freq_base_swa": 10000.0,
            },
        ),
    ]


def _recurrent_variants() -> list[Variant]:
    ssm = {f"ssm.{k}": val for k, val in _SSM.items()}
    return [
        Variant(
            "mamba2",
            "mamba2",
            "Mamba-2: recurrent state only, no attention",
            heads=0,
            kv_heads=0,
            metadata=ssm,
            recurrent=True,
        ),
        Variant(
            "granitehybrid",
            "granitehybrid",
            "Granite 4: Mamba-2 layers around one attention layer",
            layers=3,
            kv_heads=(0, KV_HEADS, 0),
            metadata=ssm,
            recurrent=True,
        ),
        Variant(
            "granitehybrid-attn0",
            "granitehybrid",
            "Granite 4 with the attention layer first",
            layers=3,
            kv_heads=(KV_HEADS, 0, 0),
            metadata=ssm,
            recurrent=True,
        ),
        Variant(
            "nemotron-h",
            "nemotron_h",
            "Nemotron-H: Mamba-2, attention and MLP layers, one mixer each",
            layers=3,
            kv_heads=(0, KV_HEADS, 0),
            ffn=(0, 0, FFN),
            metadata=ssm,
            recurrent=True,
        ),
        Variant(
            "falcon-h1",
            "falcon-h1",
            "Falcon-H1: attention beside a Mamba-2 mixer in every layer",
            metadata=ssm,
            recurrent=True,
        ),
        Variant(
            "lfm2",
            "lfm2",
            "LFM2: short-convolution layers around one attention layer",
            layers=3,
            kv_heads=(0, KV_HEADS, 0),
            metadata={"shortconv.l_cache": _SHORTCONV},
            recurrent=True,
        ),
        Variant(
            "lfm2-attn0",
            "lfm2",
            "LFM2 with the attention layer first",
            layers=3,
            kv_heads=(KV_HEADS, 0, 0),
            metadata={"shortconv.l_cache": _SHORTCONV},
            recurrent=True,
        ),
    ]


def _one_layer(v: Variant) -> Variant:
    """``v`` with one layer: its keys and values then depend only on the token and its
    position, so a block re-rotated to a new position must equal one computed there."""
    return Variant(
        f"{v.name}-1l",
        v.architecture,
        f"{v.about}; one layer",
        layers=1,
        context=v.context,
        heads=v.heads,
        kv_heads=v.kv_heads,
        rope_base=v.rope_base,
        metadata={k: (val[:1] if isinstance(val, list) else val) for k, val in v.metadata.items()},
        extra=v.extra,
    )


def _all() -> list[Variant]:
    attention = _attention_variants()
    rerotated = ("llama", "llama3", "qwen2-yarn", "phi3-longrope", "gemma3")
    one = [_one_layer(v) for v in attention if v.name in rerotated]
    return attention + one + _recurrent_variants()


VARIANTS: dict[str, Variant] = {v.name: v for v in _all()}
"""Every variant by name."""
VARIANT_NAMES: tuple[str, ...] = tuple(VARIANTS)


# -- writing --


@functools.cache
def _tokenizer() -> dict[str, tuple[Any, Any, Any]]:
    """The embedded model's ``tokenizer.*`` fields as (value, type, array item type)."""
    import gguf

    fields = read_header(embedded_model_path(), lambda key: key.startswith("tokenizer."))
    return {
        key: (value, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
        for key, (value, vtype, sub) in fields.items()
    }


def _metadata(v: Variant) -> Iterator[tuple[str, Any, Any, Any]]:
    import gguf

    u32, f32, arr = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.ARRAY
    a = v.architecture
    yield (
        "general.name",
        f"kvrt zoo {v.name}".replace("phi3", "p3"),
        gguf.GGUFValueType.STRING,
        None,
    )
    yield "general.file_type", 1, u32, None  # mostly f16 (OpenVINO's GGUF reader needs it)
    yield f"{a}.block_count", v.layers, u32, None
    yield f"{a}.context_length", v.context, u32, None
    yield f"{a}.embedding_length", WIDTH, u32, None
    if isinstance(v.ffn, tuple):
        yield f"{a}.feed_forward_length", list(v.ffn), arr, u32
    else:
        yield f"{a}.feed_forward_length", 0 if a == "mamba2" else v.ffn, u32, None
    yield f"{a}.attention.head_count", v.heads, u32, None
    if isinstance(v.kv_heads, tuple):
        yield f"{a}.attention.head_count_kv", list(v.kv_heads), arr, u32
    else:
        yield f"{a}.attention.head_count_kv", v.kv_heads, u32, None
    yield f"{a}.attention.layer_norm_rms_epsilon", 1e-5, f32, None
    if a == "nemotron_h":
        yield f"{a}.attention.layer_norm_epsilon", 1e-5, f32, None
    if a != "mamba2":
        yield f"{a}.rope.freq_base", v.rope_base, f32, None
        yield f"{a}.rope.dimension_count", v.head_dim, u32, None
    for key, value in v.metadata.items():
        if isinstance(value, bool) or (isinstance(value, list) and isinstance(value[0], bool)):
            kind = (
                (arr, gguf.GGUFValueType.BOOL)
                if isinstance(value, list)
                else (gguf.GGUFValueType.BOOL, None)
            )
        elif isinstance(value, str):
            kind = (gguf.GGUFValueType.STRING, None)
        elif isinstance(value, float):
            kind = (f32, None)
        else:
            kind = (u32, None)
        yield f"{a}.{key}", value, *kind


def write(name: str, folder: str | os.PathLike[str], *, context: int | None = None) -> Path:
    """Write the variant ``name`` as ``<folder>/<name>.gguf`` (once: an existing file
    written by this zoo is kept) and return its path; with ``context``, trained on that
    many tokens instead, as ``<name>-<context>.gguf`` (a context past a short trained one
    is cheap to test). Needs the ``gguf`` package (the ``test`` extra), which kvrt itself
    does not install."""
    try:
        import gguf  # noqa: F401  (the writer below needs it: say so before any work)
    except ImportError:
        raise ImportError(
            "kvrt.testing.zoo writes GGUF files with the gguf package: pip install gguf "
            "(or kvrt's test extra)"
        ) from None

    v = VARIANTS[name]
    if context is not None:
        v = replace(v, context=context)
        name = f"{name}-{context}"
    target = Path(folder) / f"{name}.gguf"
    if target.is_file():
        return target

    def fill(writer: Any) -> None:
        for key, value, vtype, sub in _metadata(v):
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for key, (value, vtype, sub) in _tokenizer().items():
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for tensor_name, array in _tensors(v).items():
            writer.add_tensor(tensor_name, array)

    return written(target, v.architecture, fill)


def written(target: Path, architecture: str, fill: Callable[[Any], None]) -> Path:
    """``target`` written whole by a GGUF writer ``fill`` adds keys and tensors to: into
    a temporary file beside it, renamed into place once complete (a crash leaves none)."""
    import gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".part", dir=target.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(temp, architecture)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(temp, 0o644)
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return target


def write_all(folder: str | os.PathLike[str]) -> dict[str, Path]:
    """Every variant written into ``folder``, by name."""
    return {name: write(name, folder) for name in VARIANT_NAMES}
