"""What a GGUF model loaded by llama.cpp is, as kvrt pages it (:class:`ModelFacts`):
read from llama.cpp's own account of its layers, from one token's state bytes (the KV
caches it builds and their row layout) and from the GGUF header (RoPE scaling, windows,
layer kinds); with the kernel probe's verdict on this machine, and the fingerprint every
cold block of it carries. A model kvrt cannot page is refused here, for its true reason."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvrt import EngineError, ModelLoadError
from kvrt.backend import EngineConfig, GgufMetadata, ModelFacts, file_digest
from kvrt.native_bridge import BridgeError
from kvrt.native_bridge.llama import FLOAT_KV_TYPES, LlamaModel, kv_type_row_bytes
from kvrt.native_bridge.llama_context import MAIN_SEQ, STATE_HEAD, LlamaContext
from kvrt.native_bridge.llama_keys import StatePart, key_rotation_disabled, state_parts

from .._errors import translate_errors
from ._gguf import GgufFile
from ._probe import kernel_verdict
from ._rope import ModelRope, key_shift, model_rope

__all__ = ["model_facts", "read_metadata"]


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _attention_heads(model: LlamaModel) -> list[int]:
    """KV heads of each layer as llama.cpp loaded them (0: a recurrent layer)."""
    raw = model.info.get("n_head_kv", "")
    try:
        values = [int(x) for x in raw.strip("[]").split(",") if x.strip()]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= model.n_layer
    return values if len(values) == model.n_layer else [model.n_head_kv] * model.n_layer


def _head_dims(model: LlamaModel, windowed: bool) -> tuple[int, ...]:
    """Key head size of each KV cache: the global layers', then the windowed ones'."""

    def size(key: str, default: int) -> int:
        try:
            return int(model.info.get(key, default))
        except ValueError:
            return default

    full = size("n_embd_head_k", model.n_embd // max(model.n_head, 1))
    return (full, size("n_embd_head_k_swa", full)) if windowed else (full,)


_WINDOW_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6}
"""Architectures whose loader assumes a window pattern when the file gives none."""


def _layer_kinds(
    model: LlamaModel, header: GgufFile, arch: str, cache_layers: list[int]
) -> tuple[str, ...]:
    """Each layer's kind where it can be told, for a model kvrt runs: recurrent where
    llama.cpp gives a layer no KV heads (a hybrid's), global+recurrent on a hybrid whose
    every layer has KV heads (attention beside a recurrent mixer), windowed from the file's window pattern read as llama.cpp reads it, kept only if it
    agrees with the number of layers llama.cpp put in the windowed cache; global else."""
    heads = _attention_heads(model)
    if model.is_hybrid and all(heads):
        # Falcon-H1: every layer runs attention beside a recurrent mixer (llama.cpp keeps
        # no per-layer account of which layers are recurrent but the KV heads).
        return ("global+recurrent",) * model.n_layer
    kinds = ["global" if n else "recurrent" for n in heads]
    n_windowed = sum(cache_layers[1:]) if model.n_swa else 0
    if not n_windowed:
        return tuple(kinds)
    windowed = _window_pattern(header, arch, model.n_layer)
    if windowed is None or sum(windowed) != n_windowed:
        return ()
    return tuple("windowed" if w else kind for kind, w in zip(kinds, windowed, strict=True))


def _window_pattern(header: GgufFile, arch: str, n: int) -> list[bool] | None:
    value = header.fields.get(
        f"{arch}.attention.sliding_window_pattern", _WINDOW_PATTERN_DEFAULTS.get(arch)
    )
    if isinstance(value, list):  # one flag per layer
        return [bool(x) for x in value] if len(value) == n else None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return None
    period = value
    # llama.cpp's set_swa_pattern: in each period the last layer is global
    return [i % period < period - 1 for i in range(n)]


def read_metadata(model: LlamaModel, path: Path) -> GgufMetadata:
    """The GGUF header fields kvrt needs, as llama.cpp read them while loading."""

    def number(key: str) -> float | None:
        raw = model.meta(key)
        try:
            return float(raw) if raw not in (None, "") else None
        except ValueError:
            return None

    def integer(key: str) -> int | None:
        value = number(key)
        return int(value) if value is not None else None

    arch = model.meta("general.architecture") or "unknown"
    return GgufMetadata(
        architecture=arch,
        name=model.meta("general.name"),
        n_layers=integer(f"{arch}.block_count"),
        n_head=integer(f"{arch}.attention.head_count"),
        n_head_kv=integer(f"{arch}.attention.head_count_kv"),
        head_dim_k=integer(f"{arch}.attention.key_length"),
        head_dim_v=integer(f"{arch}.attention.value_length"),
        trained_context=integer(f"{arch}.context_length"),
        sliding_window=integer(f"{arch}.attention.sliding_window") or None,
        sliding_window_pattern=integer(f"{arch}.attention.sliding_window_pattern"),
        rope_freq_base=number(f"{arch}.rope.freq_base"),
        file_bytes=path.stat().st_size,
    )


def _cache_parts(model: LlamaModel, kv_type: str, flash: bool) -> tuple[tuple[StatePart, ...], int]:
    """The KV caches llama.cpp builds for this model, read from one token's state bytes:
    one part per cache (global layers, then windowed ones), each with its layers' bytes
    per token; and the bytes of a checkpoint of the recurrent state (0 without one),
    whose section ends the state bytes."""
    ctx = LlamaContext(model, n_ctx=16, n_batch=8, n_threads=1, kv_type=kv_type, flash_attn=flash)
    try:
        ctx.decode([0], 0)
        data = ctx.state_get(MAIN_SEQ)
        if not (model.is_hybrid or model.is_recurrent):
            return state_parts(data), 0
        checkpoint = ctx.checkpoint_get(MAIN_SEQ).size
        if model.is_recurrent:  # the recurrent state is the whole state: no KV cache
            if checkpoint != data.size:
                raise EngineError(
                    f"a recurrent model's state is {data.size} bytes but its checkpoint "
                    f"{checkpoint}: not laid out as kvrt reads it"
                )
            return (), checkpoint
        return state_parts(data[: data.size - (checkpoint - STATE_HEAD)]), checkpoint
    finally:
        ctx.close()


def _refuse_unpageable(model: LlamaModel, arch: str, path: str) -> None:
    """A :class:`ModelLoadError` naming the true reason a model has no KV kvrt can
    page exactly, read from llama.cpp's own account of its layers."""
    kinds = _attention_heads(model)
    attention = sum(1 for n in kinds if n > 0)
    if model.is_recurrent:
        if model.n_layer <= 0:
            raise ModelLoadError(f"{path} is a recurrent model ({arch}) with no layers")
        return  # no KV to page: its recurrent state is checkpointed after blocks
    if model.is_hybrid and not attention:
        raise ModelLoadError(f"{path} is a hybrid model ({arch}) with no attention layers")
    if model.n_layer <= 0 or model.n_head <= 0 or not any(kinds):
        raise ModelLoadError(f"{path} has no attention layers kvrt can page")


def model_facts(
    model: LlamaModel, meta: GgufMetadata, config: EngineConfig, path: str
) -> tuple[ModelFacts, ModelRope]:
    _refuse_unpageable(model, meta.architecture, path)
    # A recurrent model (Mamba-2) has no attention heads and no KV cache.
    head_dim_k = 0 if model.is_recurrent else meta.head_dim_k or model.n_embd // model.n_head
    head_dim_v = meta.head_dim_v or head_dim_k
    row = 0
    if not model.is_recurrent:
        try:
            row = kv_type_row_bytes(config.kv_type, model.n_head_kv * head_dim_k)
            row += kv_type_row_bytes(config.kv_type, model.n_head_kv * head_dim_v)
        except BridgeError as exc:
            raise ModelLoadError(
                f"KV type {config.kv_type} does not fit this model: {exc}"
            ) from exc
    with translate_errors(f"reading the KV layout of {path}"):
        flash = config.kv_type not in FLOAT_KV_TYPES
        parts, checkpoint = _cache_parts(model, config.kv_type, flash)
        header = GgufFile(path)
        rope = model_rope(model, meta.architecture, header)
    swa = parts[1:] if model.n_swa else ()
    shift = (
        key_shift(
            rope,
            config.kv_type,
            _head_dims(model, bool(swa)),
            empty_cache=any(not part.layers for part in parts),
            path=path,
        )
        if parts
        else "none"
    )
    # The probe fills its contexts by moving copies with the engine's own shift only
    # where that shift is safe (key_shift above says where it would crash).
    kernels = kernel_verdict(model, config, path, copies=shift == "engine")
    if kernels.flash_attention != flash:  # V rows are laid out otherwise
        flash = kernels.flash_attention
        with translate_errors(f"reading the KV layout of {path}"):
            parts, checkpoint = _cache_parts(model, config.kv_type, flash)
    digest = file_digest(Path(path))
    layout = (
        f"{digest}|{meta.architecture}|layers={model.n_layer}|kv_heads={model.n_head_kv}"
        f"|k={head_dim_k}|v={head_dim_v}|kv={config.kv_type}|rope_type={model.rope_type}"
        f"|rope_base={meta.rope_freq_base}|swa={model.n_swa}"
        # Windowed layers export every cell (KEEP_SEQ): blocks from before that differ.
        + ("|swa_cells=all" if model.n_swa else "")
        + (f"|v_trans={int(parts[0].v_trans)}" if parts else "")
        # A hybrid's cold bytes end with the recurrent state after the block
        + (
            f"|recurrent={checkpoint}" if checkpoint else ""
        )  # flash attention stores V untransposed
        # llama.cpp stores quantized keys rotated unless told not to: other bytes
        + ("|k_rot=off" if config.kv_type not in FLOAT_KV_TYPES and key_rotation_disabled() else "")
    )
    facts = ModelFacts(
        backend="llama",
        path=path,
        name=meta.name,
        architecture=meta.architecture,
        fingerprint=hashlib.sha256(layout.encode()).hexdigest()[:32],
        n_layers=model.n_layer,
        n_head=model.n_head,
        n_head_kv=model.n_head_kv,
        head_dim=head_dim_k,
        n_vocab=model.n_vocab,
        trained_context=model.n_ctx_train,
        sliding_window=meta.sliding_window,
        sliding_window_live=model.n_swa or None,
        sliding_window_pattern=meta.sliding_window_pattern,
        # Contexts keep windowed layers at full size (see LlamaContext's swa_full).
        swa_full=True,
        rope_freq_base=meta.rope_freq_base,
        kv_type=config.kv_type,
        kv_bytes_per_token=sum(part.bytes_per_token for part in parts) or row * model.n_layer,
        weight_bytes=model.size_bytes,
        file_bytes=meta.file_bytes,
        flash_attention=flash,
        kernels=kernels,
        exact_in_place=kernels.exact,
        max_block_tokens=model.n_swa or None,
        chat_template=model.has_chat_template,
        n_swa_layers=sum(len(part.layers) for part in swa),
        kv_bytes_per_token_swa=sum(part.bytes_per_token for part in swa),
        rope_freq_base_swa=_float(model.info.get("freq_base_swa")) if model.n_swa else None,
        rope="none: no attention layers" if model.is_recurrent else rope.describe(),
        layer_kinds=_layer_kinds(model, header, meta.architecture, [len(p.layers) for p in parts]),
        rope_original_context=(rope.n_ctx_orig if rope.scaling in ("yarn", "longrope") else None),
        context_dependent_kv=(
            f"LongRoPE: short factors in contexts of up to {rope.n_ctx_orig:,} tokens per "
            "sequence, long ones in larger contexts"
            if rope.identity(0)
            else None
        ),
        key_shift="none" if checkpoint else shift,
        recurrent="hybrid" if model.is_hybrid else "recurrent" if checkpoint else None,
        checkpoint_bytes=checkpoint,
    )
    return facts, rope
