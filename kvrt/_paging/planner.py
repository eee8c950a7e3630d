"""The placement planner: which step brings a context's blocks in next.

Pure and synchronous, with no I/O: it reads a :class:`Scene` (a snapshot of the layout's
residency, the plan the eviction policy made, the window's budget) and a :class:`Cursor`
(how far placement has come) and returns the next :class:`Step`, or None when the context
is in place. The executor (:mod:`.placement`) runs the step against the engine context
and the cold store, then hands its outcome to :func:`advance` and asks again on a fresh
snapshot: whatever an await changed meanwhile (a block the store let go, a block another
session finished computing, room taken by a computation) is seen by the next plan, never
assumed. Tested without a model (``tests/unit/test_planner.py``).

The rules, in order of the layout:

- hot blocks stay; cold blocks come back when the plan keeps them hot, in runs of
  adjacent planned cold blocks, or when the next block is computed after them;
- llama.cpp computes only at the tail of the window, so at the first block with no KV
  (dropped) everything resident from there on is cleared (:class:`Begin`), and from then
  on blocks are placed in order, each computation right after a resident predecessor (a
  predecessor that lost its KV meanwhile is computed again first: never across a gap);
- adjacent dropped blocks are computed in one engine call, as many as the window's free
  room holds (at least one, making room for it): in a context larger than the window,
  each block is computed after as much of what came before as the window keeps, one
  block at a time once it is full; a block with an approximate cold copy is tried on its
  own first;
- once every block was placed, planned blocks that later computations pushed out come
  back (converge), until only planned or protected blocks are left to evict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .._types import Residency

__all__ = [
    "Begin",
    "Compute",
    "Cursor",
    "RestoreRun",
    "Scene",
    "Step",
    "WaitFor",
    "advance",
    "plan",
    "query_first",
]


@dataclass(frozen=True, slots=True)
class Scene:
    """What the planner sees of one placement at one moment (indices are layout positions)."""

    sizes: tuple[int, ...]
    """Tokens of each block."""
    starts: tuple[int, ...]
    """Context position of each block's first token."""
    states: tuple[Residency, ...]
    """Where each block's KV is now (``DROPPED`` also when the restore policy chose to
    compute it again)."""
    resumes: tuple[int, ...]
    """Leading tokens of each block resident at their positions."""
    planned: frozenset[int]
    """Blocks the eviction policy keeps hot once the context is placed."""
    protected: frozenset[int]
    """Blocks that never leave the window (sinks, the recent window, required segments)."""
    approximate: frozenset[int] = frozenset()
    """Dropped blocks with a cold copy after another prefix that the approximate-hit
    policy accepts."""
    elsewhere: frozenset[int] = frozenset()
    """Dropped blocks another session is computing now."""
    budget: int = 0
    """Tokens the window holds at most."""
    resident: int = 0
    """Tokens resident now (any block's, or none's)."""

    def __len__(self) -> int:
        return len(self.sizes)


def query_first(
    segments: Sequence[str], sizes: Sequence[int], states: Sequence[Residency], budget: int
) -> int:
    """Where a placement stops before placing the query: the number of blocks before the
    context's last segment (blocks named by their ``segments``, with their ``sizes`` and
    ``states``), when the context is larger than the window's ``budget`` and blocks of
    that segment and before it have no KV yet; else 0 (placed in one go)."""
    if sum(sizes) <= budget or not segments:
        return 0
    k = len(segments)
    while k and segments[k - 1] == segments[-1]:
        k -= 1
    dropped = [s is Residency.DROPPED for s in states]
    return k if k and any(dropped[:k]) and any(dropped[k:]) else 0


@dataclass(frozen=True, slots=True)
class Cursor:
    """How far one placement has come."""

    index: int = 0
    """The next block to look at."""
    computing: bool = False
    """Whether computing has begun (from then on blocks are placed in order)."""
    converging: bool = False
    """Whether every block was placed and pushed-out planned blocks are coming back."""


@dataclass(frozen=True, slots=True)
class RestoreRun:
    """Bring ``blocks`` (adjacent, cold) back in one engine call, never evicting ``keep``.

    Outcome: how many came back (0: the store let the first go meanwhile), or None when
    the window has no room beside what must stay; when ``required`` (the next block is
    computed after them) no room is an error instead.
    """

    index: int
    blocks: tuple[int, ...]
    keep: frozenset[int]
    required: bool = False
    converging: bool = False
    """Planned once every block was placed (see :func:`plan`)."""


@dataclass(frozen=True, slots=True)
class Begin:
    """Computing begins at block ``index``: clear every resident token from ``clear_from``
    on (whole blocks committed to the cold store first), bring the block before back when
    it is cold (``restore_before``) and, when none of the block's own tokens are resident,
    restore its leading tokens from a cold block that diverges after them where one exists
    (``leading``, never evicting ``keep``)."""

    index: int
    clear_from: int
    restore_before: bool
    leading: bool
    keep: frozenset[int]


@dataclass(frozen=True, slots=True)
class Compute:
    """Compute ``blocks`` (adjacent, no KV) at the window's tail in one engine call, never
    evicting ``keep``; first bring the block before back when it is cold
    (``restore_before``). When ``approximate``, the first block is tried as an approximate
    hit on its own first.

    Outcome: how many blocks were placed (1 for an approximate hit; 0 when the block
    before could not come back: the store let it go meanwhile).
    """

    index: int
    blocks: tuple[int, ...]
    keep: frozenset[int]
    restore_before: bool = False
    approximate: bool = False


@dataclass(frozen=True, slots=True)
class WaitFor:
    """Wait while another session computes block ``index`` (then plan again: its copy may
    be in the cold store now)."""

    index: int


Step = RestoreRun | Begin | Compute | WaitFor


def plan(scene: Scene, cursor: Cursor) -> Step | None:
    """The next step of placing ``scene``'s blocks from ``cursor``, or None when done."""
    if cursor.converging:
        return _converge(scene, cursor.index)
    states, planned = scene.states, scene.planned
    i = cursor.index
    while i < len(scene):
        state = states[i]
        pred = frozenset({i - 1}) if i else frozenset()
        if state is Residency.HOT:
            i += 1
            continue
        if state is Residency.COLD:
            after = i + 1 if i + 1 < len(scene) else None
            feeds = cursor.computing and after is not None and states[after] is Residency.DROPPED
            if i not in planned and not feeds:
                i += 1
                continue
            run = [i]
            while (k := i + len(run)) < len(scene) and k in planned and states[k] is Residency.COLD:
                run.append(k)
            # The block before stays only if the plan keeps it or this run feeds a
            # computation; otherwise it may make room like any unplanned block.
            keep = pred if feeds or pred <= planned else frozenset()
            return RestoreRun(i, tuple(run), keep, required=feeds)
        if not cursor.computing:
            j = i
            while j > 0 and states[j - 1] is Residency.DROPPED:
                j -= 1
            resumes = scene.resumes[j]
            return Begin(
                index=j,
                clear_from=scene.starts[j] + resumes,
                restore_before=j > 0 and states[j - 1] is Residency.COLD,
                leading=not resumes,
                keep=frozenset({j - 1}) if j else frozenset(),
            )
        if i and states[i - 1] is Residency.DROPPED:
            i -= 1  # the block before lost its KV meanwhile: it is computed again first
            continue
        if i in scene.elsewhere:
            return WaitFor(i)
        restore_before = bool(i) and states[i - 1] is Residency.COLD
        # Free room as it will be once the block before is resident. The first block is
        # computed whatever it pushes out; the run takes more only while they fit beside
        # everything resident, so that a full window computes one block at a time, each
        # after as much of what came before as the policy keeps (a sliding window), not
        # in runs that push out all but the block before them.
        free = scene.budget - scene.resident - (scene.sizes[i - 1] if restore_before else 0)
        run, total = [i], scene.sizes[i]
        while (k := i + len(run)) < len(scene):
            if (
                states[k] is not Residency.DROPPED
                or total + scene.sizes[k] > free
                or k in scene.approximate
            ):
                break
            run.append(k)
            total += scene.sizes[k]
        return Compute(i, tuple(run), pred, restore_before, approximate=i in scene.approximate)
    return _converge(scene, 0)


def _converge(scene: Scene, start: int) -> RestoreRun | None:
    """Bring back a planned block that computing later ones pushed out, in exchange for
    unplanned ones, so the window ends as the eviction policy chose."""
    for i in range(start, len(scene)):
        if i in scene.planned and scene.states[i] is Residency.COLD:
            return RestoreRun(i, (i,), scene.planned, converging=True)
    return None


def advance(cursor: Cursor, step: Step, outcome: int | None) -> Cursor:
    """Where placement stands once ``step`` (planned at ``cursor``) ended with ``outcome``
    (see each step's type)."""
    match step:
        case RestoreRun(converging=True):
            if outcome is None:  # only planned or protected blocks left to evict
                return Cursor(index=DONE, converging=True)
            return Cursor(index=step.index + 1, converging=True)
        case RestoreRun():
            skipped = len(step.blocks) if outcome is None else outcome
            return replace(cursor, index=step.index + skipped)
        case Begin():
            return Cursor(index=step.index, computing=True)
        case WaitFor():
            return replace(cursor, index=step.index)
        case Compute():
            return replace(cursor, index=step.index + (outcome or 0))


DONE = 1 << 62
"""A cursor index past any layout's end."""
