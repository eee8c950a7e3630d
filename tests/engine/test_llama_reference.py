"""kvrt's llama.cpp adapter against llama_cpp.Llama's own greedy output."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvrt import SamplingParams
from kvrt.adapters.llama import LlamaEngine
from tests.support.models import llama_cpp_greedy

PROMPTS = [
    "Write a short poem about a lighthouse in a storm.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.mark.parametrize("question", PROMPTS)
def test_greedy_equals_llama_cpp_python(engine: LlamaEngine, question: str) -> None:
    text = engine.apply_chat_template([("user", question)])
    prompt = engine.tokenize(text, parse_special=True)
    ctx = engine.open_context(512)
    ctx.prefill(prompt)
    ours = ctx.generate(48)
    ctx.close()
    theirs = llama_cpp_greedy(engine.facts.path, prompt, 48, n_ctx=512, stop_at_end=True)
    assert len(ours) >= 16
    assert ours == theirs, (engine.detokenize(ours), engine.detokenize(theirs))


def test_seeded_sampling_is_repeatable_and_top_k_1_is_greedy(engine: LlamaEngine) -> None:
    prompt = engine.tokenize(engine.apply_chat_template([("user", PROMPTS[0])]), parse_special=True)

    def run(params: SamplingParams) -> list[int]:
        ctx = engine.open_context(256)
        ctx.prefill(prompt)
        try:
            return ctx.generate(24, params, stop_at_end=False)
        finally:
            ctx.close()

    hot = SamplingParams(temperature=1.2, top_k=50, top_p=0.95, seed=7)
    assert run(hot) == run(hot)
    assert run(SamplingParams(temperature=0.8, top_k=1, seed=1)) == run(SamplingParams())
    samples = {tuple(run(SamplingParams(temperature=1.5, seed=s))) for s in range(3)}
    assert len(samples) > 1, "different seeds should explore different continuations"


AMX_PROBE = """
import kvrt
from kvrt.adapters.llama import reference_llama
from kvrt.native_bridge.llama import LlamaModel, cpu_features
from kvrt.native_bridge.llama_context import LlamaContext

path = str(kvrt.embedded_model_path())
model = LlamaModel(path)
ctx = LlamaContext(model, n_ctx=64, n_batch=32)
ctx.decode(list(range(100, 120)), 0)  # a batch of twenty tokens
ctx.close()
model.close()
llm = reference_llama(path, n_ctx=64, verbose=False)
llm.eval(list(range(100, 120)))
llm.close()
print("AMX" if "AMX_INT8" in cpu_features() else "no AMX", "ALIVE")
"""


@pytest.mark.subprocess
def test_weights_never_go_where_llama_cpp_would_crash() -> None:
    """On a CPU with AMX, llama.cpp's AMX kernels kill the process on a batch of two tokens
    or more: kvrt's models and the reference ``llama_cpp.Llama`` load their weights
    elsewhere (llama.cpp's load log names no AMX buffer) and compute batches."""
    proc = subprocess.run(
        [sys.executable, "-c", AMX_PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KVRT_NATIVE_LOG": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "ALIVE"
    assert "AMX model buffer" not in proc.stderr
    assert "model buffer size" in proc.stderr  # the load log was read
