"""kvrt's OpenVINO backend: stateful IRs through OpenVINO's public API."""

from ._context import OpenVinoEngineContext as OpenVinoEngineContext
from ._engine import PROFILES as PROFILES
from ._engine import OpenVinoEngine as OpenVinoEngine
from ._prepare import prepare_ir as prepare_ir
from ._reference import REFERENCE_NAME as REFERENCE_NAME
from ._reference import reference_greedy_tps as reference_greedy_tps
from ._reference import reference_trace as reference_trace
