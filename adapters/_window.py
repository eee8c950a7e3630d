"""What every engine context shares: the record of resident tokens and the rules for it.

An adapter's context subclasses :class:`KvWindow` and supplies a handful of engine
primitives (compute a chunk, drop entries, copy entries out, splice them in). The record of
which token sits at which position is changed only after the primitive it mirrors has
succeeded, so an error or a cancellation between chunks never leaves the record and the
engine's cache disagreeing.
"""

from __future__ import annotations

import abc
import bisect
import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvrt import (
    EngineError,
    HotWindowFullError,
    InvalidRangeError,
    InvalidTokenError,
)
from kvrt.backend import (
    AdmitMode,
    Capabilities,
    Checkpoint,
    ColdBlock,
    ColdBlockMeta,
    Counters,
    EvictMode,
    Logits,
    ModelFacts,
    Recompute,
    Sampler,
    SamplingParams,
)

from ._given import as_position, check_block, check_tokens

__all__ = ["KvWindow", "chunk_bounds"]


def chunk_bounds(n: int, step: int) -> list[int]:
    """Where a prefill of ``n`` tokens is cut into batches of at most ``step``: never with a
    last batch of one token after a longer one (the last two share the tokens instead). On
    some CPUs (x86-64 without AVX-512) llama.cpp runs one-token batches through other
    kernels than longer ones, whose results differ in the last bits, so a prefill cut
    that way would not equal the same tokens computed in any other cut."""
    cuts = [*range(0, n, step), n]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] == 1 and step > 1:
        cuts[-2] -= 1
    return cuts


def _chunk_bounds_at(cuts: list[int], at: set[int]) -> list[int]:
    """``cuts`` with cuts added at ``at``, leaving out any that would make a one-token
    chunk."""
    out = set(cuts)
    for cut in sorted(at):
        if all(abs(cut - c) > 1 for c in out):
            out.add(cut)
    return sorted(out)


class KvWindow(abc.ABC):
    """A hot window of one engine context: at most ``budget`` resident tokens."""

    def __init__(self, facts: ModelFacts, budget: int) -> None:
        self._facts = facts
        self._budget = budget
        self._positions: list[int] = []
        self._tokens: list[int] = []
        self._logits_pos: int | None = None
        self._counters = Counters()

    # -- engine primitives --

    @abc.abstractmethod
    def _compute(self, chunk: list[int], start: int) -> None:
        """Run the model over ``chunk`` at positions ``start...``, appended after the record."""

    @abc.abstractmethod
    def _read_logits(self) -> Logits: ...

    @abc.abstractmethod
    def _remove(self, i: int, j: int, start: int, end: int, shift_tail: bool) -> int:
        """Drop record entries ``i:j`` (positions [start, end)); shift later ones down if
        asked. The first entry dropped: ``i``, or an earlier one where the engine had to
        drop more of the window's tail (see :meth:`recomputed_by_evict`)."""

    @abc.abstractmethod
    def _take(self, i: int, j: int, start: int, end: int) -> npt.NDArray[np.uint8]:
        """Copy record entries ``i:j`` out as bytes."""

    @abc.abstractmethod
    def _put(self, block: ColdBlock, i: int, target: int, skip: int = 0) -> None:
        """Splice a block in before record entry ``i``, its first token at ``target``;
        with ``skip``, only its tokens from that index on (the first ones are resident
        already, freshly computed at ``target...``)."""

    @abc.abstractmethod
    def _after_failure(self) -> None:
        """Bring the record back in line with the engine after a failed compute."""

    @abc.abstractmethod
    def _reset(self) -> None: ...

    @property
    @abc.abstractmethod
    def can_shift(self) -> bool: ...

    @property
    @abc.abstractmethod
    def chunk_tokens(self) -> int: ...

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def _is_end(self, token: int) -> bool: ...

    # -- recurrent state (engines with recurrent layers override these) --

    @property
    def _keeps_states(self) -> bool:
        """The engine has a recurrent state to checkpoint after chosen positions."""
        return False

    def _keep_state(self, position: int, asked: bool) -> None:  # noqa: B027
        """Checkpoint the recurrent state, which has just seen every token before
        ``position``; ``asked``: a position the caller named (a block end), else the end
        of a prefill."""

    def recomputed_by_evict(self, start: int, end: int) -> Recompute | None:
        """What a gap eviction of [start, end) computes again (an engine with recurrent
        layers, removing the window's tail); None: it only removes the range."""
        return None

    def _resumable(self, end: int) -> bool:
        """Whether a block ending at ``end`` exports with what the engine needs to go on
        after it (:attr:`~kvrt.backend.ColdBlockMeta.resumable`)."""
        return True

    # -- the record --

    @property
    def n_ctx(self) -> int:
        """The most tokens that may be resident."""
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
    def fingerprint(self) -> str:
        """The identity of the KV this context computes, which its cold blocks carry: the
        model's fingerprint, unless a setting of this context changes what the engine
        computes (an adapter adds it then)."""
        return self._facts.fingerprint

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    def _check_room(self, n: int, what: str) -> None:
        free = self._budget - len(self._positions)
        if n > free:
            raise HotWindowFullError(
                f"{what} needs {n} KV cells but the hot window has {free} free of {self._budget}; "
                "evict first"
            )

    def _resident_slice(self, start: object, end: object) -> tuple[int, int, int, int]:
        s, e = as_position(start, "start"), as_position(end, "end")
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
        keep_state_at: Sequence[int] = (),
    ) -> Logits:
        """Compute KV for ``tokens`` after the last resident token; the last token's logits.

        ``start`` may only differ from :attr:`next_position` while the window is empty.
        Work goes in chunks with ``checkpoint()`` between them; if it raises, the chunks
        already done stay resident and recorded. On an engine with recurrent layers the
        chunks are also cut at ``keep_state_at`` (never into a one-token chunk) and the
        recurrent state is checkpointed there and at the end.
        """
        toks = list(tokens)
        if not toks:
            raise InvalidTokenError("nothing to prefill: the token list is empty")
        check_tokens(toks, self._facts.n_vocab)
        pos = self.next_position if start is None else as_position(start, "start")
        if self._positions and pos != self.next_position:
            raise InvalidRangeError(
                f"prefill must continue at position {self.next_position}, not {pos}"
            )
        if pos < 0:
            raise InvalidRangeError(f"start position must be >= 0, got {pos}")
        self._check_room(len(toks), f"prefilling {len(toks)} tokens")
        cuts = chunk_bounds(len(toks), self.chunk_tokens)
        asked: set[int] = set()
        if self._keeps_states:
            asked = {p - pos for p in keep_state_at if 0 < p - pos <= len(toks)}
            cuts = _chunk_bounds_at(cuts, asked)
        for k, end in itertools.pairwise(cuts):
            if k and checkpoint is not None:
                checkpoint()
            chunk = toks[k:end]
            self._compute_and_record(chunk, pos + k)
            self._counters.prefill_tokens += len(chunk)
            if self._keeps_states and (end in asked or end == len(toks)):
                self._keep_state(pos + end, end in asked)
        return self.logits()

    def step(self, token: int) -> Logits:
        """Feed one generated token; the logits for the next one."""
        check_tokens([token], self._facts.n_vocab)
        self._check_room(1, "decoding a token")
        self._compute_and_record([token], self.next_position)
        self._counters.decode_tokens += 1
        return self.logits()

    def _compute_and_record(self, chunk: list[int], pos: int) -> None:
        try:
            self._compute(chunk, pos)
        except EngineError:
            self._after_failure()
            raise
        self._record(chunk, pos)

    def _record(self, chunk: list[int], pos: int) -> None:
        self._positions.extend(range(pos, pos + len(chunk)))
        self._tokens.extend(chunk)
        self._logits_pos = pos + len(chunk) - 1

    def stepped(self, token: int, logits: Logits) -> None:
        """Record a step the window took beside other windows' (where the engine steps
        them together): ``token`` at its next position, followed by ``logits``."""
        self._record([token], self.next_position)
        self._keep_logits(logits.copy())  # a row of the joint step's array: keep it alone
        self._counters.decode_tokens += 1

    def _keep_logits(self, logits: Logits) -> None:
        """Hold ``logits`` as the ones after the last token (a step computed elsewhere)."""
        raise EngineError("this window does not step beside others")

    def logits(self) -> Logits:
        """Logits following the last decoded token, while that token is resident."""
        if self._logits_pos is None:
            raise EngineError("no logits: decode something first (or the last token was evicted)")
        return self._read_logits()

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
            if stop_at_end and self._is_end(token):
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
        shift = mode is EvictMode.SLIDE and j < len(self._positions)
        if shift and not self.can_shift:
            raise EngineError("this model's KV cache cannot shift positions: use gap eviction")
        i = self._remove(i, j, s, e, shift)
        if self._logits_pos is not None and self._positions[i] <= self._logits_pos < e:
            self._logits_pos = None
        del self._positions[i:j]
        del self._tokens[i:j]
        if shift:
            self._positions[i:] = [p - (e - s) for p in self._positions[i:]]
            if self._logits_pos is not None and self._logits_pos >= e:
                self._logits_pos -= e - s
        self._counters.evicted_tokens += j - i
        return j - i

    def export(self, start: int, end: int) -> ColdBlock:
        """Copy the KV of positions [start, end) out as read-only bytes; the window is unchanged.

        Every position in the range must be resident.
        """
        s, e, i, j = self._resident_slice(start, end)
        if j - i != e - s:
            raise InvalidRangeError(
                f"range [{s}, {e}) has gaps: only {j - i} of its {e - s} positions are resident"
            )
        return self._cold_block(self._take(i, j, s, e), i, j, s)

    def _cold_block(self, data: npt.NDArray[np.uint8], i: int, j: int, s: int) -> ColdBlock:
        data.flags.writeable = False
        meta = ColdBlockMeta(
            fingerprint=self.fingerprint,
            kv_type=self._facts.kv_type,
            start=s,
            tokens=tuple(self._tokens[i:j]),
            n_bytes=int(data.size),
            resumable=self._resumable(s + j - i),
        )
        self._counters.exported_tokens += j - i
        self._counters.exported_bytes += int(data.size)
        return ColdBlock(meta=meta, data=data)

    def export_run(self, ranges: Sequence[tuple[int, int]]) -> list[ColdBlock]:
        """Export adjacent ranges, one cold block each, reading the engine once where it can."""
        for (_, end), (start, _) in itertools.pairwise(ranges):
            if end != start:
                raise InvalidRangeError(f"ranges meeting at {end} and {start} are not adjacent")
        if len(ranges) < 2:
            return [self.export(s, e) for s, e in ranges]
        s, e, i, j = self._resident_slice(ranges[0][0], ranges[-1][1])
        if j - i != e - s:
            raise InvalidRangeError(
                f"range [{s}, {e}) has gaps: only {j - i} of its {e - s} positions are resident"
            )
        parts = self._take_run(i, [(a - s, b - s) for a, b in ranges], s, e)
        if parts is None:
            return [self.export(a, b) for a, b in ranges]
        return [
            self._cold_block(part, i + a - s, i + b - s, a)
            for part, (a, b) in zip(parts, ranges, strict=True)
        ]

    def _take_run(
        self, i: int, pieces: Sequence[tuple[int, int]], start: int, end: int
    ) -> list[npt.NDArray[np.uint8]] | None:
        """Copy entries out once and cut them into ``pieces`` (offsets from ``i``); None
        to fall back to one export per piece."""
        return None

    def admit(
        self, block: ColdBlock, mode: AdmitMode = AdmitMode.IN_PLACE, *, skip: int = 0
    ) -> int:
        """Bring a cold block back; the position of its first token. Whole or not at all.

        ``IN_PLACE`` puts it at its original positions, which must all be free (bit-exact).
        ``TAIL`` puts it after the last resident token, re-rotating its keys. ``skip``
        (``TAIL`` only) admits the block's tokens from that index on, after its first
        ``skip`` tokens, which must be the last resident ones (computed afresh: a blend of
        recomputed and restored KV).
        """
        mode = AdmitMode(mode)
        check_block(block, self.fingerprint, self._facts)
        meta = block.meta
        n = meta.n_tokens
        if isinstance(skip, bool) or not isinstance(skip, int) or not 0 <= skip < n:
            raise InvalidRangeError(f"skip must be an integer in [0, {n}), got {skip!r}")
        if skip and mode is not AdmitMode.TAIL:
            raise InvalidRangeError("skip applies to admitting at the tail only")
        self._check_room(n - skip, f"admitting {n - skip} tokens")
        if mode is AdmitMode.IN_PLACE:
            target = meta.start
            i = bisect.bisect_left(self._positions, target)
            if i < len(self._positions) and self._positions[i] < target + n:
                raise InvalidRangeError(
                    f"cannot admit in place: positions [{target}, {target + n}) are partly resident"
                )
        else:
            target, i = self.next_position - skip, len(self._positions)
            if skip and (
                self._tokens[-skip:] != list(meta.tokens[:skip])
                or self._positions[-skip:] != list(range(target, target + skip))
            ):
                raise InvalidRangeError(
                    f"the last {skip} resident tokens are not the block's first {skip}"
                )
            if target != meta.start and not self.can_shift:
                raise EngineError("this model's KV cache cannot shift positions: admit in place")
        self._put(block, i, target, skip)
        self._positions[i:i] = range(target + skip, target + n)
        self._tokens[i:i] = meta.tokens[skip:]
        self._counters.admitted_tokens += n - skip
        self._counters.admitted_bytes += meta.n_bytes
        return target

    def admit_run(self, blocks: Sequence[ColdBlock]) -> None:
        """Admit adjacent blocks in place, in one splice where the engine can.

        Each block lands whole or not at all; engines that splice state wholesale override
        :meth:`_put_run` to do it once for the run.
        """
        for block in blocks:
            check_block(block, self.fingerprint, self._facts)
        for a, b in itertools.pairwise(blocks):
            if a.meta.end != b.meta.start:
                raise InvalidRangeError(
                    f"blocks [{a.meta.start}, {a.meta.end}) and [{b.meta.start}, {b.meta.end}) are not adjacent"
                )
        if not blocks:
            return
        start, end = blocks[0].meta.start, blocks[-1].meta.end
        self._check_room(end - start, f"admitting {end - start} tokens")
        i = bisect.bisect_left(self._positions, start)
        if i < len(self._positions) and self._positions[i] < end:
            raise InvalidRangeError(
                f"cannot admit in place: positions [{start}, {end}) are partly resident"
            )
        if not self._put_run(blocks, i):
            for block in blocks:
                self.admit(block, AdmitMode.IN_PLACE)
            return
        tokens = [t for block in blocks for t in block.meta.tokens]
        self._positions[i:i] = range(start, end)
        self._tokens[i:i] = tokens
        self._counters.admitted_tokens += end - start
        self._counters.admitted_bytes += sum(b.meta.n_bytes for b in blocks)

    def _put_run(self, blocks: Sequence[ColdBlock], i: int) -> bool:
        """Splice adjacent in-place blocks at once; False to fall back to one at a time."""
        return False

    def clear(self) -> None:
        """Empty the window (counters are kept)."""
        self._reset()
        self._positions.clear()
        self._tokens.clear()
        self._logits_pos = None
