"""Benchmarks outside the wheel, each printing figures measured side by side in one run,
on kvrt's public API (and the few internals the architecture test names). Run them from
the repository root:

    python benchmarks/prefix_reuse.py      # exact reuse to the token vs LlamaRAMCache
    python benchmarks/tool_loop.py         # a 10-step tool loop vs llama_cpp.server
    python benchmarks/relayout.py          # a relayout's cost next to computing the tokens
    python -m benchmarks.tiers             # the cold tiers: RAM, disk, Redis, a restart
    python -m benchmarks.flash             # flash attention off and on, vs llama_cpp.Llama
    python -m benchmarks.fidelity          # how much of a long context the model can use
    python -m benchmarks.chat              # chat: kvrt vs llama_cpp (+LlamaRAMCache, server)
    python -m benchmarks.engine_agreement  # greedy agreement, llama.cpp vs OpenVINO
"""
