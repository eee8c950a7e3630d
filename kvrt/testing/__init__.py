"""Tools for testing with kvrt: tiny models of the architectures users bring.

:mod:`kvrt.testing.zoo` writes random-weight GGUFs of llama.cpp's architectures (Llama 3,
Qwen, Phi-3, Gemma, hybrids) at a toy size, so a test suite can prove on each of them in
milliseconds what the real models take seconds for; :mod:`kvrt.testing.sized` writes a
llama of a realistic size (1B parameters) for benchmarks. The core never imports this
package.
"""

from . import sized as sized
from . import zoo as zoo

__all__ = ["sized", "zoo"]
