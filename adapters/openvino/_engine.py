"""One compiled stateful IR, shared by every context (infer request) opened on it."""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvrt import ConfigError, EngineError, InvalidRangeError, ModelLoadError
from kvrt.backend import (
    EngineConfig,
    EngineContext,
    Logits,
    ModelFacts,
    TemplateSource,
    file_digest,
)
from kvrt.native_bridge.openvino import COLD_BYTES, DETERMINISTIC, KV_PRECISIONS, OvModel

from .._errors import translate_errors
from .._given import check_tokens
from ._context import EXACT_KV, OpenVinoEngineContext
from ._prepare import IrInfo, prepare_ir
from ._probe import TEXT as PROBE_TEXT
from ._probe import kernel_verdict
from ._rows import Rows

__all__ = ["PROFILES", "OpenVinoEngine"]

PROFILES: dict[str, dict[str, str]] = {
    "deterministic": {k: v for k, v in DETERMINISTIC.items() if k != "KV_CACHE_PRECISION"},
    "default": {},
}
"""Compile settings by name; the KV precision comes from ``engine.kv_type``."""

GATHER_SECONDS = 0.025
"""How long the runtime waits for a joint step's sessions to come back: a window missing
from a step comes home and joins again later, a pass over every row each way (about 45 ms
a miss, estimated from two runs of eight SmolLM2 windows of some 100 tokens: 14.2 s with
216 misses against 4.3 s with 7), where a wait ends as soon as the last one is back."""


class _BuildProgress:
    """A progress bar on stderr, shown only once a build actually starts."""

    def __init__(self) -> None:
        from rich.progress import Progress

        self._bar = Progress(transient=True)
        self._task = self._bar.add_task("preparing the OpenVINO model", total=1.0)
        self._started = False

    def __call__(self, stage: str, fraction: float) -> None:
        if not self._started:
            self._bar.start()
            self._started = True
        self._bar.update(self._task, description=stage, completed=fraction)

    def close(self) -> None:
        if self._started:
            self._bar.stop()


class OpenVinoEngine:
    """A stateful IR compiled for the CPU; one :class:`OpenVinoEngineContext` per session."""

    backend = "openvino"

    def __init__(
        self,
        model: OvModel,
        tokenizer: Any,
        config: EngineConfig,
        facts: ModelFacts,
        eos: set[int],
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self.config = config
        self._facts = facts
        self._eos = eos
        self._closed = False
        self._rows = Rows(model, facts, streams=config.together)
        self._bytes, self._special = self._vocabulary(tokenizer, facts.n_vocab)
        self._bos = int(tokenizer.get_bos_token_id())
        names = sorted(
            {self._tokenizer.decode([t], skip_special_tokens=False) for t in self._special},
            key=len,
            reverse=True,
        )
        self._markup = re.compile("|".join(map(re.escape, filter(None, names)))) if names else None
        """Finds special-token strings in text, to keep them plain where asked."""

    @classmethod
    def open(cls, config: EngineConfig) -> OpenVinoEngine:
        kv = config.kv_type
        if kv not in KV_PRECISIONS:
            raise ConfigError(
                f"invalid engine.kv_type for OpenVINO: {config.kv_type!r} (expected one of: {', '.join(KV_PRECISIONS)})"
            )
        if config.require_exact and kv not in EXACT_KV:
            raise ConfigError(
                f"engine.require_exact is set but a {kv} KV cache re-quantizes on import, so restores "
                f"cannot be bit-exact; use one of {', '.join(EXACT_KV)}"
            )
        if config.flash_attention != "auto":
            raise ConfigError(
                f"engine.flash_attention={config.flash_attention} is a llama.cpp setting; "
                "OpenVINO takes only auto"
            )
        profile = PROFILES.get(config.openvino_profile)
        if profile is None:
            raise ConfigError(f"unknown engine.openvino_profile {config.openvino_profile!r}")
        progress = _BuildProgress()
        try:
            folder, info = prepare_ir(
                config.model, progress=progress if sys.stderr.isatty() else None
            )
        finally:
            progress.close()
        settings = {**profile, "KV_CACHE_PRECISION": kv}
        if config.threads:
            settings["INFERENCE_NUM_THREADS"] = str(config.threads)
        with translate_errors(f"loading {folder}"):
            model = OvModel(str(folder / "openvino_model.xml"), config=settings)
        import openvino_genai

        try:
            tokenizer = openvino_genai.Tokenizer(str(folder))
        except Exception as exc:
            raise ModelLoadError(
                f"cannot load the tokenizer in {folder}: {str(exc).splitlines()[0]}"
            ) from exc
        eos = {int(tokenizer.get_eos_token_id())}
        facts = cls._facts_for(model, info, folder, config)
        try:
            text = tokenizer.encode(PROBE_TEXT * 16, add_special_tokens=False)
            kernels = kernel_verdict(
                model,
                config,
                [int(t) for t in text.input_ids.data[0]],
                model_key=f"{facts.fingerprint}|{file_digest(folder / 'openvino_model.xml')}",
            )
        except BaseException:
            model.close()
            raise
        return cls(model, tokenizer, config, msgspec.structs.replace(facts, kernels=kernels), eos)

    @staticmethod
    def _vocabulary(tokenizer: Any, n_vocab: int) -> tuple[list[bytes], frozenset[int]]:
        """Each token's bytes and the ids of special tokens (markup the detokenizer skips;
        byte pieces that are not whole characters alone are not special)."""
        pieces = [b""] * n_vocab
        for piece, token in tokenizer.get_vocab().items():
            if 0 <= int(token) < n_vocab:
                pieces[int(token)] = bytes(piece)
        shown = tokenizer.decode([[t] for t in range(n_vocab)], skip_special_tokens=True)
        special = set()
        for token, (piece, text) in enumerate(zip(pieces, shown, strict=True)):
            if piece and not text:
                try:
                    piece.decode("utf-8")
                except UnicodeDecodeError:
                    continue  # part of a character
                special.add(token)
        return [b"" if t in special else p for t, p in enumerate(pieces)], frozenset(special)

    @staticmethod
    def _facts_for(model: OvModel, info: IrInfo, folder: Path, config: EngineConfig) -> ModelFacts:
        xml = folder / "openvino_model.xml"
        weights = (folder / "openvino_model.bin").stat().st_size
        layout = (
            f"{info.source_digest or xml.stat().st_size}|openvino|layers={model.n_layers}"
            f"|kv_heads={model.n_kv_heads}|d={model.head_dim}|kv={model.kv_precision}"
            f"|infer={model.inference_precision}|rope={model.rotary_layout}:{model.inv_freq.tobytes().hex()[:32]}"
        )
        return ModelFacts(
            backend="openvino",
            path=str(folder),
            name=info.name,
            architecture=info.architecture,
            fingerprint=hashlib.sha256(layout.encode()).hexdigest()[:32],
            n_layers=model.n_layers,
            n_head=info.n_head or model.n_kv_heads,
            n_head_kv=model.n_kv_heads,
            head_dim=model.head_dim,
            n_vocab=model.n_vocab,
            trained_context=info.trained_context,
            sliding_window=None,
            sliding_window_live=None,
            sliding_window_pattern=None,
            swa_full=False,
            rope_freq_base=float(1.0 / model.inv_freq[1] ** (model.head_dim / 2))
            if model.inv_freq.size > 1
            else None,
            kv_type=config.kv_type,
            kv_bytes_per_token=model.n_layers
            * 2
            * model.n_kv_heads
            * model.head_dim
            * KV_PRECISIONS.get(model.kv_precision, 4),
            cold_bytes_per_token=(
                model.n_layers
                * 2
                * model.n_kv_heads
                * model.head_dim
                * COLD_BYTES.get(model.kv_precision, 4)
            ),
            weight_bytes=weights,
            file_bytes=weights + xml.stat().st_size,
            exact_in_place=config.kv_type in EXACT_KV,
        )

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def kv_precision(self) -> str:
        return str(self._model.kv_precision)

    # -- text --

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Token ids for ``text``; markup such as ``<|im_start|>`` becomes the special token
        only with ``parse_special``.

        OpenVINO's tokenizer always reads special-token strings as the special tokens, so
        without ``parse_special`` the text is cut inside each such string (after its first
        character) and the pieces are tokenized apart: the string stays plain characters.
        """
        if parse_special or self._markup is None or not self._markup.search(text):
            return self._encode(text, add_special)
        pieces, at = [], 0
        for found in self._markup.finditer(text):
            pieces.append(text[at : found.start() + 1])
            at = found.start() + 1
        pieces.append(text[at:])
        tokens: list[int] = []
        for piece in pieces:
            tokens += self._tokenize_plain(piece, add_special and not tokens)
        return tokens

    def _tokenize_plain(self, text: str, add_special: bool) -> list[int]:
        if self._markup is not None and len(text) > 1 and self._markup.search(text, 1):
            return self.tokenize(text, add_special=add_special)  # a string inside a string
        tokens = self._encode(text, add_special)
        added = 1 if add_special and tokens and tokens[0] == self._bos else 0
        if any(t in self._special for t in tokens[added:]):
            raise EngineError(f"OpenVINO's tokenizer reads {text!r} as special tokens")
        return tokens

    def _encode(self, text: str, add_special: bool) -> list[int]:
        encoded = self._tokenizer.encode(text, add_special_tokens=add_special)
        return [int(t) for t in encoded.input_ids.data[0]]

    def detokenize(self, tokens: Sequence[int]) -> str:
        check_tokens(tokens, self._facts.n_vocab)
        return str(self._tokenizer.decode([int(t) for t in tokens]))

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes (part of a character for byte pieces; empty for markup)."""
        check_tokens([token], self._facts.n_vocab)
        return self._bytes[token]

    def is_end_of_generation(self, token: int) -> bool:
        check_tokens([token], self._facts.n_vocab)
        return token in self._eos

    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        history = [{"role": role, "content": content} for role, content in messages]
        return str(
            self._tokenizer.apply_chat_template(
                history, add_generation_prompt=add_generation_prompt
            )
        )

    def chat_template_source(self) -> TemplateSource | None:
        """The tokenizer's chat template and its BOS and EOS token texts."""
        with translate_errors("reading the chat template"):
            text = str(self._tokenizer.get_original_chat_template() or "")
            if not text:
                return None
            return TemplateSource(
                text=text,
                bos_token=str(self._tokenizer.get_bos_token() or ""),
                eos_token=str(self._tokenizer.get_eos_token() or ""),
            )

    # -- contexts --

    def open_context(self, n_ctx: int, *, n_batch: int | None = None) -> OpenVinoEngineContext:
        if self._closed:
            raise EngineError("the engine is closed")
        if not isinstance(n_ctx, int) or not 1 <= n_ctx <= self._facts.trained_context:
            raise InvalidRangeError(
                f"a hot window must hold 1 to {self._facts.trained_context} tokens (the model's "
                f"trained context), got {n_ctx!r}"
            )
        return OpenVinoEngineContext(
            self._model,
            self._facts,
            n_ctx,
            n_batch or self.config.batch or 512,
            self.is_end_of_generation,
            rows=self._rows if self._rows.offered else None,
        )

    # -- windows stepping together (see :mod:`._rows`) --

    def joins(self, ctx: EngineContext) -> bool:
        """Whether ``ctx``'s steps may run beside other windows' (:meth:`step_together`):
        the kernel probe found rows of one request exact here."""
        return isinstance(ctx, OpenVinoEngineContext) and ctx.joins

    @property
    def streams(self) -> int:
        """Windows that may step in one engine call: ``engine.together`` where this
        engine offers it, else 1."""
        return self._rows.streams if self._rows.offered else 1

    def away(self, ctx: EngineContext) -> bool:
        """Whether ``ctx``'s window is in the engine's rows."""
        return isinstance(ctx, OpenVinoEngineContext) and ctx.away

    def settle(self, ctx: EngineContext) -> None:
        """Bring ``ctx``'s window back from the engine's rows, if it is there."""
        if isinstance(ctx, OpenVinoEngineContext):
            ctx.settle()

    @property
    def joint_steps(self) -> int:
        """Steps that advanced two windows or more in one engine call, so far."""
        return self._rows.steps

    gather_seconds: float | None = GATHER_SECONDS

    @property
    def stream_bytes(self) -> int:
        """KV bytes of the rows windows step together in (0 while none is there)."""
        return self._rows.nbytes

    def stream_bytes_at(self, window_tokens: int) -> int:
        """The most KV bytes the rows hold while windows of up to ``window_tokens`` step
        together, beside the windows' own requests."""
        return self._rows.most_bytes(window_tokens)

    def step_together(self, steps: Sequence[tuple[EngineContext, int]]) -> list[Logits | Exception]:
        """Advance each ``(context, token)`` by its token: the windows in (or brought
        into) the engine's rows in one ``infer``, any other alone in its own request."""
        windows: list[OpenVinoEngineContext | Exception] = [
            c
            if isinstance(c, OpenVinoEngineContext)
            else EngineError("a context of another engine")
            for c, _ in steps
        ]
        return self._rows.step_windows(windows, [t for _, t in steps])

    def close(self) -> None:
        """Release the compiled model and the tokenizer (contexts must be closed first)."""
        if self._closed:
            return
        self._closed = True
        self._rows.close()
        self._model.close()
        self._tokenizer = None
