"""A llama of a realistic size with random weights, for benchmarks that need one.

Decoding a 135M-parameter model is bound by its compute; a model of a billion parameters
is bound by reading its weights, which is what batching sessions together saves. No such
model ships with kvrt and none may be fetched, so :func:`write` writes one: Llama 3.2 1B's
shape (2,048 wide, 16 layers, 32 query heads sharing 8 key/value heads, feed-forward 8,192),
SmolLM2's tokenizer (so it tokenizes real text and renders a chat template), weights
random but deterministic and quantized as llama.cpp would run them (``q4_0`` by default:
about 0.6 GB). The text it writes is noise: a benchmark fixes reply lengths instead.

>>> from kvrt.testing import sized
>>> path = sized.write(folder)           # doctest: +SKIP  (about a minute on two cores)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from . import weights, zoo

__all__ = ["QUANTS", "write"]

QUANTS = ("q4_0", "q8_0", "f16")


def _metadata(writer: Any, *, width: int, layers: int, heads: int, kv_heads: int, ffn: int) -> None:
    writer.add_name(f"kvrt sized llama {width}x{layers}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(width)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(width // heads)
    for key, (value, vtype, sub) in weights.tokenizer_fields().items():
        writer.add_key_value(key, value, vtype, sub_type=sub)


def write(
    folder: str | os.PathLike[str],
    *,
    width: int = 2048,
    layers: int = 16,
    heads: int = 32,
    kv_heads: int = 8,
    ffn: int = 8192,
    quant: str = "q4_0",
) -> Path:
    """Write the model as ``<folder>/llama-<width>x<layers>-<quant>.gguf`` (once: an
    existing file is kept) and return its path. Needs the ``gguf`` package (the ``test``
    extra)."""
    import gguf
    from gguf.quants import quantize

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if width % heads or width % 32 or ffn % 32:
        raise ValueError("width must divide by heads and by 32, ffn by 32")
    target = Path(folder) / f"llama-{width}x{layers}-{quant}.gguf"
    if target.is_file():
        return target
    kind = {
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "f16": gguf.GGMLQuantizationType.F16,
    }[quant]
    rng = np.random.default_rng(2048)
    head = width // heads
    vocab = len(weights.tokenizer_fields()["tokenizer.ggml.tokens"][0])

    def matrix(rows: int, cols: int, scale: float) -> tuple[Any, Any]:
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float32)
        if kind == gguf.GGMLQuantizationType.F16:
            return values.astype(np.float16), None
        return quantize(values, kind), kind

    def fill(writer: Any) -> None:
        _metadata(writer, width=width, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn)
        writer.add_file_type(
            {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(
                quant, gguf.LlamaFileType.MOSTLY_F16
            )
        )
        tensors: dict[str, tuple[Any, Any]] = {
            "token_embd.weight": matrix(vocab, width, 0.05),
            "output_norm.weight": (np.ones(width, dtype=np.float32), None),
        }
        # Scales keep activations of a random network in range (1/sqrt(fan-in)), with
        # queries and keys larger so attention is not uniform.
        s = 1.0 / np.sqrt(width)
        for i in range(layers):
            tensors |= {
                f"blk.{i}.attn_norm.weight": (np.ones(width, dtype=np.float32), None),
                f"blk.{i}.attn_q.weight": matrix(heads * head, width, 4 * s),
                f"blk.{i}.attn_k.weight": matrix(kv_heads * head, width, 4 * s),
                f"blk.{i}.attn_v.weight": matrix(kv_heads * head, width, s),
                f"blk.{i}.attn_output.weight": matrix(width, heads * head, s),
                f"blk.{i}.ffn_norm.weight": (np.ones(width, dtype=np.float32), None),
                f"blk.{i}.ffn_gate.weight": matrix(ffn, width, s),
                f"blk.{i}.ffn_up.weight": matrix(ffn, width, s),
                f"blk.{i}.ffn_down.weight": matrix(width, ffn, 1.0 / np.sqrt(ffn)),
            }
        for name, (array, raw) in tensors.items():
            writer.add_tensor(name, array, raw_dtype=raw)

    return zoo.written(target, "llama", fill)
