"""How a GGUF model turns its keys, as llama.cpp computes it, and what follows for kvrt.

llama.cpp reads a model's RoPE from its metadata (type, base, scaling) and tensors
(Llama 3's ``rope_freqs``, Phi-3's LongRoPE ``rope_factors_short`` / ``_long``), then
derives per context what a context's settings change:

- LongRoPE uses its short factors while a context's ``n_ctx_seq`` (its size, rounded up to
  256) is at most the original context, the long ones beyond: the same tokens at the same
  positions give other keys in a larger context. That choice is part of a block's identity
  (:meth:`ModelRope.identity`).
- YaRN and LongRoPE scale cos and sin by a magnitude (``mscale``, the attention factor).
  llama.cpp's key shift applies it again at each shift (measured: keys x1.1386 at YaRN
  factor 4, x1.19 with LongRoPE), so kvrt turns keys itself on those models
  (:meth:`ModelRope.engine_shift_rescales`).

Nothing else a context sets changes what is computed for a token at a position (read from
llama.cpp's ``llama_context`` constructor and ``get_rope_factors``: YaRN's parameters come
from the model, not the context size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvrt import ConfigError
from kvrt.native_bridge.llama import FLOAT_KV_TYPES, KV_TYPES, LlamaModel
from kvrt.native_bridge.llama_keys import TURNABLE_KEY_TYPES, key_rotation
from kvrt.native_bridge.rope import ROPE_NEOX, ROPE_NONE, ROPE_NORM, Rope

from ._gguf import GgufFile

__all__ = ["ModelRope", "key_shift", "model_rope"]

_YARN_KEYS_READ = frozenset({"grok", "mistral3"})
"""Architectures whose loader reads the ``rope.scaling.yarn_*`` keys (others use
llama.cpp's defaults whatever the file says)."""


@dataclass(frozen=True, slots=True)
class ModelRope:
    """One model's RoPE, by layer kind."""

    rope_type: int
    """llama.cpp's rope type (0 adjacent pairs, 2 split halves, others multi-axis)."""
    scaling: str
    """``none``, ``linear``, ``yarn`` or ``longrope``."""
    n_rot: int
    base: float
    freq_scale: float
    n_rot_swa: int
    base_swa: float
    freq_scale_swa: float
    ext_factor: float
    n_ctx_orig: int
    beta_fast: float
    beta_slow: float
    attn_factor: float
    """llama.cpp's context ``yarn_attn_factor`` (before ggml's own YaRN correction)."""
    freqs: tuple[float, ...] | None
    """``rope_freqs`` (Llama 3): used at every context size."""
    short: tuple[float, ...] | None
    long: tuple[float, ...] | None

    @property
    def turnable(self) -> bool:
        """Whether kvrt can turn this model's keys itself (plain pairs or halves)."""
        return self.rope_type in (ROPE_NORM, ROPE_NEOX) and self.n_rot > 0

    def factors(self, n_ctx_seq: int) -> tuple[float, ...] | None:
        """The frequency factors a context of ``n_ctx_seq`` cells per sequence uses."""
        if self.freqs is not None:
            return self.freqs
        if self.long is not None and n_ctx_seq > self.n_ctx_orig:
            return self.long
        return self.short

    def identity(self, n_ctx_seq: int) -> str:
        """What a context of this size adds to a block's identity: which LongRoPE table
        its keys were computed with ("" where every size computes the same)."""
        if self.freqs is not None or self.long is None:
            return ""
        return "long" if n_ctx_seq > self.n_ctx_orig else "short"

    def magnitude(self, swa: bool = False) -> float:
        """What each rotation multiplies keys by (ggml's ``mscale`` after llama.cpp's
        correction): 1 without YaRN or an attention factor."""
        scale = self.freq_scale_swa if swa else self.freq_scale
        m = self.attn_factor
        if self.ext_factor:
            m *= 1.0 + 0.1 * math.log(1.0 / scale)
        return m

    @property
    def engine_shift_rescales(self) -> bool:
        """Whether llama.cpp's own key shift multiplies keys by a magnitude again."""
        return abs(self.magnitude() - 1.0) > 1e-6 or abs(self.magnitude(True) - 1.0) > 1e-6

    def ropes(self, n_ctx_seq: int, *, windowed: bool) -> tuple[Rope, ...]:
        """The rotation of each KV cache a context of ``n_ctx_seq`` holds: the global
        layers', then the windowed layers' where the model has them."""
        factors = self.factors(n_ctx_seq)

        def rope(n_rot: int, base: float, scale: float) -> Rope:
            return Rope(
                n_rot=n_rot,
                rope_type=self.rope_type,
                base=base,
                freq_scale=scale,
                ext_factor=self.ext_factor,
                n_ctx_orig=self.n_ctx_orig,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                factors=factors,
            )

        out = [rope(self.n_rot, self.base, self.freq_scale)]
        if windowed:
            out.append(rope(self.n_rot_swa, self.base_swa, self.freq_scale_swa))
        return tuple(out)

    def describe(self) -> str:
        """In words: the scaling and what it depends on."""
        if self.rope_type == ROPE_NONE:
            return "none: attention without positions"
        kind = {ROPE_NORM: "adjacent pairs", ROPE_NEOX: "split halves"}.get(
            self.rope_type, f"rope type {self.rope_type}"
        )
        text = f"{kind}, base {self.base:,.0f}"
        if self.base_swa != self.base:
            text += f" (windowed layers {self.base_swa:,.0f})"
        if self.freqs is not None:
            text += f"; frequency factors (rope_freqs) {min(self.freqs):g}-{max(self.freqs):g}"
        if self.scaling == "linear" and self.freq_scale != 1.0:
            text += f"; linear scaling x{1 / self.freq_scale:g}"
        elif self.scaling == "yarn":
            text += f"; YaRN x{1 / self.freq_scale:g} over {self.n_ctx_orig:,} tokens"
        elif self.scaling == "longrope":
            text += (
                f"; LongRoPE: short factors up to {self.n_ctx_orig:,} tokens of context, "
                "long ones beyond"
            )
        m = self.magnitude()
        if abs(m - 1.0) > 1e-6:
            text += f"; magnitude x{m:.4g}"
        return text


def _get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def model_rope(model: LlamaModel, arch: str, header: GgufFile) -> ModelRope:
    """The model's RoPE as llama.cpp loaded it (its ``print_info`` lines and metadata, and
    the factor tensors of its file), with the context-level factors llama.cpp derives."""
    info = model.info

    def num(key: str, default: float) -> float:
        try:
            return float(info.get(key, default))
        except ValueError:
            return default

    def meta(key: str) -> float | None:
        raw = model.meta(f"{arch}.{key}")
        try:
            return float(raw) if raw not in (None, "") else None
        except ValueError:
            return None

    scaling = info.get("rope scaling", "linear")
    base = num("freq_base_train", 10000.0)
    scale = num("freq_scale_train", 1.0)
    if scaling == "none":
        scale = 1.0
    yarn_keys = arch in _YARN_KEYS_READ
    ext = (meta("rope.scaling.yarn_ext_factor") if yarn_keys else None) or -1.0
    if ext < 0:
        ext = 1.0 if scaling == "yarn" else 0.0
    attn = (meta("rope.scaling.yarn_attn_factor") if yarn_keys else None) or 1.0
    log_mul = num("rope_yarn_log_mul", 0.0)
    if ext:
        factor = 1.0 / scale
        if log_mul:
            mscale = log_mul if arch == "deepseek2" and log_mul != 1.0 else 1.0
            attn = _get_mscale(factor, mscale) / _get_mscale(factor, log_mul)
        else:
            attn = _get_mscale(factor, 1.0)
        attn *= 1.0 / (1.0 + 0.1 * math.log(factor))
    attn *= meta("rope.scaling.attn_factor") or 1.0
    n_rot = int(num("n_rot", 0))
    return ModelRope(
        rope_type=model.rope_type,
        scaling=scaling,
        n_rot=n_rot,
        base=base,
        freq_scale=scale,
        n_rot_swa=int(num("n_rot_swa", n_rot)),
        base_swa=num("freq_base_swa", base),
        freq_scale_swa=num("freq_scale_swa", scale),
        ext_factor=ext,
        n_ctx_orig=int(num("n_ctx_orig_yarn", model.n_ctx_train)),
        beta_fast=(meta("rope.scaling.yarn_beta_fast") if yarn_keys else None) or 32.0,
        beta_slow=(meta("rope.scaling.yarn_beta_slow") if yarn_keys else None) or 1.0,
        attn_factor=attn,
        freqs=header.tensor_f32("rope_freqs.weight"),
        short=header.tensor_f32("rope_factors_short.weight"),
        long=header.tensor_f32("rope_factors_long.weight"),
    )


def key_shift(
    rope: ModelRope, kv_type: str, head_dims: tuple[int, ...], *, empty_cache: bool, path: str
) -> str:
    """Who turns this model's keys when a block moves: ``engine`` where llama.cpp's
    shift is right, ``kvrt`` where it would scale keys again (YaRN, LongRoPE) or crash the
    process, ``none`` where neither can. llama.cpp's shift crashes (all measured) on
    quantized keys whose heads are not a multiple of 64 (it dereferences a rotation matrix
    it never built), on bf16 keys (its CPU rope has no bf16 kernel: GGML_ABORT) and on a
    model whose every layer is windowed (``empty_cache``: the global cache has no layers
    and no buffer; GGML_ASSERT). A :class:`ConfigError` where it would crash and kvrt
    cannot turn the keys instead."""
    k_type = KV_TYPES[kv_type][0]
    odd_heads = kv_type not in FLOAT_KV_TYPES and any(
        key_rotation(k_type, {d}) is None for d in head_dims
    )
    crashes = odd_heads or empty_cache or kv_type == "bf16"
    if not (crashes or rope.engine_shift_rescales):
        return "engine"
    if rope.turnable and k_type in TURNABLE_KEY_TYPES:
        return "kvrt"
    if odd_heads:
        raise ConfigError(
            f"a {kv_type} KV cache with {'/'.join(map(str, sorted(set(head_dims))))}-wide key "
            f"heads ({path}): llama.cpp's key shift crashes the process on quantized keys "
            "whose heads are not a multiple of 64, and kvrt turns f32, f16, bf16 and q8_0 "
            "keys only; use one of those for engine.kv_type"
        )
    return "none"
