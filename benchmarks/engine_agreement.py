"""How many greedy tokens llama.cpp and OpenVINO agree on for the same prompts.

    python -m benchmarks.engine_agreement [--tokens 64]

Both engines run the embedded SmolLM2 (llama.cpp on the Q4_1 GGUF, OpenVINO on the F16 IR
built from it, deterministic f32 settings), so their weight arithmetic differs: this
reports agreement, it does not require it.
"""

from __future__ import annotations

import argparse

from kvrt import EngineConfig
from kvrt.adapters.llama import LlamaEngine
from kvrt.adapters.openvino import OpenVinoEngine

PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about a lighthouse.",
    "List three uses of a hash map.",
    "What is the capital of France?",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    llama = LlamaEngine.open(EngineConfig())
    openvino = OpenVinoEngine.open(EngineConfig(backend="openvino", kv_type="f32"))
    for question in PROMPTS:
        text = llama.apply_chat_template([("user", question)])
        prompt = llama.tokenize(text, add_special=False, parse_special=True)
        same_prompt = openvino.tokenize(text, add_special=False) == prompt
        outs = []
        for engine in (llama, openvino):
            ctx = engine.open_context(len(prompt) + args.tokens + 8)
            ctx.prefill(prompt)
            outs.append(ctx.generate(args.tokens, stop_at_end=False))
            ctx.close()
        agree = next((i for i, (a, b) in enumerate(zip(*outs, strict=True)) if a != b), args.tokens)
        print(
            f"{question!r}: same prompt tokens {same_prompt}; greedy tokens agree on the first {agree} of {args.tokens}"
        )
    llama.close()
    openvino.close()


if __name__ == "__main__":
    main()
