"""Park a token range of a llama.cpp KV cache as cold bytes, then bring it back exactly.

    python examples/evict_and_restore.py

Runs on the embedded SmolLM2-135M-Instruct; no download.
"""

from __future__ import annotations

import time

import numpy as np

from kvrt import AdmitMode, EngineConfig, EvictMode
from kvrt.adapters.llama import LlamaEngine

DOC = (
    "Project notes. The parser reads the config file, the planner splits the context into a "
    "hot window and a cold store, and the runtime restores evicted blocks when they are sent "
    "again. "
) * 4


def main() -> None:
    engine = LlamaEngine.open(EngineConfig())
    ctx = engine.open_context(1024)
    question = engine.tokenize(" Question: what does the planner do? Answer:", add_special=False)
    doc = engine.tokenize(DOC)

    ctx.prefill(doc)
    reference = ctx.prefill(question)
    ctx.evict(len(doc), len(doc) + len(question))

    start, end = 8, len(doc) - 8
    block = ctx.export(start, end)
    ctx.evict(start, end, EvictMode.GAP)
    print(f"parked {block.meta.n_tokens} tokens as {block.meta.n_bytes / 1e6:.2f} MB of KV bytes")
    evicted = ctx.prefill(question)
    ctx.evict(len(doc), len(doc) + len(question))

    t = time.perf_counter()
    ctx.admit(block, AdmitMode.IN_PLACE)
    ms = (time.perf_counter() - t) * 1e3
    restored = ctx.prefill(question)
    print(f"restored in {ms:.2f} ms; prefilled tokens so far: {ctx.counters.prefill_tokens}")
    print(f"logits while evicted equal the reference: {np.array_equal(evicted, reference)}")
    print(
        f"logits after restore equal the reference bit for bit: {np.array_equal(restored, reference)}"
    )
    answer = ctx.generate(24)
    print("answer:", engine.detokenize(answer).strip())
    ctx.close()
    engine.close()


if __name__ == "__main__":
    main()
