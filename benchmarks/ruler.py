"""RULER-style long-context tasks, generated in code (plain text, no chat template).

Each task hides what the question asks for (its needles) in a body of a given size in
tokens, and closes the context with a question whose answer follows it:

- ``passkey``: one five-digit pass key in filler text (:mod:`.passkey`'s haystack);
- ``multi_key``: four look-alike needles ("One of the special magic numbers for KEY is:
  VALUE."), one asked;
- ``multi_value``: one key with three values at three depths, all asked;
- ``variable_tracking``: a value assigned to a variable, then passed on twice
  (``VAR B = VAR A.``), all three names asked;
- ``qa``: one paragraph about a person among many about others, a fact of it asked.

A prompt knows where its needles are (character spans of the body), so a benchmark can
tell whether the blocks holding them were hot when the question was answered.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import NamedTuple

from .passkey import FILLER, INTRO

__all__ = ["TASKS", "Prompt", "make_prompt", "needle_positions"]

TASKS = ("passkey", "multi_key", "multi_value", "variable_tracking", "qa")

MAGIC = (
    "Some special magic numbers are hidden within the following text. Make sure to "
    "memorize them. I will quiz you about the numbers afterwards.\n"
)
KEYS = (
    "amber-falcon", "silver-harbor", "quiet-meadow", "golden-tiger", "crimson-river",
    "hidden-candle", "frozen-lantern", "velvet-orchid", "rapid-compass", "lonely-glacier",
    "bright-anchor", "gentle-thunder", "copper-willow", "misty-canyon", "brave-pelican",
    "wooden-castle",
)  # fmt: skip
NAMES = (
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas",
    "Kira", "Luca", "Maya", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sven", "Tara", "Umar",
    "Vera", "Wes", "Xenia", "Yusuf", "Zoe", "Anton", "Bea", "Carl", "Dina", "Emil", "Fiona",
    "Gabe", "Hana", "Igor", "Jade", "Karl", "Lena", "Marco", "Nora", "Oscar", "Pia", "Rafa",
    "Sara", "Tomas", "Una", "Viktor", "Wanda", "Yara", "Zeno",
)  # fmt: skip
SURNAMES = ("Berg", "Costa", "Dahl", "Ito", "Khan", "Lund", "Moreau", "Novak", "Okafor", "Petrov")
CITIES = (
    "Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin", "Quito", "Hanoi", "Perth", "Tunis",
    "Riga", "Bern", "Accra", "Dakar", "Minsk", "Sofia", "Turin", "Porto", "Lagos", "Cusco",
)  # fmt: skip
JOBS = ("baker", "pilot", "nurse", "painter", "farmer", "teacher", "tailor", "sailor")
PETS = ("a cat", "a dog", "two parrots", "a horse", "a goat", "three fish")
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


class Prompt(NamedTuple):
    body: str
    """The long context."""
    question: str
    """What closes the context; the answer follows it."""
    gold: str
    """The answer, with its leading space (scored token by token)."""
    expected: tuple[str, ...]
    """What the greedy answer must hold, all of it, to count as right."""
    needles: tuple[tuple[int, int], ...]
    """Character spans of ``body`` holding what the question asks for."""


def _place(
    unit: str, size: int, per_unit: int, needles: Sequence[str], rng: random.Random, lead: str
) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``lead``, then filler ``unit``s to about ``size`` tokens with ``needles`` at random
    depths in their order: the body and the needles' spans."""
    n = max(len(needles), (size - 40 * len(needles) - 60) // per_unit)
    at = sorted(rng.sample(range(n + 1), len(needles)))
    parts, spans, length = [lead], [], len(lead)
    done = 0
    for needle, where in zip(needles, at, strict=True):
        parts.append(unit * (where - done))
        length += len(unit) * (where - done)
        done = where
        spans.append((length, length + len(needle)))
        parts.append(needle)
        length += len(needle)
    parts.append(unit * (n - done))
    return "".join(parts), tuple(spans)


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10**n))


def make_prompt(
    task: str, size: int, rng: random.Random, tokenize: Callable[[str], list[int]]
) -> Prompt:
    """One prompt of ``task`` whose body is about ``size`` tokens (``tokenize``: text to
    token ids, without special tokens). Its question followed by any leading part of its
    answer tokenizes as the question's tokens then the answer's (a teacher-forced
    log-prob scores the answer's own tokens): draws that do not are drawn again."""
    for _ in range(100):
        prompt = _draw(task, size, rng, tokenize)
        asked, gold = tokenize(prompt.question), tokenize(prompt.gold)
        if all(
            tokenize(prompt.question + _text(tokenize, prompt.gold, gold, k)) == asked + gold[:k]
            for k in range(1, len(gold))
        ):
            return prompt
    raise RuntimeError(f"no {task} prompt whose answer tokenizes apart from its question")


def _text(tokenize: Callable[[str], list[int]], gold: str, tokens: list[int], k: int) -> str:
    """The text of ``gold``'s first ``k`` tokens (the shortest prefix tokenizing so)."""
    for end in range(1, len(gold) + 1):
        if tokenize(gold[:end]) == tokens[:k]:
            return gold[:end]
    return "\0"  # no prefix: never equal


def _draw(task: str, size: int, rng: random.Random, tokenize: Callable[[str], list[int]]) -> Prompt:
    per_filler = len(tokenize(FILLER))
    if task == "passkey":
        key = _digits(rng, 5)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        body, spans = _place(FILLER, size, per_filler, [needle], rng, INTRO)
        return Prompt(body, "What is the pass key? The pass key is", f" {key}", (key,), spans)
    if task == "multi_key":
        keys = rng.sample(KEYS, 4)
        values = [_digits(rng, 7) for _ in keys]
        needles = [
            f"One of the special magic numbers for {k} is: {v}. "
            for k, v in zip(keys, values, strict=True)
        ]
        body, spans = _place(FILLER, size, per_filler, needles, rng, MAGIC)
        asked = rng.randrange(4)
        k = keys[asked]
        question = f"What is the special magic number for {k}? The special magic number for {k} is"
        return Prompt(body, question, f" {values[asked]}", (values[asked],), (spans[asked],))
    if task == "multi_value":
        k = rng.choice(KEYS)
        values = [_digits(rng, 7) for _ in range(3)]
        needles = [f"One of the special magic numbers for {k} is: {v}. " for v in values]
        body, spans = _place(FILLER, size, per_filler, needles, rng, MAGIC)
        question = (
            f"What are all the special magic numbers for {k}? The special magic numbers for {k} are"
        )
        return Prompt(body, question, " " + ", ".join(values), tuple(values), spans)
    if task == "variable_tracking":
        names = ["".join(rng.sample(LETTERS, 3)) for _ in range(3)]
        value = _digits(rng, 5)
        needles = [f"VAR {names[0]} = {value}. "]
        needles += [f"VAR {b} = VAR {a}. " for a, b in pairwise(names)]
        lead = "Memorize and track the chain of variable assignments hidden in the text.\n"
        body, spans = _place(FILLER, size, per_filler, needles, rng, lead)
        question = (
            f"Which variables are assigned the value {value}, directly or through another "
            f"variable? The variables assigned the value {value} are"
        )
        return Prompt(body, question, " " + ", ".join(names), tuple(names), spans)
    if task == "qa":
        everyone = [f"{first} {last}" for first in NAMES for last in SURNAMES]
        people = rng.sample(everyone, len(everyone))
        paragraphs: list[tuple[str, str]] = []
        total = 0
        while total < size - 60 and len(paragraphs) < len(people):
            paragraphs.append(_paragraph(people[len(paragraphs)], rng))
            total += len(tokenize(paragraphs[-1][0]))
        n = len(paragraphs)
        asked = rng.randrange(n)
        lead = "Read the notes about these people. I will ask you about one of them.\n"
        before = lead + "".join(text for text, _ in paragraphs[:asked])
        text, city = paragraphs[asked]
        body = before + "".join(text for text, _ in paragraphs[asked:n])
        name = people[asked]
        question = f"Which city was {name} born in? {name} was born in"
        return Prompt(
            body, question, f" {city}", (city,), ((len(before), len(before) + len(text)),)
        )
    raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")


def _paragraph(name: str, rng: random.Random) -> tuple[str, str]:
    city, job, pet = rng.choice(CITIES), rng.choice(JOBS), rng.choice(PETS)
    other = rng.choice([c for c in CITIES if c != city])
    text = (
        f"{name} was born in {city}. Later {name} moved to {other} and now works as a {job}. "
        f"{name} has {pet} and likes long walks on weekends. "
    )
    return text, city


def needle_positions(
    prompt: Prompt, tokenize_first: Callable[[str], list[int]]
) -> list[tuple[int, int]]:
    """The token positions ``[start, end)`` of each needle, the body being the context's
    first segment (``tokenize_first``: text to ids as that segment's tokens)."""
    return [
        (len(tokenize_first(prompt.body[:a])), len(tokenize_first(prompt.body[:b])))
        for a, b in prompt.needles
    ]
