"""Windows of several sessions decoding together: one ``llama_decode`` advances each by a
token.

The engine keeps one context of several KV streams (:class:`~native_bridge.llama_batch.
LlamaSequences`), made when windows first step together. A window joins by moving its
cells into a free stream, in position order; its own context keeps them meanwhile (nothing
there changes while the window is away). A joint step decodes one token for every window
that takes part. The window comes home (its stream's cells back into its own context) before
anything else touches that context, or as the engine closes it.

A stream holds nothing of the others: where the kernel probe found sequences decoded
together equal to each decoded alone (``KernelVerdict.batch_exact``), a window stepped
here gives its own context's logits bit for bit. Only windows laid out as a fresh context
(cell ``k`` holds position ``k``) join, on models without recurrent layers or windowed
layers, whose keys are rotated the same at the streams' size.

Moving costs what exporting and loading the window does (SmolLM2, two cores: 23 ms in,
27 ms out for 1,900 tokens; under 5 ms each for 512), once per reply; a step of eight
windows together cost 48 ms against 87 ms one after another. Which steps join is the
engine-turn policy's choice; this module only does it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvrt import EngineError
from kvrt.backend import Logits, ModelFacts
from kvrt.native_bridge.llama import LlamaModel
from kvrt.native_bridge.llama_batch import LlamaSequences, whole_stream

from .._errors import translate_errors
from ._rope import ModelRope

__all__ = ["STREAM_ROOM", "StreamWindow", "Together"]

_log = logging.getLogger("kvrt")

STREAM_ROOM = 512
"""Cells a stream keeps beyond the largest window that made it: room for replies."""


class StreamWindow(Protocol):
    """What of a window a joint step uses (:class:`~._context.LlamaEngineContext`)."""

    @property
    def next_position(self) -> int: ...

    def stream_for_step(self, token: int, *, move: bool = True) -> int | None: ...

    def stepped(self, token: int, logits: Logits) -> None: ...

    def step(self, token: int) -> Logits: ...


class Together:
    """The engine's streams for windows decoding together (at most ``streams`` at once).

    Its context is made for the first windows that join: streams of the largest plus
    :data:`STREAM_ROOM` cells, made again for the next first ones; it is freed when the
    last window leaves (a session's reply ends), and as the engine closes. Every call on
    it holds its lock: the session whose window comes home may be in another thread than
    the step under way."""

    def __init__(
        self,
        model: LlamaModel,
        facts: ModelFacts,
        rope: ModelRope,
        *,
        streams: int,
        n_threads: int,
    ) -> None:
        self.streams = streams
        self._model, self._facts, self._rope = model, facts, rope
        self._n_threads = n_threads
        self._seqs: LlamaSequences | None = None
        self._free: list[int] = []
        self._lock = threading.Lock()
        self.steps = 0
        """Joint steps run (each one ``llama_decode`` of two windows or more)."""

    @property
    def cells(self) -> int:
        """Cells a stream holds now (0 before the context is made)."""
        return self._seqs.cells if self._seqs is not None else 0

    @property
    def nbytes(self) -> int:
        """The streams' KV bytes, allocated while the context lives."""
        return self.cells * self.streams * self._facts.kv_bytes_per_token

    def most_bytes(self, window_tokens: int) -> int:
        """The streams' KV bytes where windows of up to ``window_tokens`` step together
        (as :meth:`_make` sizes them; 0 where none is offered)."""
        if not self.offered:
            return 0
        cells = whole_stream(self._cells(window_tokens + 1))
        return cells * self.streams * self._facts.kv_bytes_per_token

    @property
    def offered(self) -> bool:
        """Whether windows may step here: where the kernel probe found sequences decoded
        together exact, on a model whose window has no recurrent state or windowed
        layers, and whose keys are rotated the same at any context size."""
        verdict = self._facts.kernels
        return (
            self.streams > 1
            and verdict is not None
            and verdict.batch_exact
            and not self._facts.checkpoint_bytes
            and not self._facts.recurrent
            and not self._facts.sliding_window_live
            and not self._model.n_swa
            and self._rope.identity(self._facts.trained_context) == ""
        )

    def reserve(self, n_tokens: int) -> None:
        """Before windows of up to ``n_tokens`` join: make the context, where none is,
        with streams that hold them."""
        with self._lock:
            if self._seqs is None:
                self._make(n_tokens + 1)

    def join(self, window: npt.NDArray[np.uint8], n_tokens: int) -> int | None:
        """Load a window of ``n_tokens`` (its own context's bytes) into a free stream: the
        stream's id, or None where none is free or large enough (or none was made:
        :meth:`reserve`)."""
        with self._lock:
            if self._seqs is None or not self._free or self.cells <= n_tokens + 1:
                return None
            seq = self._free.pop()
            try:
                with translate_errors("moving a window into a stream"):
                    assert self._seqs is not None
                    self._seqs.load_window(seq, window)
            except BaseException:
                self._drop(seq)
                raise
            return seq

    def room(self, seq: int) -> int:
        """Cells still free in stream ``seq``."""
        with self._lock:
            assert self._seqs is not None
            return self._seqs.cells - self._seqs.next_position(seq)

    def step(self, seqs: Sequence[int], tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """Stream ``seqs[i]`` advanced by ``tokens[i]``, all in one engine call: the
        logits after each, a row each."""
        with self._lock, translate_errors("decoding windows together"):
            assert self._seqs is not None
            rows = self._seqs.decode(tokens, seqs)
        if len(seqs) > 1:
            self.steps += 1
        return rows

    def step_windows(
        self, windows: Sequence[StreamWindow | Exception], tokens: Sequence[int]
    ) -> list[Logits | Exception]:
        """Advance ``windows[i]`` by ``tokens[i]``: those in (or moved into) a stream in
        one engine call, any other alone in its own context. Each gets its next logits,
        or the error its step raised (a step refused leaves its window as it was; an
        error in ``windows`` is its own answer)."""
        out: list[Logits | Exception] = [EngineError("a step gave nothing")] * len(windows)
        joined: list[tuple[int, StreamWindow, int, int]] = []
        if len(windows) > 1:
            try:
                self.reserve(max(w.next_position for w in windows if not isinstance(w, Exception)))
            except (EngineError, ValueError) as exc:  # each steps alone
                _log.warning("kvrt: windows cannot step together: %s", exc)
        for i, (window, token) in enumerate(zip(windows, tokens, strict=True)):
            try:
                if isinstance(window, Exception):
                    raise window
                seq = window.stream_for_step(token, move=len(windows) > 1)
                if seq is None:
                    out[i] = window.step(token)
                else:
                    joined.append((i, window, seq, token))
            except Exception as exc:
                out[i] = exc
        if joined:
            try:
                rows = self.step([j[2] for j in joined], [j[3] for j in joined])
            except Exception as exc:
                for i, *_ in joined:
                    out[i] = exc
            else:
                for (i, window, _, token), row in zip(joined, rows, strict=True):
                    window.stepped(token, row)
                    out[i] = row.copy()
        return out

    def leave(self, seq: int) -> npt.NDArray[np.uint8]:
        """The window in ``seq`` as its own context writes it; the stream is free again."""
        with self._lock:
            try:
                with translate_errors("moving a window out of its stream"):
                    assert self._seqs is not None
                    return self._seqs.window(seq)
            finally:
                self._drop(seq)

    def abandon(self, seq: int) -> None:
        """Free ``seq`` without reading it (its window is lost to its session)."""
        with self._lock:
            self._drop(seq)

    def close(self) -> None:
        with self._lock:
            if self._seqs is not None:
                self._seqs.close()
                self._seqs = None
            self._free = []

    def _drop(self, seq: int) -> None:
        """Free ``seq``; the context goes with the last window in it (its memory back)."""
        if self._seqs is not None and not self._seqs.closed:
            self._seqs.clear(seq)
        if seq not in self._free:
            self._free.append(seq)
        if len(self._free) == self.streams and self._seqs is not None:
            self._seqs.close()
            self._seqs = None

    def _cells(self, need: int) -> int:
        """Cells asked of each stream for windows of up to ``need`` cells (LlamaSequences
        rounds them to whole streams)."""
        return min(need + STREAM_ROOM, self._facts.trained_context)

    def _make(self, need: int) -> None:
        cells = self._cells(need)
        if cells <= need:
            return
        with translate_errors(f"making {self.streams} streams of {cells} cells"):
            self._seqs = LlamaSequences(
                self._model,
                n_seq=self.streams,
                cells=cells,
                n_threads=self._n_threads,
                kv_type=self._facts.kv_type,
                flash_attn=self._facts.flash_attention,
            )
        self._free = list(range(self.streams - 1, -1, -1))
