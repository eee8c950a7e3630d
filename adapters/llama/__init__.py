"""kvrt's llama.cpp backend."""

from ._context import LlamaEngineContext as LlamaEngineContext
from ._engine import LlamaEngine as LlamaEngine
