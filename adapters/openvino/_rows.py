"""Windows of several OpenVINO sessions decoding together: one ``infer`` advances each by
a token, a row each of one request (:class:`~kvrt.native_bridge.openvino.OvRows`).

Offered only where the kernel probe found rows of one request, padded to the longest,
equal to each sequence in a request of its own, bit for bit (``batch_exact``): on this
machine, with one thread. A window joins when it first steps beside others: the rows are
loaded again, the rows already there and the joining windows' entries (the plugin's state
is copied whole on every write, so a join costs a pass over every row). Its own request
keeps its entries meanwhile; the window comes home (the entries it gained appended to its
own request) before anything else touches that request, and its row is dropped at the next
load. A row with no window gets a stand-in entry each step; a window that takes no part in
a step comes home first (measured: a masked stand-in among a row's own entries changes
what follows it by up to 0.003 on SmolLM2, where padding before them changes nothing).

Which steps join is the engine-turn policy's choice; this module only does it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvrt import EngineError
from kvrt.backend import Logits, ModelFacts
from kvrt.native_bridge.openvino import OvModel, OvRows

from .._errors import translate_errors

__all__ = ["RowWindow", "Rows"]

_log = logging.getLogger("kvrt")


class RowWindow(Protocol):
    """What of a window a joint step uses (:class:`~._context.OpenVinoEngineContext`)."""

    @property
    def next_position(self) -> int: ...

    def check_step(self, token: int) -> None: ...

    def home_entries(self) -> npt.NDArray[Any]: ...

    def stepped(self, token: int, logits: Logits) -> None: ...

    def took_home(self, gained: npt.NDArray[np.float32] | None) -> None: ...

    def step(self, token: int) -> Logits: ...


class Rows:
    """The engine's rows for windows decoding together (at most ``streams`` at once).

    The request is made for the first windows that join and freed when the last one
    leaves. Every call holds the lock: a window may come home from another thread than
    the step under way. It is re-entrant: a window that cannot take its entries home is
    emptied, which gives up its row, inside a call that holds it."""

    def __init__(self, model: OvModel, facts: ModelFacts, *, streams: int) -> None:
        self.streams = streams
        self._model, self._facts = model, facts
        self._rows: OvRows | None = None
        self._members: list[RowWindow | None] = []
        """The window in each row (None: it left; its row goes at the next load)."""
        self._home: list[int] = []
        """Entries each row's window holds in its own request."""
        self._lock = threading.RLock()
        self.steps = 0
        """Joint steps run (each one ``infer`` of two windows or more)."""

    @property
    def offered(self) -> bool:
        """Whether windows may step here: where the kernel probe found rows of one
        request exact against requests of their own, on a KV precision whose entries
        move in and out unchanged (a u8 cache re-quantizes them on every load)."""
        verdict = self._facts.kernels
        return (
            self.streams > 1
            and self._facts.exact_in_place
            and verdict is not None
            and verdict.batch_exact
        )

    @property
    def nbytes(self) -> int:
        """The rows' KV bytes, held while any window is in them."""
        if self._rows is None:
            return 0
        return self._rows.rows * self._rows.width * self._facts.kv_bytes_per_token

    def most_bytes(self, window_tokens: int) -> int:
        """The rows' KV bytes where windows of up to ``window_tokens`` step together (0
        where none is offered)."""
        return self.streams * window_tokens * self._facts.kv_bytes_per_token if self.offered else 0

    def holds(self, window: RowWindow) -> bool:
        with self._lock:
            return any(w is window for w in self._members)

    def step_windows(
        self, windows: Sequence[RowWindow | Exception], tokens: Sequence[int]
    ) -> list[Logits | Exception]:
        """Advance ``windows[i]`` by ``tokens[i]``: those in (or brought into) the rows in
        one ``infer``, any other alone in its own request. Each gets its next logits, or
        the error its step raised (a step refused leaves its window as it was; an error in
        ``windows`` is its own answer)."""
        out: list[Logits | Exception] = [EngineError("a step gave nothing")] * len(windows)
        ready: list[tuple[int, RowWindow, int]] = []
        for i, (window, token) in enumerate(zip(windows, tokens, strict=True)):
            try:
                if isinstance(window, Exception):
                    raise window
                window.check_step(token)
                ready.append((i, window, token))
            except Exception as exc:
                out[i] = exc
        with self._lock:
            joined = [w for w in self._members if w is not None]
            if len(ready) > 1:
                try:
                    joined = self._seat([w for _, w, _ in ready])
                except EngineError as exc:  # those not seated yet step alone
                    _log.warning("kvrt: windows cannot step together: %s", exc)
            together = [(i, w, t) for i, w, t in ready if any(w is j for j in joined)]
            for w in joined:  # a row with no token this step would gain a hole: home
                if not any(w is x for _, x, _ in together):
                    self._send_home(w)
            if together:
                try:
                    rows = self._step({id(w): t for _, w, t in together})
                except Exception as exc:
                    for i, *_ in together:
                        out[i] = exc
                else:
                    for i, window, token in together:
                        row = rows[self._row(window)]
                        window.stepped(token, row)
                        out[i] = row.copy()
        seated = {i for i, *_ in together}
        for i, window, token in ready:
            if i not in seated:
                try:
                    out[i] = window.step(token)
                except Exception as exc:
                    out[i] = exc
        return out

    def _send_home(self, window: RowWindow) -> None:
        """``window``'s gained entries appended to its own request, its row given up."""
        row = self._row(window)
        gained: npt.NDArray[np.float32] | None = None
        try:
            assert self._rows is not None
            with translate_errors("moving a window out of its row"):
                gained = self._rows.entries(row, self._home[row])
        except EngineError as exc:
            _log.warning("kvrt: a window's row could not be read, the window is lost: %s", exc)
        finally:
            self._drop(row)
        try:
            window.took_home(gained)
        except EngineError as exc:  # its next call says so
            _log.warning("kvrt: a window could not come home from its row: %s", exc)

    def leave(self, window: RowWindow) -> npt.NDArray[np.float32]:
        """The entries ``window`` gained in its row, for its own request; its row is no
        longer its own."""
        with self._lock:
            row = self._row(window)
            try:
                with translate_errors("moving a window out of its row"):
                    assert self._rows is not None
                    return self._rows.entries(row, self._home[row])
            finally:
                self._drop(row)

    def abandon(self, window: RowWindow) -> None:
        """Give up ``window``'s row without reading it (its window is lost to its session)."""
        with self._lock:
            for row, w in enumerate(self._members):
                if w is window:
                    self._drop(row)

    def close(self) -> None:
        with self._lock:
            self._free()

    # -- under the lock --

    def _row(self, window: RowWindow) -> int:
        return next(r for r, w in enumerate(self._members) if w is window)

    def _seat(self, windows: Sequence[RowWindow]) -> list[RowWindow]:
        """Seat ``windows`` in the rows (as many as there is room for, loading the rows
        again where any is new); the windows in the rows."""
        members = [w for w in self._members if w is not None]
        new = [w for w in windows if not any(w is m for m in members)]
        room = self.streams - len(members)
        if new and room > 0:
            self._load(members, new[:room])
        return [w for w in self._members if w is not None]

    def _load(self, members: list[RowWindow], joining: list[RowWindow]) -> None:
        """Rows of ``members`` (as they are) and ``joining`` (from their own requests) in
        a request made for them; the rows before are given up only once it holds them,
        so a load that fails loses nothing."""
        old = self._rows
        parts: list[npt.NDArray[Any]] = []
        homes: list[int] = []
        with translate_errors("moving windows into rows"):
            for w in members:
                assert old is not None
                row = self._row(w)
                parts.append(old.entries(row))
                homes.append(self._home[row])
            for w in joining:
                entries = w.home_entries()
                parts.append(entries)
                homes.append(entries.shape[3])
            rows = OvRows(self._model)
            try:
                rows.load(parts)
            except BaseException:
                rows.close()
                raise
        if old is not None:
            old.close()
        self._rows, self._members, self._home = rows, [*members, *joining], homes

    def _step(self, tokens: dict[int, int]) -> npt.NDArray[np.float32]:
        assert self._rows is not None
        asked = [None if w is None else tokens.get(id(w)) for w in self._members]
        positions = [0 if w is None else w.next_position for w in self._members]
        with translate_errors("decoding windows together"):
            logits = self._rows.step(asked, positions)
        if sum(t is not None for t in asked) > 1:
            self.steps += 1
        return logits

    def _drop(self, row: int) -> None:
        self._members[row] = None
        if all(w is None for w in self._members):
            self._free()

    def _free(self) -> None:
        if self._rows is not None:
            self._rows.close()
        self._rows, self._members, self._home = None, [], []
