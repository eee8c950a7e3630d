"""``python -m llama_cpp.server`` with its weights in the buffers kvrt loads them into
(:func:`kvrt.adapters.llama.same_weights`), so it runs where kvrt runs:

    python -m benchmarks._llama_server --model PATH [llama_cpp.server arguments]
"""

from __future__ import annotations

import runpy

from kvrt.adapters.llama import same_weights

if __name__ == "__main__":
    with same_weights():
        runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
