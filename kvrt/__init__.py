"""kvrt: lossless long context for local LLM engines.

Tokens that do not fit an engine's KV memory (the hot window) are parked as KV bytes in a
host-RAM cold store and paged back, bit-exactly where positions allow, when an agent sends
them again. This module is the whole public surface; everything else is private.
"""

import msgspec as _msgspec

from . import backend as backend
from . import cold as cold
from . import models as models
from . import policy as policy
from ._chat.grammar import Grammar as Grammar
from ._chat.grammar import read_response_format as read_response_format
from ._chat.sampling import Sampler as Sampler
from ._chat.tools import Tool as Tool
from ._chat.tools import ToolCall as ToolCall
from ._chat.tools import ToolCallDelta as ToolCallDelta
from ._chat.tools import read_tool_choice as read_tool_choice
from ._chat.tools import read_tools as read_tools
from ._checks import read_small_file as read_small_file
from ._cold import ColdKey as ColdKey
from ._cold import ColdStats as ColdStats
from ._cold import DiskStats as DiskStats
from ._cold import RemoteStats as RemoteStats
from ._cold import SharedStore as SharedStore
from ._config import CONFIG_ENV as CONFIG_ENV
from ._config import SETTINGS as SETTINGS
from ._config import Config as Config
from ._config import DiskConfig as DiskConfig
from ._config import EngineConfig as EngineConfig
from ._config import MemoryConfig as MemoryConfig
from ._config import PolicyConfig as PolicyConfig
from ._config import RemoteConfig as RemoteConfig
from ._config import SessionConfig as SessionConfig
from ._config import Setting as Setting
from ._config import load_config as load_config
from ._describe import ModelInfo as ModelInfo
from ._describe import describe_model as describe_model
from ._docs import document_fields as _document_fields
from ._engine.capacity import Capacity as Capacity
from ._engine.capacity import CapacityInputs as CapacityInputs
from ._engine.capacity import LayerProfile as LayerProfile
from ._engine.capacity import Limit as Limit
from ._engine.capacity import MemoryPolicy as MemoryPolicy
from ._engine.capacity import MemoryReading as MemoryReading
from ._engine.capacity import resolve_capacity as resolve_capacity
from ._engine.contract import AdmitMode as AdmitMode
from ._engine.contract import Capabilities as Capabilities
from ._engine.contract import ColdBlock as ColdBlock
from ._engine.contract import ColdBlockMeta as ColdBlockMeta
from ._engine.contract import Counters as Counters
from ._engine.contract import Engine as Engine
from ._engine.contract import EngineContext as EngineContext
from ._engine.contract import EvictMode as EvictMode
from ._engine.contract import ModelFacts as ModelFacts
from ._engine.contract import SamplingParams as SamplingParams
from ._engine.embedded import embedded_model_path as embedded_model_path
from ._engine.memory import read_memory as read_memory
from ._engine.registry import open_engine as open_engine
from ._errors import ArgumentTypeError as ArgumentTypeError
from ._errors import ColdBlockMismatchError as ColdBlockMismatchError
from ._errors import ColdStoreFullError as ColdStoreFullError
from ._errors import ConfigError as ConfigError
from ._errors import ContextNotPlacedError as ContextNotPlacedError
from ._errors import ContextTooLargeError as ContextTooLargeError
from ._errors import ContextTypeError as ContextTypeError
from ._errors import EngineError as EngineError
from ._errors import HotWindowFullError as HotWindowFullError
from ._errors import InvalidArgumentError as InvalidArgumentError
from ._errors import InvalidContextError as InvalidContextError
from ._errors import InvalidRangeError as InvalidRangeError
from ._errors import InvalidTokenError as InvalidTokenError
from ._errors import KvrtError as KvrtError
from ._errors import ModelLoadError as ModelLoadError
from ._errors import NotInColdStoreError as NotInColdStoreError
from ._errors import NotVisibleError as NotVisibleError
from ._errors import OperationCancelledError as OperationCancelledError
from ._errors import SessionClosedError as SessionClosedError
from ._errors import SharedValueError as SharedValueError
from ._errors import UnknownPolicyError as UnknownPolicyError
from ._errors import UnknownSegmentError as UnknownSegmentError
from ._paging.segments import Segment as Segment
from ._reports import BlockReport as BlockReport
from ._reports import Completion as Completion
from ._reports import ContextStatus as ContextStatus
from ._reports import Piece as Piece
from ._reports import PrefetchReport as PrefetchReport
from ._reports import SegmentReport as SegmentReport
from ._reports import SessionCounters as SessionCounters
from ._reports import SessionReport as SessionReport
from ._reports import Timings as Timings
from ._reports import TokenLogprob as TokenLogprob
from ._reports import TokenOrigins as TokenOrigins
from ._reports import Usage as Usage
from ._runtime import Runtime as Runtime
from ._runtime import check_policies as check_policies
from ._runtime import load_engine as load_engine
from ._runtime import open_runtime as open_runtime
from ._session import ChatCall as ChatCall
from ._session import Prefetch as Prefetch
from ._session import Reply as Reply
from ._session import SavedSegment as SavedSegment
from ._session import SavedSession as SavedSession
from ._session import Session as Session
from ._session import context_tokens as context_tokens
from ._session.chat import Message as Message
from ._session.chat import messages_of as read_messages
from ._types import CacheClass as CacheClass
from ._types import Residency as Residency
from ._units import format_size as format_size
from ._units import parse_size as parse_size

__version__ = "0.1.0"

__all__ = [
    "CONFIG_ENV",
    "SETTINGS",
    "AdmitMode",
    "ArgumentTypeError",
    "BlockReport",
    "CacheClass",
    "Capabilities",
    "Capacity",
    "CapacityInputs",
    "ChatCall",
    "ColdBlock",
    "ColdBlockMeta",
    "ColdBlockMismatchError",
    "ColdKey",
    "ColdStats",
    "ColdStoreFullError",
    "Completion",
    "Config",
    "ConfigError",
    "ContextNotPlacedError",
    "ContextStatus",
    "ContextTooLargeError",
    "ContextTypeError",
    "Counters",
    "DiskConfig",
    "DiskStats",
    "Engine",
    "EngineConfig",
    "EngineContext",
    "EngineError",
    "EvictMode",
    "Grammar",
    "HotWindowFullError",
    "InvalidArgumentError",
    "InvalidContextError",
    "InvalidRangeError",
    "InvalidTokenError",
    "KvrtError",
    "LayerProfile",
    "Limit",
    "MemoryConfig",
    "MemoryPolicy",
    "MemoryReading",
    "Message",
    "ModelFacts",
    "ModelInfo",
    "ModelLoadError",
    "NotInColdStoreError",
    "NotVisibleError",
    "OperationCancelledError",
    "Piece",
    "PolicyConfig",
    "Prefetch",
    "PrefetchReport",
    "RemoteConfig",
    "RemoteStats",
    "Reply",
    "Residency",
    "Runtime",
    "Sampler",
    "SamplingParams",
    "SavedSegment",
    "SavedSession",
    "Segment",
    "SegmentReport",
    "Session",
    "SessionClosedError",
    "SessionConfig",
    "SessionCounters",
    "SessionReport",
    "Setting",
    "SharedStore",
    "SharedValueError",
    "Timings",
    "TokenLogprob",
    "TokenOrigins",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "UnknownPolicyError",
    "UnknownSegmentError",
    "Usage",
    "backend",
    "check_policies",
    "cold",
    "context_tokens",
    "describe_model",
    "embedded_model_path",
    "format_size",
    "load_config",
    "load_engine",
    "models",
    "open_engine",
    "open_runtime",
    "parse_size",
    "policy",
    "read_memory",
    "read_messages",
    "read_response_format",
    "read_small_file",
    "read_tool_choice",
    "read_tools",
    "resolve_capacity",
]

for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type) and issubclass(_value, _msgspec.Struct):
        _document_fields(_value)

_ROOMS = (
    ("kvrt.__main__",),  # python -m kvrt
    ("kvrt.cli", "kvrt.bench"),  # the command line and kvrt bench
    ("kvrt.serve",),  # the OpenAI-compatible server
    ("kvrt.testing", "kvrt.adapters"),  # fixtures; the engines' adapters
    ("kvrt.native_bridge",),  # the only code touching C APIs
    ("kvrt", "kvrt.backend", "kvrt.cold"),  # the public faces (an engine's, a tier's)
    ("kvrt._runtime", "kvrt._tiers", "kvrt._describe"),  # a runtime, assembled
    ("kvrt._session",),  # the session as its caller sees it
    ("kvrt._paging",),  # where blocks live and how they move
    ("kvrt._reports",),  # what calls return
    ("kvrt._chat",),  # conversations to tokens and back: no engine state, no await
    ("kvrt._cold",),  # the cold store and its tiers
    ("kvrt.models",),  # model names -> files
    ("kvrt._engine",),  # talking to an engine
    ("kvrt.policies",),  # the built-in policies
    ("kvrt.policy",),  # the policy contract
    ("kvrt._threads", "kvrt._config", "kvrt._units", "kvrt._checks", "kvrt._types"),
    ("kvrt._errors",),
    ("kvrt._util", "kvrt._docs"),
)
"""kvrt's rooms from the top down, those of one rank together: a module imports only its
own room's and the rooms after it (the architecture test reads this and holds it). Inside
each package, its ``LAYERS`` order its modules the same way."""
