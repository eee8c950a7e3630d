"""Tools for testing with kvrt: tiny models of the architectures users bring.

:mod:`.sized` writes a llama of a realistic size (1B parameters) for benchmarks, from the
writer of :mod:`.zoo`, which writes random-weight GGUFs of llama.cpp's architectures
(Llama 3, Qwen, Phi-3, Gemma, hybrids) at a toy size, so a test suite can prove on each of
them in milliseconds what the real models take seconds for: their tensors are
:mod:`.weights`', each architecture a :mod:`.variant`. The core never imports this
package. Dependencies run one way, in the order of :data:`LAYERS`.
"""

from . import sized as sized
from . import zoo as zoo

__all__ = ["sized", "zoo"]

LAYERS = (
    "sized",
    "zoo",
    "weights",
    "variant",
)
"""The modules from the top down: each imports only those after it."""
