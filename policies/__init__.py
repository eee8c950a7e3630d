"""Pluggable decision objects: pure, synchronous, no I/O, no clock reads.

Each policy answers one question from a frozen snapshot handed to it and is registered by
name in :mod:`kvrt.policy`, whose protocols it implements, so configuration can pick it
(the runtime's defaults are ``kvrt.PolicyConfig``'s):

>>> from kvrt import policies
>>> policies.get("hot_eviction", "class_lru")
<kvrt.policies.hot_eviction.ClassThenLRU object at ...>

The modules, one question each: which block leaves the hot window (:mod:`.hot_eviction`),
whether a block computed after another prefix may stand in (:mod:`.approximate`), whether
restoring beats recomputing (:mod:`.restore`), what earns a KV-byte slot in the cold
store (:mod:`.cold_admission`) and what leaves it first (:mod:`.cold_victim`), whether KV
computed under a partial window is computed again (:mod:`.partial_window`), where a
recurrent state is kept (:mod:`.checkpoint`), what is copied to the cold store at once
(:mod:`.write_through`: the stable cache classes both read), a message's cache class (:mod:`.message_class`), the kernels an
engine runs (:mod:`.kernels`) and whose engine call goes next (:mod:`.engine_turn`); knobs
are read by :mod:`._knobs`. In the order of :data:`LAYERS`; the architecture test holds it.
"""

from kvrt.policy import create as create
from kvrt.policy import names as names
from kvrt.policy import register as register

from . import approximate as approximate
from . import checkpoint as checkpoint
from . import cold_admission as cold_admission
from . import cold_victim as cold_victim
from . import engine_turn as engine_turn
from . import hot_eviction as hot_eviction
from . import kernels as kernels
from . import message_class as message_class
from . import partial_window as partial_window
from . import restore as restore
from . import write_through as write_through
from .approximate import AllowApproximate as AllowApproximate
from .approximate import AllowStableApproximate as AllowStableApproximate
from .approximate import BlendApproximate as BlendApproximate
from .approximate import NeverApproximate as NeverApproximate
from .checkpoint import EveryBlock as EveryBlock
from .checkpoint import KvSized as KvSized
from .cold_admission import AdmitAll as AdmitAll
from .cold_admission import SkipSmallVolatile as SkipSmallVolatile
from .cold_victim import ColdClassThenLRU as ColdClassThenLRU
from .engine_turn import FirstCome as FirstCome
from .engine_turn import LeastServed as LeastServed
from .hot_eviction import ClassThenLRU as ClassThenLRU
from .hot_eviction import KeyRelevance as KeyRelevance
from .hot_eviction import LexicalRelevance as LexicalRelevance
from .hot_eviction import ScoreThenLRU as ScoreThenLRU
from .kernels import FastestExact as FastestExact
from .message_class import SystemPinned as SystemPinned
from .message_class import Unclassed as Unclassed
from .partial_window import KeepPartial as KeepPartial
from .partial_window import RecomputePartial as RecomputePartial
from .restore import AlwaysRestore as AlwaysRestore
from .restore import CalibratedCost as CalibratedCost
from .restore import NeverRestore as NeverRestore
from .restore import SizeThreshold as SizeThreshold
from .write_through import AllThrough as AllThrough
from .write_through import NoneThrough as NoneThrough
from .write_through import StableThrough as StableThrough

get = create
"""A new instance of a registered policy (``kvrt.policy.create``)."""

LAYERS = (
    "hot_eviction",
    "approximate",
    "restore",
    "cold_admission",
    "cold_victim",
    "partial_window",
    "checkpoint",
    "write_through",
    "message_class",
    "kernels",
    "engine_turn",
    "_knobs",
)
"""The modules from the top down: each imports only those after it."""
