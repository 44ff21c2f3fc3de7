"""The tolerance rule of :mod:`paraxis.parallel.numerics` and the probe's reduction
length (:func:`paraxis.engine.probe.longest_reduction`), checked against the values they
are derived to give."""

import itertools
import math

import pytest

from paraxis.config.shape import ModelShape
from paraxis.engine.probe import longest_reduction
from paraxis.parallel.numerics import (
    BF16_UNIT_ROUNDOFF,
    FP32_UNIT_ROUNDOFF,
    LARGEST_REDUCTION,
    REDUCTION_RTOL,
    reduction_rtol,
)

U = FP32_UNIT_ROUNDOFF


@pytest.mark.parametrize(("n", "rtol"), [
    (151_936, 3e-5),  # Qwen's vocabulary: u·√n = 2.32e-5, rounded up to one digit
    (262_144, 4e-5),  # 2^18 (Gemma 3's vocabulary): 3.05e-5
    (1_000_000, 6e-5),  # a million-token batch: 5.96e-5
    (100_000_000, 6e-4),  # 5.96e-4
])
def test_a_long_reduction_gets_u_sqrt_n_rounded_up(n, rtol):
    bound = U * math.sqrt(n)
    assert reduction_rtol(n) == pytest.approx(rtol, rel=1e-12)
    assert bound <= reduction_rtol(n) < bound * 1.5  # up, by less than one digit's step


@pytest.mark.parametrize("n", [0, 1, 2, 1000, LARGEST_REDUCTION])
def test_short_reductions_stop_at_the_floor(n):
    """u·√n is below 1e-5 up to LARGEST_REDUCTION terms; fp32 never goes below it."""
    assert U * math.sqrt(max(n, 1)) <= REDUCTION_RTOL
    assert reduction_rtol(n) == REDUCTION_RTOL


def test_the_floor_is_the_first_value_above_it():
    # 1e-5 is u·√n at n = (1e-5 / u)^2 ≈ 28,147; one past it the rule rounds up to 2e-5.
    edge = math.floor((REDUCTION_RTOL / U) ** 2)
    assert reduction_rtol(edge) == REDUCTION_RTOL
    assert reduction_rtol(edge + 1) == pytest.approx(2e-5)


def test_the_tolerance_never_shrinks_as_the_reduction_grows():
    lengths = sorted({int(10 ** (k / 8)) for k in range(0, 8 * 9)})
    values = [reduction_rtol(n) for n in lengths]
    assert all(a <= b for a, b in itertools.pairwise(values)), values
    assert values[0] == REDUCTION_RTOL and values[-1] > 1e-4


def test_another_dtype_takes_its_own_roundoff_and_no_fp32_floor():
    assert reduction_rtol(1, BF16_UNIT_ROUNDOFF) == pytest.approx(4e-3)  # 3.9e-3 up
    assert reduction_rtol(1, 1e-9) == pytest.approx(1e-9)  # below fp32's floor


def _shape(**sizes):
    return ModelShape(**{"hidden_size": 64, "num_attention_heads": 4, "num_layers": 2,
                         "vocab_size": 256, **sizes})


def test_the_longest_reduction_is_the_largest_inner_dimension_or_token_count():
    assert longest_reduction(None, 32) == 32
    assert longest_reduction(_shape(intermediate_size=128), 32) == 256  # the vocabulary
    assert longest_reduction(_shape(intermediate_size=1024), 32) == 1024
    assert longest_reduction(_shape(), 4096) == 4096  # a weight gradient's token sum
    assert longest_reduction(_shape(vocab_size=151_936), 32) == 151_936
    assert reduction_rtol(longest_reduction(_shape(vocab_size=151_936), 32)) == \
        pytest.approx(3e-5)
