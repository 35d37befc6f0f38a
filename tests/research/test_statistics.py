"""The paired statistics of the experiment reports (`research.statistics`) against values computed by hand or in
closed form (no scipy in the environment: the t distribution with 1 and 2 degrees of freedom has elementary cdfs)."""

import math

import pytest

from research.statistics import (
    EXACT_LIMIT,
    holm_adjusted,
    paired_differences,
    regularized_incomplete_beta,
    sign_flip_p_value,
    sign_test,
    student_t_cdf,
    student_t_quantile,
)


def test_incomplete_beta_matches_its_closed_forms():
    for x in (0.01, 0.3, 0.5, 0.77, 0.999):
        assert regularized_incomplete_beta(1, 1, x) == pytest.approx(x, abs=1e-14)
        assert regularized_incomplete_beta(3.5, 1, x) == pytest.approx(x**3.5, rel=1e-12)
        assert regularized_incomplete_beta(1, 2.5, x) == pytest.approx(1 - (1 - x) ** 2.5, rel=1e-12)
        # I_x(2, 2) = 3x^2 - 2x^3
        assert regularized_incomplete_beta(2, 2, x) == pytest.approx(3 * x**2 - 2 * x**3, rel=1e-12)


@pytest.mark.parametrize("t", [-7.0, -1.3, 0.0, 0.4, 2.5, 30.0])
def test_student_t_cdf_matches_cauchy_and_two_degrees_of_freedom(t):
    assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)
    assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)


def test_student_t_quantiles_match_the_tables():
    # Two-sided 95% critical values (any statistics table); df = 1 and 2 also in closed form.
    assert student_t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-10)
    assert student_t_quantile(0.975, 2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), rel=1e-10)
    for df, value in ((4, 2.776445105), (9, 2.262157163), (29, 2.045229642)):
        assert student_t_quantile(0.975, df) == pytest.approx(value, rel=1e-8)
    assert student_t_quantile(0.025, 4) == pytest.approx(-2.776445105, rel=1e-8)
    # Many degrees of freedom: the normal's 1.959964 plus the first Cornish-Fisher term (z^3 + z) / (4 df).
    z = 1.959963985
    assert student_t_quantile(0.975, 10_000) == pytest.approx(z + (z**3 + z) / 40_000, rel=1e-7)


def test_paired_differences_by_hand():
    # Differences 0.5, 0.9, 0.4: mean 0.6, sd sqrt(0.07) = 0.26458, se 0.15275, t = 3.9279 on 2 df.
    result = paired_differences([1.0, 2.0, 3.0], [1.5, 2.9, 3.4], labels=[0, 1, 2])
    assert result["differences"] == pytest.approx([0.5, 0.9, 0.4])
    assert result["mean"] == pytest.approx(0.6) and result["std"] == pytest.approx(math.sqrt(0.07))
    t = 0.6 / (math.sqrt(0.07) / math.sqrt(3))
    assert result["t"] == pytest.approx(t)
    assert result["t_p_value"] == pytest.approx(1 - t / math.sqrt(2 + t * t))  # two-sided, df = 2, closed form
    half_width = 4.302652730 * math.sqrt(0.07) / math.sqrt(3)
    assert result["ci"] == pytest.approx([0.6 - half_width, 0.6 + half_width], rel=1e-8)
    # Three positive differences: 2 of the 8 sign assignments reach |sum| 1.8, the floor with 3 pairs.
    assert result["permutation_p_value"] == result["smallest_permutation_p_value"] == 0.25
    assert result["permutation_exact"] and result["positive"] == 3 and result["sign_test_p_value"] == 0.25
    assert result["labels"] == [0, 1, 2]


def test_sign_flip_permutation_p_value_by_enumeration_by_hand():
    # |+-1 +-2 +-3 +-4| >= 6 exactly when the flipped set sums to <= 2 or >= 8: {}, {1}, {2}, {1,3,4}, {2,3,4},
    # {1,2,3,4}: 6 of 16.
    assert sign_flip_p_value([1, -2, 3, 4]) == (6 / 16, True)
    assert sign_flip_p_value([0.0, 0.0]) == (1.0, True)
    # Beyond the exact limit a seeded Monte Carlo estimate, near the exact tail of all-equal differences.
    p_value, exact = sign_flip_p_value([1.0] * (EXACT_LIMIT + 1))
    assert not exact and p_value < 1e-3


def test_sign_test_and_edge_cases():
    assert sign_test(0, 5) == 2 / 32 and sign_test(9, 1) == 2 * 11 / 1024 and sign_test(0, 0) == 1.0
    one = paired_differences([1.0], [2.0])
    assert one["mean"] == 1.0 and one["ci"] is None and one["t_p_value"] is None
    constant = paired_differences([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])
    assert constant["std"] == 0 and constant["t_p_value"] == 0.0 and constant["permutation_p_value"] == 0.25
    assert paired_differences([1.0, 2.0], [1.0, 2.0])["t_p_value"] == 1.0
    with pytest.raises(ValueError, match="same, non-empty"):
        paired_differences([1.0, 2.0], [1.0])


def test_holm_steps_down_keeps_the_input_order_and_never_decreases():
    # By hand: sorted 0.01, 0.03, 0.04, 0.5 times 4, 3, 2, 1 = 0.04, 0.09, 0.08 -> 0.09 (not below the one before), 0.5.
    assert holm_adjusted([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert holm_adjusted([0.3, 0.2]) == pytest.approx([0.4, 0.4])
    assert holm_adjusted([0.9, 0.8, 0.6]) == [1.0, 1.0, 1.0]  # capped at 1
    assert holm_adjusted([0.029]) == [0.029]  # a family of one is not corrected
    assert holm_adjusted([]) == []
    # The cpu preset's smallest of 20 paired tests: Holm multiplies it by 20.
    assert holm_adjusted([0.029] + [0.5] * 19)[0] == pytest.approx(0.58)
