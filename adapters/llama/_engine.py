"""One loaded GGUF model, shared by every context opened on it."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvrt import ConfigError, EngineError
from kvrt.backend import (
    EngineConfig,
    EngineContext,
    Logits,
    ModelFacts,
    TemplateSource,
    physical_cores,
    resolve_model_path,
)
from kvrt.native_bridge.llama import FLOAT_KV_TYPES, KV_TYPES, LlamaModel
from kvrt.native_bridge.llama_context import LlamaContext

from .._errors import translate_errors
from .._given import check_tokens
from ._context import LlamaEngineContext
from ._facts import model_facts, read_metadata
from ._hybrid import HybridWindow
from ._probe import cached_verdict
from ._rope import ModelRope
from ._together import Together

__all__ = ["BATCH", "LlamaEngine"]


BATCH = 128
"""The prefill batch where none is configured: on SmolLM2, 1,300 tokens prefilled at 114
tokens/s on one core and 216 on two, against 106 and 207 in batches of 512, with a
quarter of the attention scratch (its pages grow with batch x cells)."""


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
            facts, rope = model_facts(model, read_metadata(model, path), config, str(path))
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
        window = HybridWindow if self._facts.checkpoint_bytes else LlamaEngineContext
        return window.create(
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
