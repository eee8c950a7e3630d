"""A zoo model's random weights, deterministic (seeded by the variant's name), in the
tensor names and shapes llama.cpp's loader reads for each architecture; and the embedded
SmolLM2's tokenizer, which every variant carries (its vocabulary sizes the embeddings).

Two scales matter (measured): query and key weights near 0.25 and embeddings near 1.0.
At 0.02, attention is close to uniform, and a wrong position or a wrong restore no
longer shows in the logits."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import numpy as np

from .._engine.embedded import embedded_model_path
from .._engine.gguf_header import read_header
from .variant import FFN, WIDTH, Array, Tensors, Variant

__all__ = ["SHORTCONV", "SSM", "llama3_freqs", "longrope_factors", "tensors", "tokenizer_fields"]


@functools.cache
def tokenizer_fields() -> dict[str, tuple[Any, Any, Any]]:
    """The embedded model's ``tokenizer.*`` fields as (value, type, array item type)."""
    import gguf

    fields = read_header(embedded_model_path(), lambda key: key.startswith("tokenizer."))
    return {
        key: (value, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
        for key, (value, vtype, sub) in fields.items()
    }


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


SSM = {
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
        SSM["inner_size"],
        SSM["state_size"],
        SSM["time_step_rank"],
        SSM["group_count"],
    )
    conv = inner + 2 * groups * state
    d_in = 2 * inner + 2 * groups * state + heads  # z, x, B, C and dt in one projection
    return {
        f"blk.{i}.ssm_in.weight": _normal(rng, (d_in, WIDTH), 0.1),
        f"blk.{i}.ssm_conv1d.weight": (
            rng.standard_normal((conv, SSM["conv_kernel"])) * 0.3
        ).astype(np.float32),
        f"blk.{i}.ssm_conv1d.bias": np.zeros(conv, dtype=np.float32),
        f"blk.{i}.ssm_dt.bias": (rng.standard_normal(heads) * 0.1).astype(np.float32),
        f"blk.{i}.ssm_a": -np.exp(rng.standard_normal((heads, 1)) * 0.3).astype(np.float32),
        f"blk.{i}.ssm_d": np.ones((heads, 1), dtype=np.float32),
        f"blk.{i}.ssm_norm.weight": np.ones((groups, inner // groups), dtype=np.float32),
        f"blk.{i}.ssm_out.weight": _normal(rng, (WIDTH, inner), 0.1),
    }


SHORTCONV = 3


def _shortconv(i: int, rng: np.random.Generator) -> Tensors:
    return {
        f"blk.{i}.shortconv.conv.weight": (rng.standard_normal((WIDTH, SHORTCONV)) * 0.3).astype(
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


def tensors(v: Variant) -> Tensors:
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(v.name.encode()).digest()[:8]))
    vocab = len(tokenizer_fields()["tokenizer.ggml.tokens"][0])
    out: Tensors = {"token_embd.weight": _normal(rng, (vocab, WIDTH), 1.0)}
    out["token_embd_norm.weight" if v.architecture == "lfm2" else "output_norm.weight"] = _ones(
        WIDTH
    )
    out.update(_layers(v, rng))
    if v.extra is not None:
        out.update(v.extra(v, rng))
    return out


def llama3_freqs(v: Variant, rng: np.random.Generator) -> Tensors:
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


def longrope_factors(v: Variant, rng: np.random.Generator) -> Tensors:
    """Phi-3's LongRoPE tables: short factors near 1, long ones rising to 8 along the
    head, so the two give clearly different keys."""
    n = v.head_dim // 2
    return {
        "rope_factors_short.weight": np.linspace(1.0, 1.2, n, dtype=np.float32),
        "rope_factors_long.weight": np.geomspace(1.0, 8.0, n, dtype=np.float32),
    }
