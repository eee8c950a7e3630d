"""kvrt's OpenVINO backend, stateful IRs through OpenVINO's public API: the engine without
kvrt, for benchmarks (:mod:`._reference`); one compiled IR (:mod:`._engine`), built once
from a GGUF (:mod:`._prepare`); one infer request as a hot window (:mod:`._context`);
windows decoding together as rows of one request (:mod:`._rows`); and the kernel probe
(:mod:`._probe`). Dependencies run one way, in the order of :data:`LAYERS`; the
architecture test holds it."""

from ._context import OpenVinoEngineContext as OpenVinoEngineContext
from ._engine import PROFILES as PROFILES
from ._engine import OpenVinoEngine as OpenVinoEngine
from ._prepare import prepare_ir as prepare_ir
from ._reference import REFERENCE_NAME as REFERENCE_NAME
from ._reference import reference_greedy_tps as reference_greedy_tps
from ._reference import reference_trace as reference_trace

LAYERS = (
    "_reference",
    "_engine",
    "_prepare",
    "_context",
    "_rows",
    "_probe",
)
"""The modules from the top down: each imports only those after it."""
