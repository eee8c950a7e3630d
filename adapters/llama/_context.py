"""One llama.cpp KV window: the shared record rules on llama.cpp's sequence API.

Sequence 0 is the hot window; sequence 1 is scratch for moving ranges in and out as
bytes (``llama_state_seq_get/set_data``), joined to sequence 0 with ``seq_cp`` in a
unified cache.

llama.cpp sums attention over a context's cells in the order they sit in its cache, and
puts new tokens and restored ranges into whatever cells are free. A fresh context holding
positions ``0...n-1`` has position ``k`` in cell ``k``; after an eviction that leaves a hole,
writes may land anywhere, and what is computed then differs from the fresh context in the
last bits. So the window tracks whether its cells are known to be laid out as a fresh
context's, and before computing tokens on a whole context (every position before them
resident) whose cells are not, lays it out again: exports it, puts the cells in position
order, clears the cache and loads them back (:meth:`LlamaEngineContext.relayout`).

Moving a range to other positions (slide eviction, tail admission) turns its keys.
llama.cpp's own shift (``llama_memory_seq_add``) does that where it is right; where it
would scale YaRN or LongRoPE keys again, or crash on quantized keys, the window turns them
itself: out as bytes, turned in numpy (:class:`~._cells.Cells`), back in at the new
positions.

A context smaller than its window grows as the window fills (:mod:`._sizing` says how
large): its cells go out in position order and come back into a larger context, the old
one freed first, so the memory a session holds follows the tokens it holds. A closed
window hands its context to the engine, which keeps one for the next window to start in,
wiped: making a context allocates and clears its buffer and reserves its graph (15-21 ms
for SmolLM2's 1,024-1,536 cells, against 3-4 ms to zero them), on the path of every
session opened.

A model with recurrent layers gets a window of its own kind (:mod:`._hybrid`), which keeps
the recurrent state beside the cells. What a window promises is :mod:`._capabilities`'.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvrt import InvalidRangeError
from kvrt.backend import Capabilities, ColdBlock, Logits, ModelFacts
from kvrt.native_bridge.llama import LlamaModel
from kvrt.native_bridge.llama_context import MAIN_SEQ, LlamaContext

from .._errors import translate_errors
from .._given import check_tokens
from .._window import KvWindow
from ._capabilities import window_capabilities
from ._cells import Cells
from ._keys import KeyReader, QueryKeys
from ._rope import ModelRope
from ._sizing import first_size, fits_spare, padded
from ._together import Together

__all__ = ["LlamaEngineContext"]


class LlamaEngineContext(KvWindow):
    """A hot window on a shared :class:`~native_bridge.llama.LlamaModel`."""

    def __init__(
        self,
        ctx: LlamaContext,
        facts: ModelFacts,
        rope: ModelRope,
        budget: int,
        *,
        n_threads: int | None = None,
        release: Callable[[LlamaContext], None] | None = None,
        together: Together | None = None,
    ) -> None:
        super().__init__(facts, budget)
        self._own = ctx
        self._together = together
        """The engine's streams, where this window's steps may run beside others'."""
        self._away: int | None = None
        """The stream the window is in (see :mod:`._together`), if it is away."""
        self._release = release
        """Where the context goes when the window closes (the engine's spare), if not freed."""
        self._model: LlamaModel = ctx.model
        self._rope = rope
        windowed = bool(facts.sliding_window_live)
        recurrent = bool(facts.checkpoint_bytes)
        # Keys never move on a model with recurrent layers (some, as Nemotron-H's, have no RoPE).
        self._cells = Cells(
            facts, () if recurrent else rope.ropes(ctx.n_ctx_seq, windowed=windowed)
        )
        """The window's cells as bytes; its ``ropes``: how this context rotates keys."""
        identity = rope.identity(ctx.n_ctx_seq)
        self._fingerprint = (
            hashlib.sha256(f"{facts.fingerprint}|rope={identity}".encode()).hexdigest()[:32]
            if identity
            else facts.fingerprint
        )
        self._turn = facts.key_shift == "kvrt"
        """Turn keys in kvrt's own code when moving a range (llama.cpp's shift is wrong)."""
        self._keys = KeyReader.for_model(facts, rope)
        self._n_threads = n_threads
        self._query = (
            QueryKeys(ctx.model, facts, rope, self._keys, n_threads=n_threads)
            if self._keys is not None
            else None
        )
        self._in_order = True
        """Cell ``k`` holds position ``k`` for every resident position, which are ``0...n-1``:
        the layout of a fresh context. Cleared by anything that may leave it otherwise."""
        self._carried: Logits | None = None
        """The last logits, brought over from the context this one grew out of (until
        the next compute)."""

    @classmethod
    def create(
        cls,
        model: LlamaModel,
        facts: ModelFacts,
        rope: ModelRope,
        *,
        n_ctx: int,
        n_batch: int,
        n_threads: int,
        spare: LlamaContext | None = None,
        release: Callable[[LlamaContext], None] | None = None,
        together: Together | None = None,
    ) -> LlamaEngineContext:
        """A window of ``n_ctx`` tokens in a context of :func:`first_size` cells: ``spare``
        (a closed window's context, wiped) where it is set up the same and its size lies
        between those, else a new one (``spare`` is then freed first). ``release`` takes
        the context when the window closes."""
        if not isinstance(n_ctx, int) or n_ctx < 1:
            raise InvalidRangeError(f"a hot window needs at least 1 token of room, got {n_ctx!r}")
        if n_ctx > facts.trained_context:
            raise InvalidRangeError(
                f"a hot window of {n_ctx} tokens exceeds the model's trained context "
                f"of {facts.trained_context}"
            )
        first = first_size(facts, rope, n_ctx, n_batch)
        batch = min(n_batch, first)
        with translate_errors(f"creating a {first}-token context"):
            if spare is not None and fits_spare(spare, first, n_ctx, batch, n_threads):
                spare.clear(wipe=True)
                ctx = spare
            else:
                if spare is not None:
                    spare.close()
                ctx = LlamaContext(
                    model,
                    n_ctx=first,
                    n_batch=batch,
                    n_threads=n_threads,
                    kv_type=facts.kv_type,
                    flash_attn=facts.flash_attention,
                )
        if together is not None and not together.offered:
            together = None
        return cls(ctx, facts, rope, n_ctx, n_threads=n_threads, release=release, together=together)

    # -- stepping beside other windows (see :mod:`._together`) --

    @property
    def _ctx(self) -> LlamaContext:
        """The window's own context, with the window brought home first if it is away."""
        if self._away is not None:
            self._come_home()
        return self._own

    @_ctx.setter
    def _ctx(self, ctx: LlamaContext) -> None:
        self._own = ctx

    @property
    def joins(self) -> bool:
        """The engine offers this window steps beside others' (see :mod:`._together`)."""
        return self._together is not None

    @property
    def away(self) -> bool:
        """The window is in one of the engine's streams, stepping beside other windows."""
        return self._away is not None

    def stream_for_step(self, token: int, *, move: bool = True) -> int | None:
        """Before a step beside other windows: check it, and (with ``move``) move the
        window into a free stream unless it is in one already, its cells in position
        order; its stream, or None where it is not in one (it does not hold every
        position from 0, no stream is free or large enough): it then steps alone, in its
        own context."""
        check_tokens([token], self._facts.n_vocab)
        self._check_room(1, "decoding a token")
        if self._away is not None:
            assert self._together is not None
            if self._together.room(self._away) > 1:
                return self._away
            self._come_home()  # its stream is full: on in its own context
            return None
        n = len(self._positions)
        if not move or self._together is None or not n or self._positions[-1] != n - 1:
            return None  # joins only a whole context (as a lone step would lay it out)
        with translate_errors("reading the window"):
            data = self._own.state_get(MAIN_SEQ)
            if not self._in_order:
                data = self._cells.ordered(data)
        self._away = self._together.join(data, n)
        if self._away is not None and not self._in_order:
            self._in_order = True  # in position order in its stream, and once home
            self._counters.relayouts += 1
            self._counters.relayout_tokens += n
        return self._away

    def settle(self) -> None:
        """Bring the window home from its stream, if it is in one."""
        if self._away is not None:
            self._come_home()

    def _keep_logits(self, logits: Logits) -> None:
        self._carried = logits

    def _come_home(self) -> None:
        """Bring the window's cells back from its stream into its own context (grown
        first where they need more cells); if that fails, the window is left empty."""
        seq, self._away = self._away, None
        assert seq is not None and self._together is not None
        own, need = self._own, len(self._positions)
        try:
            with translate_errors("bringing a window back from its stream"):
                data = self._together.leave(seq)
                if not self._full and need + self.chunk_tokens >= own.n_ctx:
                    size = padded(max(need + self.chunk_tokens, own.n_ctx * 3 // 2))
                    own.close()
                    self._own = self._rebuilt(own, min(size, self._budget), ())
                else:
                    own.clear()
                self._own.state_set(MAIN_SEQ, data)
        except BaseException:
            self._lost()
            raise

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint, plus which LongRoPE table this context's size uses on
        a model whose keys depend on it."""
        return self._fingerprint

    @property
    def can_shift(self) -> bool:
        return self._ctx.can_shift and self._facts.key_shift != "none"

    @property
    def chunk_tokens(self) -> int:
        return self._ctx.n_batch

    @property
    def capabilities(self) -> Capabilities:
        return window_capabilities(
            self._facts,
            can_shift=self.can_shift,
            turned_here=self._turn,
            keys_read=self._keys is not None,
            together=self._together is not None,
        )

    def _is_end(self, token: int) -> bool:
        with translate_errors("reading the vocabulary"):
            return self._model.is_end_of_generation(token)

    def _compute(self, chunk: list[int], start: int) -> None:
        n = len(self._positions)
        self._room(len(chunk))
        if not self._in_order and n == start and (not n or self._positions[-1] == n - 1):
            self.relayout()
        with translate_errors("decoding"):
            self._ctx.decode(chunk, start)
        self._carried = None
        self._in_order = self._in_order and start == n

    # -- growing --

    @property
    def _full(self) -> bool:
        return self._ctx.n_ctx >= self._budget

    def _room(self, extra: int) -> None:
        """Before ``extra`` more cells are taken: grow when they and the resident ones
        would leave no cell free. The bridge computes one throwaway token to apply
        pending key shifts before it reads state bytes (as growing does): a context
        filled to its last cell after a shift could not be read, nor grown."""
        if not self._full and len(self._positions) + extra >= self._ctx.n_ctx:
            self._grow(len(self._positions) + extra)

    def _grow(self, need: int) -> None:
        """Move the window into a context of at least ``need`` cells (half as many again
        as now, at least; the budget at most), its cells in position order. The old
        context is freed before the new one is made (the window's bytes wait in between),
        so the peak is the new context and those bytes. If the new context cannot be
        made or loaded, the window goes back into one of the old size and the error is
        raised; if even that fails, the window is left empty."""
        old = self._ctx
        size = padded(max(need + self.chunk_tokens, old.n_ctx * 3 // 2))
        size = self._budget if size >= self._budget else size
        with translate_errors(f"growing the context to {size} tokens"):
            if self._logits_pos is not None and self._carried is None:
                self._carried = old.logits()
            pieces = self._cells.in_order(old, self._positions)
            old.close()
            try:
                self._ctx = self._rebuilt(old, size, pieces)
            except Exception:
                try:
                    self._ctx = self._rebuilt(old, old.n_ctx, pieces)
                except Exception:
                    self._lost()
                raise
        self._in_order = not self._positions or self._positions[-1] == len(self._positions) - 1

    def _rebuilt(
        self, like: LlamaContext, cells: int, pieces: Sequence[npt.NDArray[np.uint8]]
    ) -> LlamaContext:
        """A context of ``cells`` set up as ``like`` was, holding ``pieces``."""
        ctx = LlamaContext(
            self._model, n_ctx=cells, n_batch=like.n_batch, n_threads=self._n_threads,
            kv_type=like.kv_type, flash_attn=like.flash_attn,
        )  # fmt: skip
        try:
            if pieces:
                first, last = self._positions[0], self._positions[-1] + 1
                for piece in pieces:
                    self._cells.load(ctx, piece, first, last)
        except BaseException:
            ctx.close()
            raise
        return ctx

    def _lost(self) -> None:
        """The window could not be put back anywhere: an empty one, in a fresh context
        of the old size where one can be made."""
        with contextlib.suppress(Exception):  # else it stays closed: later calls say so
            self._ctx = self._rebuilt(self._ctx, self._ctx.n_ctx, ())
        self._drop_all()

    @property
    def cells_in_order(self) -> bool:
        """Whether the cache is known to hold the window as a fresh context would."""
        return self._in_order

    def relayout(self) -> None:
        """Lay the window's cells out again as a fresh context's: position order, from
        cell 0. The window holds the same KV bytes after; if loading them back fails, the
        window is left empty (the record too) and the error raised.

        The cells go out and back in pieces of at most :attr:`ModelFacts.max_block_tokens`
        positions, so a windowed layer's KV is kept for every position, as in a block.
        """
        if self._in_order or not self._positions:
            self._in_order = True
            return
        first, last = self._positions[0], self._positions[-1] + 1
        with translate_errors("laying the window out in position order"):
            pieces = self._cells.in_order(self._ctx, self._positions)
            self._ctx.clear()
            try:
                for piece in pieces:
                    self._cells.load(self._ctx, piece, first, last)
            except BaseException:
                self._drop_all()
                raise
        self._in_order = self._positions[-1] == len(self._positions) - 1
        self._counters.relayouts += 1
        self._counters.relayout_tokens += len(self._positions)

    def _after_failure(self) -> None:
        # A failed decode leaves none of its batch behind; keep the record matching.
        if self._ctx.closed:
            return
        last = self._ctx.pos_max(MAIN_SEQ)
        while self._positions and self._positions[-1] > last:
            self._positions.pop()
            self._tokens.pop()

    def _read_logits(self) -> Logits:
        if self._carried is not None:
            return self._carried.copy()
        with translate_errors("reading logits"):
            return self._ctx.logits()

    def _remove(self, i: int, j: int, start: int, end: int, shift_tail: bool) -> int:
        with translate_errors(f"evicting [{start}, {end})"):
            last = self._positions[-1]
            self._in_order = self._in_order and j == len(self._positions) and not shift_tail
            if shift_tail and self._turn:  # the tail out, turned, back in: all or nothing
                try:
                    self._cells.slide(self._ctx, self._positions, start, end, last + 1)
                except BaseException:
                    self._drop_all()
                    raise
                return i
            self._ctx.seq_rm(MAIN_SEQ, start, end)
            if shift_tail:
                self._ctx.seq_add(MAIN_SEQ, end, last + 1, start - end)
        return i

    def _drop_all(self) -> None:
        if not self._ctx.closed:
            self._ctx.clear()
        self._positions.clear()
        self._tokens.clear()
        self._logits_pos = None
        self._carried = None
        self._in_order = True

    def _take(self, i: int, j: int, start: int, end: int) -> npt.NDArray[np.uint8]:
        most = self._facts.max_block_tokens
        if most is not None and end - start > most:
            raise InvalidRangeError(
                f"[{start}, {end}) holds {end - start} tokens; on this model a block holds at "
                f"most {most} (llama.cpp writes a windowed layer's KV only for the last "
                f"{most} positions of a range)"
            )
        with translate_errors(f"exporting [{start}, {end})"):
            return self._read_range(start, end)

    def _read_range(self, start: int, end: int) -> npt.NDArray[np.uint8]:
        return self._cells.read(self._ctx, start, end)

    def _put(self, block: ColdBlock, i: int, target: int, skip: int = 0) -> None:
        meta = block.meta
        self._room(meta.n_tokens)  # the block comes in whole, then its skipped tokens go
        self._in_order = self._in_order and i == len(self._positions) == target + skip
        with translate_errors(f"admitting [{meta.start}, {meta.end})"):
            self._cells.splice(
                self._ctx, block.data, meta.start, meta.n_tokens, target, skip, turn=self._turn
            )

    # -- key sketches (kvrt.backend.KeySketching) --

    def key_sketches(self, ranges: Sequence[tuple[int, int]]) -> list[object | None]:
        out: list[object | None] = []
        for start, end in ranges:
            s, e, i, j = self._resident_slice(start, end)
            if self._keys is None or j - i != e - s:
                out.append(None)
                continue
            out.append(self._keys.sketch(self._take(i, j, s, e), self._cells.ropes[0]))
        return out

    def cold_key_sketch(self, block: ColdBlock) -> object | None:
        if self._keys is None or block.meta.fingerprint != self.fingerprint:
            return None
        return self._keys.sketch(block.data, self._cells.ropes[0])

    def query_sketch(self, tokens: Sequence[int]) -> object | None:
        """Keys of the last tokens of ``tokens``, computed alone (:class:`~._keys.QueryKeys`)."""
        return self._query.keys(tokens) if self._query is not None and tokens else None

    def _reset(self) -> None:
        if self._away is not None and self._together is not None:
            self._together.abandon(self._away)
            self._away = None
        with translate_errors("clearing the context"):
            self._own.clear()
        self._carried = None
        self._in_order = True

    @property
    def closed(self) -> bool:
        return self._own.closed

    def close(self) -> None:
        with translate_errors("closing the context"):
            if self._away is not None and self._together is not None:
                self._together.abandon(self._away)  # nothing will read it again
                self._away = None
            if self._query is not None:
                self._query.close()
            if not self._own.closed:
                if self._release is not None:
                    self._release(self._own.handover())  # this window can reach it no more
                else:
                    self._own.close()
