"""The token sampler on synthetic logits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvrt import ArgumentTypeError, InvalidArgumentError, Sampler, SamplingParams

logits_st = arrays(np.float32, st.integers(2, 64), elements=st.floats(-20, 20, width=32))


@given(logits_st)
def test_greedy_is_argmax(logits: np.ndarray) -> None:
    assert Sampler(SamplingParams()).choose(logits) == int(np.argmax(logits))


@given(logits_st, st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_top_k_only_picks_among_the_k_best(logits: np.ndarray, k: int, seed: int) -> None:
    token = Sampler(SamplingParams(temperature=1.0, top_k=k, seed=seed)).choose(logits)
    assert logits[token] >= np.sort(logits)[::-1][min(k, logits.size) - 1]


def test_top_p_keeps_the_nucleus() -> None:
    logits = np.array([10.0, 9.9, -10.0, -10.0], dtype=np.float32)
    picks = {
        Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=s)).choose(logits)
        for s in range(50)
    }
    assert picks == {0, 1}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"temperature": -1.0},
            r"sampling\.temperature must be a finite number >= 0\.0, got -1\.0",
        ),
        ({"temperature": float("inf")}, "sampling.temperature must be a finite number"),
        ({"top_p": 0.0}, r"sampling\.top_p must be a finite number in \(0\.0, 1\.0\], got 0\.0"),
        ({"top_p": float("nan")}, "sampling.top_p must be a finite number"),
        ({"top_k": -2}, r"sampling\.top_k must be in \[0, 2147483647\], got -2"),
        ({"seed": -1}, r"sampling\.seed must be in \[0, 9223372036854775807\], got -1"),
        (
            {"top_k": 2**64},
            r"sampling\.top_k must be in \[0, 2147483647\], got 18446744073709551616",
        ),
        (
            {"seed": 2**63},
            r"sampling\.seed must be in \[0, 9223372036854775807\], got 9223372036854775808",
        ),
    ],
)
def test_bad_params(fields: dict[str, float], message: str) -> None:
    """Refused where they enter: building the params, never later in a session."""
    with pytest.raises(InvalidArgumentError, match=message):
        SamplingParams(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields", [{"temperature": "0.5"}, {"seed": "x"}, {"top_k": 1.5}, {"top_p": True}]
)
def test_bad_param_types(fields: dict[str, object]) -> None:
    with pytest.raises(ArgumentTypeError, match=f"sampling.{next(iter(fields))} must be"):
        SamplingParams(**fields)  # type: ignore[arg-type]


@given(logits_st, st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.7]))
def test_logit_bias_bans_and_forces_tokens(logits: np.ndarray, seed: int, t: float) -> None:
    """Logits lie in [-20, 20]: a bias of -100 puts a token below every other, +100 above."""
    best = int(np.argmax(logits))
    banned = Sampler(SamplingParams(temperature=t, seed=seed, logit_bias={best: -100.0}))
    assert banned.choose(logits) != best
    other = (best + 1) % logits.size
    forced = Sampler(SamplingParams(temperature=t, seed=seed, logit_bias={other: 100.0}))
    assert forced.choose(logits) == other
    assert logits[best] == np.max(logits)  # the caller's logits are left as they were


def test_logit_bias_is_checked() -> None:
    for bias, says in (
        ({0: 101.0}, "-100"),
        ({-1: 1.0}, "token id"),
        ({0: float("nan")}, "finite"),
    ):
        with pytest.raises((InvalidArgumentError, ArgumentTypeError), match=says):
            SamplingParams(logit_bias=bias)
    with pytest.raises(InvalidArgumentError, match="at most 1,024"):
        SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0))
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        Sampler(SamplingParams(logit_bias={64: 1.0}), n_vocab=64)


@given(logits_st, st.sampled_from([2.2e-309, 1e-300, 5e-324]))
def test_a_vanishing_temperature_is_greedy(logits: np.ndarray, t: float) -> None:
    """A subnormal temperature overflowed the scaled logits into NaN probabilities."""
    token = Sampler(SamplingParams(temperature=t, seed=1)).choose(logits)
    assert logits[token] == np.max(logits)  # one of the likeliest (ties are drawn)
