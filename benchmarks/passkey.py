"""Passkey prompts, generated in code, and how a session answers them.

A five-digit key hidden in filler text at a depth, the question at the end; plain text,
no chat template. :func:`ask` returns whether the greedy answer holds the key, the
teacher-forced log-prob of the gold answer (its tokens appended to the question one at a
time, so the query a relevance policy scores against stays the question and what the
model has answered so far) and the first answer token's argmax.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import TypedDict

import numpy as np

from kvrt import Engine, Segment, Session

__all__ = [
    "FILLER",
    "INTRO",
    "QUESTIONS",
    "Answer",
    "Summary",
    "ask",
    "check_answer_tokens",
    "haystack",
    "log_softmax",
    "per_filler",
    "summarize",
]

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there. "
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTIONS: dict[str, str] = {
    "passkey": "What is the pass key? The pass key is",
    "paraphrase": "What number did I ask you to memorize? The number is",
}
"""Task name -> the question closing the context."""


Answer = tuple[bool, float, int]
"""Whether the greedy answer holds the key, the gold log-prob, the first answer argmax."""


class Summary(TypedDict):
    exact_match: float
    gold_logprob: float
    top1_agreement: float


def summarize(answers: Sequence[Answer], full: Sequence[Answer]) -> Summary:
    """Means over keys; top-1 agreement with ``full``'s answers to the same prompts."""
    return Summary(
        exact_match=statistics.fmean(ok for ok, _, _ in answers),
        gold_logprob=statistics.fmean(lp for _, lp, _ in answers),
        top1_agreement=statistics.fmean(
            a == f for (_, _, a), (_, _, f) in zip(answers, full, strict=True)
        ),
    )


def haystack(key: str, n_filler: int, depth: float) -> str:
    at = round(n_filler * depth)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return INTRO + FILLER * at + needle + FILLER * (n_filler - at)


def per_filler(engine: Engine) -> int:
    """Tokens of one filler sentence group."""
    return len(engine.tokenize(FILLER, add_special=False))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = float(np.max(logits))
    return logits - (top + math.log(float(np.sum(np.exp(logits - top)))))


async def ask(
    session: Session,
    body: list[Segment],
    question: str,
    gold: Sequence[int],
    text: Callable[[list[int]], str],
) -> Answer:
    """Greedy answer contains the key, teacher-forced log-prob of ``gold``, first argmax."""
    await session.ensure_context([*body, Segment("q", question)])
    first = np.asarray(await session.next_logits(), dtype=np.float64)
    argmax = int(np.argmax(first))
    answer = (await session.generate(max_tokens=len(gold) + 1)).text
    logprob = 0.0
    for k, token in enumerate(gold):
        if k:
            answered = Segment("q", question + text(list(gold[:k])))
            await session.ensure_context([*body, answered])
        logits = first if k == 0 else np.asarray(await session.next_logits(), dtype=np.float64)
        logprob += float(log_softmax(logits)[token])
    key = text(list(gold)).strip()
    return key in answer, logprob, argmax


def check_answer_tokens(
    tokenize: Callable[..., list[int]],
    question: str,
    gold: Sequence[int],
    text: Callable[[list[int]], str],
) -> None:
    """The question with part of the answer appended must tokenize as the question's tokens
    followed by the answer's, or the teacher-forced log-prob would score other tokens."""
    asked = tokenize(question, add_special=False)
    for k in range(1, len(gold)):
        got = tokenize(question + text(list(gold[:k])), add_special=False)
        if got != asked + list(gold[:k]):
            raise RuntimeError(
                f"{question!r} followed by the answer's first {k} tokens tokenizes differently"
            )
