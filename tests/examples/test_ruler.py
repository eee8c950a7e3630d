"""The fidelity benchmark's RULER-style prompts: each task hides what its question asks
for where the prompt says (and nowhere else), at about the size asked, and its answer tokenizes apart from
its question (a teacher-forced log-prob scores the answer's own tokens)."""

from __future__ import annotations

import random

import pytest

from benchmarks.ruler import TASKS, make_prompt, needle_positions
from kvrt.adapters.llama import LlamaEngine


@pytest.mark.parametrize("size", [1536, 4096])
@pytest.mark.parametrize("task", TASKS)
def test_every_task_hides_what_it_asks_where_it_says(
    engine: LlamaEngine, task: str, size: int
) -> None:
    def tokenize(text: str) -> list[int]:
        return engine.tokenize(text, add_special=False)

    rng = random.Random(3)
    for _ in range(3):
        prompt = make_prompt(task, size, rng, tokenize)
        assert 0.8 * size <= len(tokenize(prompt.body)) <= size
        needles = [prompt.body[a:b] for a, b in prompt.needles]
        assert needles and all(n for n in needles)
        for expected in prompt.expected:  # each asked thing lies in the needles only
            assert expected in prompt.gold
            inside = sum(n.count(expected) for n in needles)
            assert inside >= 1
            if task != "qa":  # a city may also be where someone else was born
                assert prompt.body.count(expected) == inside
        asked, gold = tokenize(prompt.question), tokenize(prompt.gold)
        for k in range(1, len(gold)):
            text = engine.detokenize(gold[:k])
            assert tokenize(prompt.question + text) == asked + gold[:k]
        spans = needle_positions(prompt, lambda t: engine.tokenize(t, add_special=True))
        whole = engine.tokenize(prompt.body, add_special=True)
        for (a, b), needle in zip(spans, needles, strict=True):
            assert 0 <= a < b <= len(whole)
            assert needle.strip() in engine.detokenize(whole[max(0, a - 1) : b + 1])
    with pytest.raises(ValueError, match="unknown task"):
        make_prompt("summary", size, rng, tokenize)
