"""What an engine knows about its loaded model, its KV layout and its kernels."""

from __future__ import annotations

import msgspec

from .kernels import KernelVerdict

__all__ = ["ModelFacts"]


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine knows about its loaded model and KV layout."""

    backend: str
    """The engine that loaded the model: ``llama`` or ``openvino``."""
    path: str
    """The model file (or IR folder) loaded."""
    name: str | None
    """The model's own name from its metadata, if it has one."""
    architecture: str
    """The architecture name (``llama``, ``gemma3`` ...)."""
    fingerprint: str
    """Model digest plus KV layout: cold bytes fit only an engine with the same one."""
    n_layers: int
    """Transformer layers."""
    n_head: int
    """Attention (query) heads."""
    n_head_kv: int
    """Key/value heads (fewer than ``n_head`` with grouped-query attention)."""
    head_dim: int
    """Size of one head."""
    n_vocab: int
    """Tokens in the vocabulary."""
    trained_context: int
    """The context length the model was trained for, in tokens."""
    sliding_window: int | None
    """From the model file's metadata."""
    sliding_window_live: int | None
    """As the loaded engine reports it (``llama_model_n_swa``)."""
    sliding_window_pattern: int | None
    """Every how many layers one attends globally, where the model says."""
    swa_full: bool
    """The engine keeps windowed layers at full size, so the window saves no memory."""
    rope_freq_base: float | None
    """RoPE base frequency, where known."""
    kv_type: str
    """The KV cache precision (``f16``, ``q8_0``, ``f32`` ...)."""
    kv_bytes_per_token: int
    """KV bytes one token costs across all layers at ``kv_type``."""
    weight_bytes: int
    """Bytes of weights loaded."""
    file_bytes: int
    """Bytes of the model file(s) on disk."""
    n_swa_layers: int = 0
    """Layers that attend over the sliding window only, as the engine's KV cache holds them
    (measured from the cache's own state layout; 0 for models without a window)."""
    kv_bytes_per_token_swa: int = 0
    """Of ``kv_bytes_per_token``, the share of the windowed layers."""
    cold_bytes_per_token: int | None = None
    """Bytes one token takes in a cold block where that differs from
    ``kv_bytes_per_token``; the planner counts the cold and disk budgets with it."""
    max_block_tokens: int | None = None
    """The most tokens one cold block may hold, where the engine sets a limit: llama.cpp
    writes a windowed layer's KV only for the last ``window`` positions of a range, so on
    a sliding-window model a block is at most the window."""
    flash_attention: bool = False
    """The engine computes attention with flash attention (llama.cpp then keeps V rows
    untransposed, so its cold bytes differ from those of a context without it)."""
    kernels: KernelVerdict | None = None
    """The kernel configuration the engine runs, as the kernel probe found it on this
    machine, and why (None where the engine was not probed)."""
    chat_template: bool = True
    """The model carries a chat template; base models do not, and take text segments only."""
    rope_freq_base_swa: float | None = None
    """RoPE base frequency of the windowed layers where it differs by layer kind (Gemma 3:
    10,000 there, 1,000,000 in global layers); shifts re-rotate each layer by its own."""
    rope: str | None = None
    """The model's RoPE in words: pair layout, base, scaling (linear, YaRN, LongRoPE,
    Llama 3 frequency factors) and the magnitude it scales keys by."""
    layer_kinds: tuple[str, ...] = ()
    """Each layer's kind, ``global`` (attends to every position), ``windowed`` (the
    sliding window), ``recurrent`` (keeps a recurrent state, no KV) or ``global+recurrent``
    (attention beside a recurrent mixer, as Falcon-H1's), where the engine lets kvrt tell them apart (empty where not)."""
    rope_original_context: int | None = None
    """The context YaRN or LongRoPE scaling starts from (LongRoPE: its short factors serve
    contexts up to it), where the model scales RoPE."""
    context_dependent_kv: str | None = None
    """A context setting that changes what the engine computes for the same tokens at
    the same positions (Phi-3's LongRoPE tables by context size), if any: blocks computed
    under one setting never serve a context under another."""
    key_shift: str = "engine"
    """Who turns keys when a block moves to other positions: ``engine`` (its own shift),
    ``kvrt`` (kvrt turns the keys in the state bytes, where the engine's shift would scale
    them again or crash) or ``none`` (blocks come back at their own positions only)."""
    exact_in_place: bool = True
    """A block restored at its own positions is bit-identical to recomputing it (false
    where the KV cache re-quantizes on import)."""
    recurrent: str | None = None
    """``hybrid`` (attention layers beside recurrent ones: Granite 4, LFM2) or
    ``recurrent`` (recurrent layers alone: Mamba-2); None for attention-only models."""
    checkpoint_bytes: int = 0
    """Bytes of one checkpoint of the recurrent state (constant: it does not grow with
    the context); each cold block of such a model carries one, taken after its last
    token. 0 for attention-only models."""
