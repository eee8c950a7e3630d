"""Policy contracts: one question per kind, the frozen view each receives, and a registry
by name so your own policy plugs in without touching kvrt.

Policies are pure, synchronous objects: no I/O, no clock reads (times are handed to
them), no engine calls. The mechanism decides what *may* happen (sinks and the recent
window never leave the hot window; pinned cold entries are never dropped); a policy only
orders or accepts among what may.

| kind | protocol | answers |
|---|---|---|
| ``hot_eviction`` | :class:`HotEviction` | which resident blocks leave the hot window first |
| ``cold_victim`` | :class:`ColdVictim` | which cold-store entries are dropped first |
| ``cold_admission`` | :class:`ColdAdmission` | whether an evicted block keeps its KV bytes |
| ``restore`` | :class:`Restore` | restore an exact cold hit, or compute it again |
| ``approximate`` | :class:`Approximate` | accept the same tokens computed after another prefix |
| ``partial_window`` | :class:`PartialWindow` | compute again KV that saw a partial window, once the whole prefix fits |
| ``write_through`` | :class:`WriteThrough` | which blocks are copied to the cold store as soon as they are computed |
| ``message_class`` | :class:`MessageClass` | which cache class a chat message's segment gets from its role |
| ``engine_turn`` | :class:`EngineTurn` | which session's waiting engine call runs next |
| ``checkpoint`` | :class:`Checkpoints` | after which blocks a model with recurrent layers keeps its recurrent state |
| ``kernels`` | :class:`Kernels` | which kernel configuration the engine runs, among those the kernel probe measured |

Register a factory (usually the class) under a kind and a name, then pick it by that name
in the configuration (``policies.hot_eviction = "mine"``, ``KVRT_HOT_EVICTION``,
``--hot-eviction``) or per session (``rt.open_session(hot_eviction="mine")``)::

    import kvrt.policy

    class NewestFirst:
        def order(self, candidates):
            return [b.id for b in sorted(candidates, key=lambda b: -b.last_used)]

    kvrt.policy.register("hot_eviction", "newest_first", NewestFirst)

A runtime makes one instance per name and shares it among the sessions that pick it. A
restore policy that also has :class:`Calibrating`'s methods is fed every session's
measured restores and prefills; one with :class:`Estimating`'s shows its estimates in
``explain()``. A hot-eviction policy with :class:`Relevance`'s method scores every block
against the query before the context is placed, and reads the scores back in
``BlockView.relevance``; with :class:`KeyScoring`'s too, it scores by key vectors where
the engine gives them. An approximate-hit policy with :class:`Blending`'s method has part
of each accepted hit computed afresh.

A factory that takes one argument is a policy with a knob: ``"name:argument"`` hands it
the text after the colon (``approximate="blend:0.3"``); a ``ValueError`` from it becomes a
:class:`~kvrt.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from ._errors import ConfigError, UnknownPolicyError
from ._types import (
    ApproximateQuery,
    BlockView,
    CacheClass,
    CheckpointView,
    ColdEntryView,
    KernelSetting,
    KernelTrial,
    KeySketch,
    KeySketches,
    PartialWindowQuery,
    RestoreQuery,
    SequenceStep,
    TurnView,
)

__all__ = [
    "KINDS",
    "Approximate",
    "ApproximateQuery",
    "Arranging",
    "Blending",
    "BlockView",
    "CacheClass",
    "Calibrating",
    "CheckpointView",
    "Checkpoints",
    "ColdAdmission",
    "ColdEntryView",
    "ColdVictim",
    "EngineTurn",
    "Estimating",
    "HotEviction",
    "JoiningTurns",
    "KernelSetting",
    "KernelTrial",
    "Kernels",
    "KeyScoring",
    "KeySketch",
    "KeySketches",
    "LexicalBlending",
    "MessageClass",
    "PartialWindow",
    "PartialWindowQuery",
    "Relevance",
    "Restore",
    "RestoreQuery",
    "SequenceStep",
    "TurnView",
    "WriteThrough",
    "create",
    "names",
    "register",
    "unregister",
]

T = TypeVar("T")


@runtime_checkable
class HotEviction(Protocol):
    def order(self, candidates: Sequence[BlockView]) -> list[int]:
        """Ids of ``candidates`` (resident blocks that may leave), first to leave first."""
        ...


@runtime_checkable
class ColdVictim(Protocol):
    def order(self, entries: Sequence[ColdEntryView]) -> list[int]:
        """Ids of ``entries`` (cold entries that may be dropped), first to drop first."""
        ...


@runtime_checkable
class ColdAdmission(Protocol):
    def admit(self, block: BlockView) -> bool:
        """Whether ``block``, leaving the hot window, keeps its KV bytes in the cold store
        (False: it keeps its tokens only and is computed again when it comes back)."""
        ...


@runtime_checkable
class Restore(Protocol):
    def restore(self, query: RestoreQuery) -> bool:
        """Whether to restore an exact cold hit (True) or compute it again (False)."""
        ...


@runtime_checkable
class Approximate(Protocol):
    def accept(self, query: ApproximateQuery) -> bool:
        """Whether to restore a block's tokens computed after a different prefix, with
        keys re-rotated to the new position (not equal to recomputing; always labelled)."""
        ...


@runtime_checkable
class PartialWindow(Protocol):
    def recompute(self, query: PartialWindowQuery) -> bool:
        """Whether to compute again a block whose KV was computed while earlier tokens of
        its context were not hot, now that its whole prefix fits hot (True: the context
        becomes exact; False: the KV is kept and the context stays labelled not exact)."""
        ...


@runtime_checkable
class WriteThrough(Protocol):
    def write_through(self, block: BlockView) -> bool:
        """Whether ``block`` is copied to the cold store as soon as it is computed (so
        another session sending the same prefix restores it while this one still holds
        it hot), not only when it leaves the hot window."""
        ...


@runtime_checkable
class MessageClass(Protocol):
    def cache_class(self, role: str) -> CacheClass:
        """The cache class of a chat message's segment by its role (``system``, ``user``,
        ``assistant``, ``tool``), where the message does not set its own."""
        ...


@runtime_checkable
class EngineTurn(Protocol):
    def pick(self, waiting: Sequence[TurnView]) -> int:
        """The id of the call in ``waiting`` (never empty) that runs next on the engine,
        whose slots sessions share (``engine.parallel``)."""
        ...


@runtime_checkable
class JoiningTurns(Protocol):
    """Optional for an engine-turn policy: which waiting calls join the one it picked,
    where the engine runs them as one call (steps of several sessions' replies, on an
    engine that offers it where each gets what it would alone). Without it, every one
    that can joins, up to the engine's ``engine.together``."""

    def join(self, chosen: TurnView, others: Sequence[TurnView]) -> Sequence[int]:
        """The ids, of ``others``, of the calls that run with ``chosen``."""
        ...


@runtime_checkable
class Checkpoints(Protocol):
    def keep(self, block: CheckpointView) -> bool:
        """Whether the recurrent state is checkpointed after ``block`` as it is computed
        (a model with attention and recurrent layers). A block with its checkpoint can end
        a restored context, in any session, and the context can go back to its end without
        computing again; one without comes back only before resident tokens."""
        ...


@runtime_checkable
class Blending(Protocol):
    """Optional for an approximate-hit policy: compute part of an accepted hit afresh.

    The session computes this many of the block's leading tokens and restores the rest
    (CacheBlend's selective recompute, by position). The query says where the run of
    approximate hits holding the block begins (``run_start``, the first token after the
    changed prefix) and how long it is (``run_tokens``), so a policy can recompute the
    tokens right after the change rather than the head of every block.
    """

    def recompute_tokens(self, query: ApproximateQuery) -> int:
        """How many of the block's leading tokens to compute afresh (0 to all of them)."""
        ...


@runtime_checkable
class Calibrating(Protocol):
    """Optional for any policy: learns from the runtime's measured work."""

    def observe_restore(self, n_bytes: int, seconds: float) -> None: ...

    def observe_prefill(self, start: int, n_tokens: int, seconds: float) -> None: ...


@runtime_checkable
class Relevance(Protocol):
    """Optional for a hot-eviction policy: how relevant each block is to the query.

    Called (pure, synchronous) each time a context is placed, with every block's tokens
    and the tokens of the context's last segment; the scores come back to ``order`` as
    ``BlockView.relevance`` and show in ``explain()``.
    """

    def relevance(self, blocks: Sequence[Sequence[int]], query: Sequence[int]) -> list[float]:
        """One score per block, higher is more relevant."""
        ...


@runtime_checkable
class KeyScoring(Protocol):
    """Optional for a hot-eviction policy with :class:`Relevance`: scores from key vectors.

    Where the engine context offers key sketches (:class:`kvrt.backend.KeySketching`), the
    session calls this instead of ``relevance``, with each block's sketch (None where it
    has none: not computed yet, or cold outside RAM) and the query's. A long context hands
    its blocks' as one :class:`KeySketches` (a sequence of them, packed): a policy may read
    its arrays at once instead of block by block.
    """

    def key_relevance(self, blocks: Sequence[object | None], query: object) -> list[float | None]:
        """One score per block, None where it cannot say; higher is more relevant."""
        ...


@runtime_checkable
class LexicalBlending(Protocol):
    """Optional for a :class:`KeyScoring` policy: the final scores from the key scores and
    the lexical ones (``relevance``'s, over the same blocks and query)."""

    def blend(self, keys: Sequence[float | None], lexical: Sequence[float]) -> list[float | None]:
        """One score per block, None where the key score is None."""
        ...


@runtime_checkable
class Arranging(Protocol):
    """Optional for a hot-eviction policy: the order a long context's window shows the
    blocks chosen for the query (without it: the context's own order).

    Positions in such a window are not the context's anyway; the order is the policy's
    to choose. Blocks that follow one another in the context must stay together, in
    their order (a sentence cut by a block edge).
    """

    def arrange(self, chosen: Sequence[BlockView]) -> list[int]:
        """Ids of ``chosen``, first shown first, the last one nearest the query.
        ``chosen`` comes as the window shown last had them, then the blocks it did not
        show in the context's order."""
        ...


@runtime_checkable
class Estimating(Protocol):
    """Optional for a restore policy: its cost estimates, shown in ``explain()``."""

    def estimate(self, query: RestoreQuery) -> tuple[float, float]:
        """Seconds to restore, seconds to compute again."""
        ...


@runtime_checkable
class Kernels(Protocol):
    def choose(self, settings: Sequence[KernelSetting]) -> int | None:
        """The index in ``settings`` of the configuration the engine runs with. Each is
        one the kernel probe measured on this machine: whether its results agree bit for
        bit however the work is cut (``exact``), and its speeds. The first is the engine's
        default. None: none will do, and the engine runs its default, labelled
        approximate."""
        ...


KINDS: dict[str, type] = {
    "hot_eviction": HotEviction,
    "cold_victim": ColdVictim,
    "cold_admission": ColdAdmission,
    "restore": Restore,
    "approximate": Approximate,
    "partial_window": PartialWindow,
    "write_through": WriteThrough,
    "message_class": MessageClass,
    "engine_turn": EngineTurn,
    "checkpoint": Checkpoints,
    "kernels": Kernels,
}
"""Every policy kind and the protocol its policies implement."""

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {kind: {} for kind in KINDS}


def register(kind: str, name: str, factory: Callable[..., Any] | None = None) -> Any:
    """Make ``factory`` (a class, or any callable returning a policy) the ``kind`` policy
    called ``name``. Without ``factory`` it is a class decorator. A name is registered once.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown policy kind {kind!r} (expected one of: {', '.join(KINDS)})")
    if not isinstance(name, str) or not name or ":" in name:
        raise ConfigError(f"a policy name must be a non-empty str without ':', got {name!r}")

    def add(made: T) -> T:
        if not callable(made):
            raise ConfigError(f"the {kind} policy {name!r} must be a class or a callable")
        table = _REGISTRY[kind]
        if name in table:
            raise ConfigError(f"a {kind} policy named {name!r} is already registered")
        table[name] = made
        return made

    return add if factory is None else add(factory)


def create(kind: str, name: str) -> Any:
    """A new instance of the ``kind`` policy registered as ``name``, checked against its
    protocol; :class:`~kvrt.ConfigError` if there is none.

    ``"name:argument"`` passes ``argument`` (a str) to the factory of ``name``, for policies
    with a knob (``approximate="blend:0.15"``); a policy without one refuses it.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown policy kind {kind!r} (expected one of: {', '.join(KINDS)})")
    table = _REGISTRY[kind]
    base, colon, argument = name.partition(":")
    factory = table.get(base)
    if factory is None:
        known = ", ".join(sorted(table)) or "none"
        raise UnknownPolicyError(f"no {kind} policy named {base!r} (known: {known})")
    if colon:
        try:
            made = factory(argument)
        except TypeError:
            raise ConfigError(
                f"the {kind} policy {base!r} takes no argument (got {name!r})"
            ) from None
        except ValueError as exc:
            raise ConfigError(f"the {kind} policy {name!r}: {exc}") from None
    else:
        made = factory()
    protocol = KINDS[kind]
    if not isinstance(made, protocol):
        raise ConfigError(
            f"the {kind} policy {name!r} does not implement kvrt.policy.{protocol.__name__}"
        )
    return made


def unregister(kind: str, name: str) -> None:
    """Forget the ``kind`` policy ``name`` (for test suites; runtimes keep the instances
    they made)."""
    if _REGISTRY.get(kind, {}).pop(name, None) is None:
        raise UnknownPolicyError(f"no {kind} policy named {name!r}")


def names(kind: str) -> list[str]:
    """Registered names of ``kind``, sorted."""
    return sorted(_REGISTRY.get(kind, {}))
