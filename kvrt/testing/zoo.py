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

What an architecture is at that size is a :class:`~.variant.Variant`; its random
weights are in :mod:`kvrt.testing.weights`. This module is the catalogue and the writer.

>>> from kvrt.testing import zoo
>>> path = zoo.write("qwen2-yarn", tmp_folder)        # doctest: +SKIP
>>> import kvrt
>>> async with kvrt.open_runtime(model=str(path)) as rt: ...   # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .variant import FFN, KV_HEADS, WIDTH, Variant
from .weights import SHORTCONV, SSM, llama3_freqs, longrope_factors, tensors, tokenizer_fields

__all__ = ["VARIANTS", "VARIANT_NAMES", "Variant", "write", "write_all"]

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
            extra=llama3_freqs,
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
            extra=longrope_factors,
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
    ssm = {f"ssm.{k}": val for k, val in SSM.items()}
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
            metadata={"shortconv.l_cache": SHORTCONV},
            recurrent=True,
        ),
        Variant(
            "lfm2-attn0",
            "lfm2",
            "LFM2 with the attention layer first",
            layers=3,
            kv_heads=(KV_HEADS, 0, 0),
            metadata={"shortconv.l_cache": SHORTCONV},
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
        for key, (value, vtype, sub) in tokenizer_fields().items():
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for tensor_name, array in tensors(v).items():
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
