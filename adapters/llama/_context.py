"""One llama.cpp KV window: prefill, decode, evict, export and admit token ranges.

The context keeps its own record of which token sits at which position in sequence 0
(``positions`` / ``tokens``, sorted by position) and changes it only after the native call
it mirrors has succeeded, so a failure or a cancellation between chunks never leaves the
record and the KV cache disagreeing.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from kvrt._backend import (
    AdmitMode,
    Capabilities,
    Checkpoint,
    ColdBlock,
    ColdBlockMeta,
    Counters,
    EvictMode,
    Logits,
    ModelFacts,
    SamplingParams,
)
from kvrt._errors import (
    ColdBlockMismatchError,
    EngineError,
    HotWindowFullError,
    InvalidRangeError,
    InvalidTokenError,
)
from kvrt._sampling import Sampler
from native_bridge.llama import MAIN_SEQ, SCRATCH_SEQ, LlamaContext, LlamaModel

from ._errors import translate_errors

__all__ = ["LlamaEngineContext"]


def _as_index(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidRangeError(f"{name} must be an integer position, got {value!r}")
    return int(value)


class LlamaEngineContext:
    """A hot window on a shared :class:`~native_bridge.llama.LlamaModel`."""

    def __init__(self, ctx: LlamaContext, facts: ModelFacts, budget: int) -> None:
        self._ctx = ctx
        self._budget = budget
        self._model: LlamaModel = ctx.model
        self._facts = facts
        self._positions: list[int] = []
        self._tokens: list[int] = []
        self._logits_pos: int | None = None
        self._counters = Counters()

    @classmethod
    def create(
        cls, model: LlamaModel, facts: ModelFacts, *, n_ctx: int, n_batch: int, n_threads: int
    ) -> LlamaEngineContext:
        if not isinstance(n_ctx, int) or n_ctx < 1:
            raise InvalidRangeError(f"a hot window needs at least 1 token of room, got {n_ctx!r}")
        if n_ctx > facts.trained_context:
            raise InvalidRangeError(
                f"a hot window of {n_ctx} tokens exceeds the model's trained context "
                f"of {facts.trained_context}"
            )
        with translate_errors(f"creating a {n_ctx}-token context"):
            ctx = LlamaContext(
                model,
                n_ctx=n_ctx,
                n_batch=min(n_batch, n_ctx),
                n_threads=n_threads,
                kv_type=facts.kv_type,
            )
        return cls(ctx, facts, n_ctx)

    # -- state --

    @property
    def n_ctx(self) -> int:
        """The most tokens that may be resident (llama.cpp may allocate a few more cells)."""
        return self._budget

    @property
    def positions(self) -> Sequence[int]:
        return tuple(self._positions)

    @property
    def tokens(self) -> Sequence[int]:
        return tuple(self._tokens)

    @property
    def n_resident(self) -> int:
        return len(self._positions)

    @property
    def next_position(self) -> int:
        """Where the next prefilled or decoded token goes: after the last resident one."""
        return self._positions[-1] + 1 if self._positions else 0

    @property
    def logits_position(self) -> int | None:
        """Position of the token whose logits :meth:`logits` returns, if still resident."""
        return self._logits_pos

    @property
    def counters(self) -> Counters:
        return self._counters

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def capabilities(self) -> Capabilities:
        notes = ["tail admission re-rotates keys: argmax-equal, not bit-exact"]
        if self._facts.sliding_window_live:
            notes.append(
                "in-place restore of ranges outside the sliding window is not yet verified"
            )
        return Capabilities(
            remove_middle=True,
            position_shift=self._ctx.can_shift,
            exact_in_place=True,
            exact_tail=False,
            sliding_window=self._facts.sliding_window_live,
            kv_type=self._facts.kv_type,
            notes=tuple(notes),
        )

    # -- checks --

    @staticmethod
    def check_tokens(tokens: Sequence[int], n_vocab: int) -> None:
        for tok in tokens:
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                raise InvalidTokenError(f"token ids must be integers, got {tok!r}")
            if not 0 <= tok < n_vocab:
                raise InvalidTokenError(f"token id {tok} is outside the vocabulary [0, {n_vocab})")

    def _check_room(self, n: int, what: str) -> None:
        free = self.n_ctx - len(self._positions)
        if n > free:
            raise HotWindowFullError(
                f"{what} needs {n} KV cells but the hot window has {free} free of {self.n_ctx}; "
                "evict first"
            )

    def _resident_slice(self, start: object, end: object) -> tuple[int, int, int, int]:
        s, e = _as_index(start, "start"), _as_index(end, "end")
        if s >= e:
            raise InvalidRangeError(f"range [{s}, {e}) is empty or reversed")
        if not self._positions:
            raise InvalidRangeError(f"range [{s}, {e}) is out of bounds: the hot window is empty")
        lo, hi = self._positions[0], self._positions[-1] + 1
        if s < lo or e > hi:
            raise InvalidRangeError(
                f"range [{s}, {e}) is out of bounds of the hot window [{lo}, {hi})"
            )
        i = bisect.bisect_left(self._positions, s)
        j = bisect.bisect_left(self._positions, e)
        if i == j:
            raise InvalidRangeError(f"range [{s}, {e}) holds no resident tokens")
        return s, e, i, j

    # -- compute --

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        start: int | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> Logits:
        """Compute KV for ``tokens`` after the last resident token; the last token's logits.

        ``start`` may only differ from :attr:`next_position` while the window is empty.
        Work goes in ``n_batch`` chunks with ``checkpoint()`` between them; if it raises,
        the chunks already done stay resident and recorded.
        """
        toks = list(tokens)
        if not toks:
            raise InvalidTokenError("nothing to prefill: the token list is empty")
        self.check_tokens(toks, self._facts.n_vocab)
        pos = self.next_position if start is None else _as_index(start, "start")
        if self._positions and pos != self.next_position:
            raise InvalidRangeError(
                f"prefill must continue at position {self.next_position}, not {pos}"
            )
        if pos < 0:
            raise InvalidRangeError(f"start position must be >= 0, got {pos}")
        self._check_room(len(toks), f"prefilling {len(toks)} tokens")
        step = self._ctx.n_batch
        for k in range(0, len(toks), step):
            if k and checkpoint is not None:
                checkpoint()
            chunk = toks[k : k + step]
            self._decode(chunk, pos + k)
            self._counters.prefill_tokens += len(chunk)
        return self.logits()

    def step(self, token: int) -> Logits:
        """Feed one generated token; the logits for the next one."""
        self.check_tokens([token], self._facts.n_vocab)
        self._check_room(1, "decoding a token")
        self._decode([token], self.next_position)
        self._counters.decode_tokens += 1
        return self.logits()

    def _decode(self, chunk: list[int], pos: int) -> None:
        try:
            with translate_errors("decoding"):
                self._ctx.decode(chunk, pos)
        except EngineError:
            self._resync()
            raise
        self._positions.extend(range(pos, pos + len(chunk)))
        self._tokens.extend(chunk)
        self._logits_pos = pos + len(chunk) - 1

    def _resync(self) -> None:
        # A failed decode leaves none of its batch behind; keep the record matching.
        if self._ctx.closed:
            return
        last = self._ctx.pos_max(MAIN_SEQ)
        while self._positions and self._positions[-1] > last:
            self._positions.pop()
            self._tokens.pop()

    def logits(self) -> Logits:
        """Logits following the last decoded token, while that token is resident."""
        if self._logits_pos is None:
            raise EngineError("no logits: decode something first (or the last token was evicted)")
        with translate_errors("reading logits"):
            return self._ctx.logits()

    def generate(
        self,
        max_tokens: int,
        params: SamplingParams | None = None,
        *,
        stop_at_end: bool = True,
        checkpoint: Checkpoint | None = None,
    ) -> list[int]:
        """Sample up to ``max_tokens`` tokens after the current logits, feeding each back."""
        if max_tokens < 0:
            raise InvalidRangeError(f"max_tokens must be >= 0, got {max_tokens}")
        sampler = Sampler(params or SamplingParams())
        logits = self.logits() if max_tokens else None
        out: list[int] = []
        while logits is not None and len(out) < max_tokens:
            token = sampler.choose(logits)
            out.append(token)
            if stop_at_end and self._model.is_end_of_generation(token):
                break
            if len(out) < max_tokens:
                if checkpoint is not None:
                    checkpoint()
                logits = self.step(token)
        return out

    # -- residency --

    def evict(self, start: int, end: int, mode: EvictMode = EvictMode.GAP) -> int:
        """Drop the resident tokens in positions [start, end); the number dropped.

        ``GAP`` keeps every other position; ``SLIDE`` shifts the tokens after ``end`` down
        by ``end - start``.
        """
        mode = EvictMode(mode)
        s, e, i, j = self._resident_slice(start, end)
        last = self._positions[-1]
        if mode is EvictMode.SLIDE and j < len(self._positions) and not self._ctx.can_shift:
            raise EngineError("this model's KV cache cannot shift positions: use gap eviction")
        with translate_errors(f"evicting [{s}, {e})"):
            self._ctx.seq_rm(MAIN_SEQ, s, e)
            if self._logits_pos is not None and s <= self._logits_pos < e:
                self._logits_pos = None
            del self._positions[i:j]
            del self._tokens[i:j]
            if mode is EvictMode.SLIDE and i < len(self._positions):
                self._ctx.seq_add(MAIN_SEQ, e, last + 1, s - e)
                self._positions[i:] = [p - (e - s) for p in self._positions[i:]]
                if self._logits_pos is not None and self._logits_pos >= e:
                    self._logits_pos -= e - s
        self._counters.evicted_tokens += j - i
        return j - i

    def export(self, start: int, end: int) -> ColdBlock:
        """Copy the KV of positions [start, end) out as bytes; the window is unchanged.

        Every position in the range must be resident. llama.cpp writes straight into the
        returned buffer, which is then made read-only.
        """
        s, e, i, j = self._resident_slice(start, end)
        if j - i != e - s:
            raise InvalidRangeError(
                f"range [{s}, {e}) has gaps: only {j - i} of its {e - s} positions are resident"
            )
        with translate_errors(f"exporting [{s}, {e})"):
            self._ctx.seq_clear(SCRATCH_SEQ)
            self._ctx.seq_cp(MAIN_SEQ, SCRATCH_SEQ, s, e)
            try:
                data = self._ctx.state_get(SCRATCH_SEQ)
            finally:
                self._ctx.seq_clear(SCRATCH_SEQ)
        data.flags.writeable = False
        meta = ColdBlockMeta(
            fingerprint=self._facts.fingerprint,
            kv_type=self._facts.kv_type,
            start=s,
            tokens=tuple(self._tokens[i:j]),
            n_bytes=int(data.size),
        )
        self._counters.exported_tokens += j - i
        self._counters.exported_bytes += int(data.size)
        return ColdBlock(meta=meta, data=data)

    def _check_block(self, block: ColdBlock) -> None:
        meta = block.meta
        if meta.fingerprint != self._facts.fingerprint:
            raise ColdBlockMismatchError(
                f"cold block belongs to another model or KV layout "
                f"(block {meta.fingerprint[:12]}, engine {self._facts.fingerprint[:12]})"
            )
        if meta.kv_type != self._facts.kv_type:
            raise ColdBlockMismatchError(
                f"cold block holds {meta.kv_type} KV, this context uses {self._facts.kv_type}"
            )
        data = block.data
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
            raise ColdBlockMismatchError("cold block bytes must be a 1-D uint8 array")
        if data.size != meta.n_bytes or not meta.tokens:
            raise ColdBlockMismatchError(
                f"cold block holds {data.size} bytes for {len(meta.tokens)} tokens; "
                f"its metadata says {meta.n_bytes}"
            )
        if meta.start < 0:
            raise ColdBlockMismatchError(f"cold block starts at a negative position {meta.start}")
        self.check_tokens(meta.tokens, self._facts.n_vocab)

    def admit(self, block: ColdBlock, mode: AdmitMode = AdmitMode.IN_PLACE) -> int:
        """Bring a cold block back; the position of its first token. Whole or not at all.

        ``IN_PLACE`` puts it at its original positions, which must all be free (bit-exact).
        ``TAIL`` puts it after the last resident token, re-rotating its keys.
        """
        mode = AdmitMode(mode)
        self._check_block(block)
        meta = block.meta
        n = meta.n_tokens
        self._check_room(n, f"admitting {n} tokens")
        if mode is AdmitMode.IN_PLACE:
            target = meta.start
            i = bisect.bisect_left(self._positions, target)
            if i < len(self._positions) and self._positions[i] < target + n:
                raise InvalidRangeError(
                    f"cannot admit in place: positions [{target}, {target + n}) are partly resident"
                )
        else:
            target, i = self.next_position, len(self._positions)
            if target != meta.start and not self._ctx.can_shift:
                raise EngineError("this model's KV cache cannot shift positions: admit in place")
        data = np.ascontiguousarray(block.data)
        with translate_errors(f"admitting [{meta.start}, {meta.end})"):
            self._ctx.state_set(SCRATCH_SEQ, data)
            try:
                got = (self._ctx.pos_min(SCRATCH_SEQ), self._ctx.pos_max(SCRATCH_SEQ) + 1)
                if got != (meta.start, meta.end):
                    raise ColdBlockMismatchError(
                        f"cold block bytes hold positions [{got[0]}, {got[1]}), "
                        f"its metadata says [{meta.start}, {meta.end})"
                    )
                if target != meta.start:
                    self._ctx.seq_add(SCRATCH_SEQ, meta.start, meta.end, target - meta.start)
                self._ctx.seq_cp(SCRATCH_SEQ, MAIN_SEQ, target, target + n)
            finally:
                self._ctx.seq_clear(SCRATCH_SEQ)
        self._positions[i:i] = range(target, target + n)
        self._tokens[i:i] = meta.tokens
        self._counters.admitted_tokens += n
        self._counters.admitted_bytes += meta.n_bytes
        return target

    def clear(self) -> None:
        """Empty the window (counters are kept)."""
        with translate_errors("clearing the context"):
            self._ctx.clear()
        self._positions.clear()
        self._tokens.clear()
        self._logits_pos = None

    @property
    def closed(self) -> bool:
        return self._ctx.closed

    def close(self) -> None:
        if not self._ctx.closed:
            with translate_errors("closing the context"):
                self._ctx.close()
