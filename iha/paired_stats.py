"""Paired comparisons: B - A over items measured under both conditions (seeds that share data, order and initial
weights; problems answered by both arms), with pure-Python statistics (no scipy).

- `paired_differences`: the per-pair differences' mean, standard deviation, Student-t interval, paired t-test and
  the exact sign-flip permutation test (every one of the 2^n assignments of signs, up to `EXACT_LIMIT` pairs; a
  seeded Monte Carlo sample of them beyond), and the sign test;
- `sign_test`: the exact two-sided binomial test of how many differences are positive against negative (McNemar's
  test on discordant pairs is the same test);
- `student_t_cdf`, `student_t_quantile`: the t distribution through the regularized incomplete beta function.

With n pairs the permutation test cannot give a two-sided p below 2 / 2^n (0.25 for 3 seeds, 0.0625 for 5): the
reports say so rather than leave a large p-value to be read as evidence of no difference.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence


EXACT_LIMIT = 16  # sign-flip permutations enumerated exactly up to 2^16 assignments
MONTE_CARLO_SAMPLES = 100_000


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), converging for x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 400):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}.")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _incomplete_beta_fraction(a, b, x) / a
    # The symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast range.
    return 1.0 - math.exp(log_front) * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"Degrees of freedom must be > 0, got {df}.")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_incomplete_beta(df / 2, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def student_t_quantile(probability: float, df: float) -> float:
    """The t with P(T <= t) = `probability` (bisection on the cdf)."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {probability}.")
    if probability < 0.5:
        return -student_t_quantile(1.0 - probability, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < probability:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2
        if student_t_cdf(middle, df) < probability:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def sign_test(positive: int, negative: int) -> float:
    """Two-sided exact binomial test that positive and negative differences are equally likely (ties dropped
    before): min(positive, negative) is binomial(positive + negative, 1/2) under the null; its lower tail doubled,
    capped at 1. No untied pair gives p = 1."""
    if positive < 0 or negative < 0:
        raise ValueError(f"Counts must be >= 0, got {positive} and {negative}.")
    n = positive + negative
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(positive, negative) + 1))
    return min(1.0, 2 * tail / 2**n)


def sign_flip_p_value(differences: Sequence[float], seed: int = 0) -> tuple[float, bool]:
    """Two-sided permutation p-value of the mean difference: under the null each difference is as likely to have
    the other sign, so the p-value is the share of sign assignments whose |sum| reaches the observed one. Returns
    (p, exact): every assignment for up to `EXACT_LIMIT` pairs, a seeded Monte Carlo sample beyond."""
    values = [float(value) for value in differences]
    observed = abs(sum(values))
    tolerance = 1e-12 * max(1.0, sum(abs(value) for value in values))
    if len(values) <= EXACT_LIMIT:
        signs = itertools.product((1.0, -1.0), repeat=len(values))
        hits = sum(abs(sum(s * v for s, v in zip(sign, values))) >= observed - tolerance for sign in signs)
        return hits / 2 ** len(values), True
    generator = random.Random(seed)
    hits = 1  # the observed assignment, so that the estimate is never 0
    for _ in range(MONTE_CARLO_SAMPLES):
        flipped = sum(value if generator.random() < 0.5 else -value for value in values)
        hits += abs(flipped) >= observed - tolerance
    return hits / (MONTE_CARLO_SAMPLES + 1), False


def paired_differences(
    values_a: Sequence[float], values_b: Sequence[float], confidence: float = 0.95, labels: Sequence | None = None
) -> dict:
    """B - A pair by pair: the differences, their mean, standard deviation, Student-t interval of the mean, the
    paired t-test, the sign-flip permutation test and the sign test (all two-sided).

    One pair gives the difference only (no spread to test against): interval and p-values are None.
    """
    if len(values_a) != len(values_b) or not values_a:
        raise ValueError(f"Paired values need the same, non-empty set of pairs: {len(values_a)} vs {len(values_b)}.")
    differences = [float(b) - float(a) for a, b in zip(values_a, values_b)]
    n = len(differences)
    mean = statistics.fmean(differences)
    result = {
        "n": n,
        "differences": differences,
        "labels": list(labels) if labels is not None else None,
        "mean": mean,
        "std": None,
        "standard_error": None,
        "confidence": confidence,
        "ci": None,
        "t": None,
        "t_p_value": None,
        "permutation_p_value": None,
        "permutation_exact": None,
        "smallest_permutation_p_value": 2 / 2**n if n <= EXACT_LIMIT else None,
        "positive": sum(d > 0 for d in differences),
        "negative": sum(d < 0 for d in differences),
        "sign_test_p_value": None,
    }
    result["sign_test_p_value"] = sign_test(result["positive"], result["negative"])
    if n < 2:
        return result
    std = statistics.stdev(differences)
    standard_error = std / math.sqrt(n)
    half_width = student_t_quantile(0.5 + confidence / 2, n - 1) * standard_error
    result.update(std=std, standard_error=standard_error, ci=[mean - half_width, mean + half_width])
    if standard_error > 0:
        t = mean / standard_error
        result.update(t=t, t_p_value=2 * (1 - student_t_cdf(abs(t), n - 1)))
    else:  # every difference the same: zero gives no evidence, any other value is as certain as it gets
        result.update(t_p_value=1.0 if mean == 0 else 0.0)
    p_value, exact = sign_flip_p_value(differences)
    result.update(permutation_p_value=p_value, permutation_exact=exact)
    return result


def describe_paired(result: dict, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """One line: mean [interval], paired t p, permutation p (with the smallest it can reach), n."""
    mean = f"{scale * result['mean']:+.{digits}f}{unit}"
    if result["ci"] is None:
        return f"{mean} (one pair: no test)"
    low, high = (scale * bound for bound in result["ci"])
    floor = result["smallest_permutation_p_value"]
    floor_text = f", smallest possible {floor:.3g}" if floor is not None else ""
    kind = "exact" if result["permutation_exact"] else "Monte Carlo"
    return (
        f"{mean} [{low:+.{digits}f}, {high:+.{digits}f}]{unit} ({100 * result['confidence']:.0f}% t interval), "
        f"paired t p = {result['t_p_value']:.3g}, sign-flip permutation p = {result['permutation_p_value']:.3g} "
        f"({kind}{floor_text}), {result['positive']} of {result['n']} pairs positive"
    )


__all__ = [
    "describe_paired",
    "paired_differences",
    "regularized_incomplete_beta",
    "sign_flip_p_value",
    "sign_test",
    "student_t_cdf",
    "student_t_quantile",
]
