"""One loaded GGUF model, shared by every context opened on it."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path

from kvrt import ConfigError, EngineError, ModelLoadError
from kvrt.backend import (
    EngineConfig,
    EngineContext,
    GgufMetadata,
    Logits,
    ModelFacts,
    TemplateSource,
    file_digest,
    physical_cores,
    resolve_model_path,
)
from kvrt.native_bridge import BridgeError
from kvrt.native_bridge.llama import FLOAT_KV_TYPES, KV_TYPES, LlamaModel, kv_type_row_bytes
from kvrt.native_bridge.llama_context import MAIN_SEQ, STATE_HEAD, LlamaContext
from kvrt.native_bridge.llama_keys import StatePart, key_rotation_disabled, state_parts

from .._errors import translate_errors
from .._window import check_tokens
from ._context import LlamaEngineContext
from ._gguf import GgufFile
from ._probe import cached_verdict, kernel_verdict
from ._rope import ModelRope, key_shift, model_rope
from ._together import Together

__all__ = ["BATCH", "LlamaEngine"]


BATCH = 128
"""The prefill batch where none is configured: on SmolLM2, 1,300 tokens prefilled at 114
tokens/s on one core and 216 on two, against 106 and 207 in batches of 512, with a
quarter of the attention scratch (its pages grow with batch x cells)."""


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


def _header(model: LlamaModel, path: Path) -> GgufMetadata:
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


class LlamaEngine:
    """A GGUF model loaded by llama.cpp; open one :class:`LlamaEngineContext` per session.

    >>> engine = LlamaEngine.open(EngineConfig())           # the embedded SmolLM2
    >>> ctx = engine.open_context(512)
    >>> logits = ctx.prefill(engine.tokenize("Hello"))
    >>> ctx.close(); engine.close()
    """

    backend = "llama"

    def __init__(
        self, model: LlamaModel, config: EngineConfig, facts: ModelFacts, rope: ModelRope
    ) -> None:
        self._model = model
        self.config = config
        self._facts = facts
        self._rope = rope
        self._spare: LlamaContext | None = None
        """The last closed window's context, for the next window to start in: creating one
        allocates and clears its KV buffer and reserves its compute graph, on the path of
        every session opened (a conversation taking its turn in ``kvrt serve``)."""
        self._spare_lock = threading.Lock()
        self._together = Together(
            model,
            facts,
            rope,
            streams=config.together,
            n_threads=config.threads or physical_cores(),
        )

    @classmethod
    def open(cls, config: EngineConfig) -> LlamaEngine:
        if config.kv_type not in KV_TYPES:
            raise ConfigError(
                f"invalid engine.kv_type for llama.cpp: {config.kv_type!r} "
                f"(expected one of: {', '.join(KV_TYPES)})"
            )
        if config.flash_attention == "off" and config.kv_type not in FLOAT_KV_TYPES:
            raise ConfigError(
                f"a {config.kv_type} KV cache needs flash attention in llama.cpp: set "
                "engine.flash_attention to auto or on, or use an f16 cache"
            )
        path = resolve_model_path(config.model)
        with translate_errors(f"loading {path}"):
            model = LlamaModel(str(path))
        try:
            facts, rope = cls._facts_for(model, _header(model, path), config, str(path))
        except BaseException:
            model.close()
            raise
        return cls(model, config, facts, rope)

    @staticmethod
    def flash_attention(config: EngineConfig) -> bool:
        """Whether contexts of an engine opened with ``config`` use flash attention: as
        set, or as the kernel probe's verdict on this machine has it (its record is kept
        once an engine has opened); before any, on only where the KV type needs it (a
        quantized V cache). Whether flash attention is exact and faster depends on the
        CPU and the model: on SmolLM2 it made logits depend on how a prompt is cut on two
        machines (64-token pieces: max |Δ| 0.79 on one; pieces of 8: 0.75 on an AMD EPYC
        with AVX-512, where 128-token pieces agreed), and prefilled slower on the second."""
        if config.flash_attention != "auto":
            return config.flash_attention == "on"
        with translate_errors("reading the kernel probe's record"):
            found = cached_verdict(config, str(resolve_model_path(config.model)))
        return found.flash_attention if found else config.kv_type not in FLOAT_KV_TYPES

    @staticmethod
    def _cache_parts(
        model: LlamaModel, kv_type: str, flash: bool
    ) -> tuple[tuple[StatePart, ...], int]:
        """The KV caches llama.cpp builds for this model, read from one token's state bytes:
        one part per cache (global layers, then windowed ones), each with its layers' bytes
        per token; and the bytes of a checkpoint of the recurrent state (0 without one),
        whose section ends the state bytes."""
        ctx = LlamaContext(
            model, n_ctx=16, n_batch=8, n_threads=1, kv_type=kv_type, flash_attn=flash
        )
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

    @staticmethod
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

    @staticmethod
    def _facts_for(
        model: LlamaModel, meta: GgufMetadata, config: EngineConfig, path: str
    ) -> tuple[ModelFacts, ModelRope]:
        LlamaEngine._refuse_unpageable(model, meta.architecture, path)
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
            parts, checkpoint = LlamaEngine._cache_parts(model, config.kv_type, flash)
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
                parts, checkpoint = LlamaEngine._cache_parts(model, config.kv_type, flash)
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
            + (
                "|k_rot=off"
                if config.kv_type not in FLOAT_KV_TYPES and key_rotation_disabled()
                else ""
            )
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
            layer_kinds=_layer_kinds(
                model, header, meta.architecture, [len(p.layers) for p in parts]
            ),
            rope_original_context=(
                rope.n_ctx_orig if rope.scaling in ("yarn", "longrope") else None
            ),
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

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def closed(self) -> bool:
        return self._model.closed

    # -- text --

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Token ids for ``text``; ``add_special`` adds the model's BOS where it uses one."""
        with translate_errors("tokenizing"):
            return self._model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._check_tokens(tokens)
        with translate_errors("detokenizing"):
            return self._model.detokenize(tokens)

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token, for streaming text (may split a UTF-8 character)."""
        self._check_tokens([token])
        with translate_errors("detokenizing"):
            return self._model.token_piece(token)

    def is_end_of_generation(self, token: int) -> bool:
        self._check_tokens([token])
        with translate_errors("reading the vocabulary"):
            return self._model.is_end_of_generation(token)

    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render ``(role, content)`` pairs with the model's own chat template."""
        with translate_errors("applying the chat template"):
            return self._model.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt
            )

    def chat_template_source(self) -> TemplateSource | None:
        """The GGUF's ``tokenizer.chat_template`` and its BOS and EOS token texts."""
        with translate_errors("reading the chat template"):
            found = self._model.chat_template_source()
        if found is None:
            return None
        text, bos, eos = found
        return TemplateSource(text=text, bos_token=bos, eos_token=eos)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        check_tokens(tokens, self._facts.n_vocab)

    # -- contexts --

    def open_context(self, n_ctx: int, *, n_batch: int | None = None) -> LlamaEngineContext:
        """A new KV window of ``n_ctx`` cells on this model."""
        if self._model.closed:
            raise EngineError("the engine is closed")
        with self._spare_lock:
            spare, self._spare = self._spare, None
        return LlamaEngineContext.create(
            self._model,
            self._facts,
            self._rope,
            n_ctx=n_ctx,
            n_batch=n_batch or self.config.batch or BATCH,
            n_threads=self.config.threads or physical_cores(),
            spare=spare,
            release=self._keep_spare,
            together=self._together,
        )

    # -- windows stepping together --

    def joins(self, ctx: EngineContext) -> bool:
        """Whether ``ctx``'s steps may run beside other windows' (:meth:`step_together`):
        the kernel probe found sequences decoded together exact here, and its window
        is one that can (see :mod:`._together`)."""
        return isinstance(ctx, LlamaEngineContext) and ctx.joins

    @property
    def streams(self) -> int:
        """Windows that may step in one engine call: ``engine.together`` where this
        engine offers it (see :mod:`._together`), else 1."""
        return self._together.streams if self._together.offered else 1

    def away(self, ctx: EngineContext) -> bool:
        """Whether ``ctx``'s window is in the engine's streams."""
        return isinstance(ctx, LlamaEngineContext) and ctx.away

    def settle(self, ctx: EngineContext) -> None:
        """Bring ``ctx``'s window back from the engine's streams, if it is there."""
        if isinstance(ctx, LlamaEngineContext):
            ctx.settle()

    @property
    def joint_steps(self) -> int:
        """Steps that advanced two windows or more in one engine call, so far."""
        return self._together.steps

    @property
    def stream_bytes(self) -> int:
        """KV bytes of the streams windows step together in (0 before any did)."""
        return self._together.nbytes

    gather_seconds: float | None = None
    """A window missing from a joint step steps in the next one, in its own stream: the
    runtime's default wait."""

    def stream_bytes_at(self, window_tokens: int) -> int:
        """The most KV bytes the streams hold while windows of up to ``window_tokens``
        step together, beside the windows' own contexts."""
        return self._together.most_bytes(window_tokens)

    def step_together(self, steps: Sequence[tuple[EngineContext, int]]) -> list[Logits | Exception]:
        """Advance each ``(context, token)`` by its token: the windows in (or moved into)
        the engine's streams in one engine call, any other alone in its own context.
        Each gets its next logits, or the error its step raised (a step refused leaves
        its window as it was)."""
        windows: list[LlamaEngineContext | Exception] = [
            c if isinstance(c, LlamaEngineContext) else EngineError("a context of another engine")
            for c, _ in steps
        ]
        return self._together.step_windows(windows, [t for _, t in steps])

    def _keep_spare(self, ctx: LlamaContext) -> None:
        """Keep a closed window's context for the next window (one at most: the one kept
        before is freed)."""
        with self._spare_lock:
            old, self._spare = self._spare, ctx
            if self._model.closed:  # closed meanwhile: nothing will take it
                old, self._spare = ctx, None
        if old is not None and not old.closed:
            old.close()

    def release_spare(self) -> None:
        """Free the closed window's context kept for the next window, if any (a runtime
        that has had no session for a while calls this)."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None and not spare.closed:
            spare.close()

    @property
    def holds_spare(self) -> bool:
        """Whether a closed window's context is kept for the next window."""
        with self._spare_lock:
            return self._spare is not None

    def close(self) -> None:
        """Close every context still open on this engine (the spare too), then free the
        model."""
        with self._spare_lock:
            self._spare = None
        self._together.close()
        with translate_errors("closing the model"):
            self._model.close(close_contexts=True)
