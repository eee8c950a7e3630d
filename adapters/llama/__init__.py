"""kvrt's llama.cpp backend."""

from ._context import LlamaEngineContext as LlamaEngineContext
from ._engine import LlamaEngine as LlamaEngine
from ._reference import REFERENCE_NAME as REFERENCE_NAME
from ._reference import reference_greedy_tps as reference_greedy_tps
from ._reference import reference_llama as reference_llama
from ._reference import reference_trace as reference_trace
from ._reference import same_settings as same_settings
from ._reference import same_weights as same_weights
