"""The engine contract: what an adapter implements so kvrt can drive an engine.

This is the page an adapter author reads. An adapter is a package with one class that
implements :class:`Engine` (one loaded model, shared by every session) and whose
``open_context`` returns an :class:`EngineContext` (one KV window, owned by one session).
Both are synchronous: kvrt calls them from worker threads, one call at a time per context,
so an adapter never awaits. Positions are the engine's token positions; a context holds
one token per position, in increasing order, possibly with gaps left by gap eviction.

What a context must do, and what kvrt relies on:

- ``prefill(tokens, start=...)`` appends tokens (in chunks, calling ``checkpoint`` between
  them so a cancelled call stops cleanly) and returns the logits after the last one;
  ``step(token)`` decodes one; ``logits()`` returns the last logits again.
- ``evict(start, end, EvictMode.GAP)`` removes a range and leaves every other position as
  it was; ``EvictMode.SLIDE`` shifts the tail down (RoPE re-rotation).
- ``export(start, end)`` returns a :class:`ColdBlock`: immutable KV bytes plus the
  :class:`ColdBlockMeta` needed to check them later (model fingerprint, KV type,
  positions, tokens). ``admit(block, AdmitMode.IN_PLACE)`` puts it back at its positions,
  whole or not at all (``AdmitMode.TAIL`` after the last resident token, keys re-rotated;
  with ``skip=m``, only the tokens after its first ``m``, which were just computed); bytes of another model, layout or position are refused with
  :class:`~kvrt.ColdBlockMismatchError`, never handed to native code.
- ``capabilities`` says honestly what is exact (``exact_in_place``) and what is not.
- Optionally, :class:`KeySketching` (``key_sketches``, ``cold_key_sketch``,
  ``query_sketch``): key vectors with RoPE undone, which the ``relevance`` hot-eviction
  policy scores blocks by; without them it scores by tokens (BM25).
- Engine errors become kvrt errors (:class:`~kvrt.EngineError`, :class:`~kvrt.ModelLoadError`
  ...) at the adapter boundary, with ``raise ... from exc``; no argument that could abort
  the process may reach native code.

An adapter package may also export ``REFERENCE_NAME``, ``reference_greedy_tps`` and
``reference_trace``: the engine's own decode loop without kvrt, which ``kvrt bench``
measures beside kvrt.

The helpers below (model paths, digests, GGUF metadata, a sampler, the engine settings)
are there so an adapter needs nothing private from kvrt.
"""

from __future__ import annotations

from ._chat.sampling import Sampler as Sampler
from ._config import EngineConfig as EngineConfig
from ._engine.contract import AdmitMode as AdmitMode
from ._engine.contract import Capabilities as Capabilities
from ._engine.contract import Checkpoint as Checkpoint
from ._engine.contract import ColdBlock as ColdBlock
from ._engine.contract import ColdBlockMeta as ColdBlockMeta
from ._engine.contract import Counters as Counters
from ._engine.contract import Engine as Engine
from ._engine.contract import EngineContext as EngineContext
from ._engine.contract import EvictMode as EvictMode
from ._engine.contract import KeySketching as KeySketching
from ._engine.contract import Logits as Logits
from ._engine.contract import ModelFacts as ModelFacts
from ._engine.contract import Recompute as Recompute
from ._engine.contract import SamplingParams as SamplingParams
from ._engine.contract import StepsTogether as StepsTogether
from ._engine.contract import TemplateSource as TemplateSource
from ._engine.gguf_header import HeaderError as HeaderError
from ._engine.gguf_header import TensorInfo as TensorInfo
from ._engine.gguf_header import read_header as read_header
from ._engine.gguf_header import read_tensors as read_tensors
from ._engine.kernels import KernelProbe as KernelProbe
from ._engine.kernels import KernelVerdict as KernelVerdict
from ._engine.kernels import cpu_name as cpu_name
from ._engine.kernels import kernel_key as kernel_key
from ._engine.kernels import load_probe as load_probe
from ._engine.kernels import probe_lock as probe_lock
from ._engine.kernels import save_probe as save_probe
from ._engine.kernels import settle_kernels as settle_kernels
from ._engine.model_files import GgufMetadata as GgufMetadata
from ._engine.model_files import expand_path as expand_path
from ._engine.model_files import file_digest as file_digest
from ._engine.model_files import read_gguf_metadata as read_gguf_metadata
from ._engine.registry import adapter_package as adapter_package
from ._types import KernelSetting as KernelSetting
from ._types import KernelTrial as KernelTrial
from ._types import KeySketch as KeySketch
from ._types import SequenceStep as SequenceStep
from ._util import physical_cores as physical_cores
from .models import resolve_model_path as resolve_model_path
