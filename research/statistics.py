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

For an A/B comparison on shared items (validation rows, test problems):
- `token_loss_bootstrap`: per-token loss of each arm over the same rows, and of the difference B - A, with paired
  bootstrap percentile intervals (rows resampled together for both arms);
- `mean_bootstrap`: the same for per-item scores (a problem's correctness, its fraction of correct samples);
- `mcnemar_exact`: the exact two-sided McNemar test on paired correctness (a binomial test on the discordant pairs);
- `detectable_accuracy_difference`: the smallest accuracy difference the paired design detects at a given level and
  power, given the number of problems and the share of them on which the arms disagree;
- `seed_spread`: mean, standard deviation and range of a metric over seeds;
- `paired_over_seeds`: B - A seed by seed, with the paired t-test and the exact sign-flip permutation test;
- `detectable_difference`, `items_needed`: the power of a paired difference with a known standard error;
- `holm_adjusted`: Holm's step-down correction of a family of p-values (a table of several tests).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence

import numpy as np


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


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in the order given.

    The i-th smallest of m p-values is multiplied by m - i + 1 (i from 1), capped at 1, and never allowed below the
    adjusted value of the one before it; rejecting where the adjusted p is below alpha keeps the chance of any false
    rejection in the family at most alpha, whatever the tests' dependence.
    """
    count = len(p_values)
    adjusted = [1.0] * count
    largest_so_far = 0.0
    for rank, index in enumerate(sorted(range(count), key=lambda position: p_values[position])):
        largest_so_far = max(largest_so_far, min(1.0, (count - rank) * p_values[index]))
        adjusted[index] = largest_so_far
    return adjusted


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for `b` pairs where only A is right and `c` where only B is right.

    Under the null hypothesis each discordant pair goes either way with probability 1/2, so min(b, c) is binomial
    (b + c, 1/2): the sign test of the discordant pairs (`sign_test`). No discordant pair gives
    p = 1.
    """
    if b < 0 or c < 0:
        raise ValueError(f"Discordant counts must be >= 0, got b={b}, c={c}.")
    return sign_test(b, c)


def discordant_counts(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> tuple[int, int]:
    """(b, c): the number of items only A got right and the number only B got right."""
    if len(correct_a) != len(correct_b):
        raise ValueError(f"Paired results need the same items: {len(correct_a)} vs {len(correct_b)}.")
    b = sum(1 for x, y in zip(correct_a, correct_b) if x and not y)
    c = sum(1 for x, y in zip(correct_a, correct_b) if y and not x)
    return b, c


def _percentile_interval(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def token_loss_bootstrap(
    nll_a: Sequence[float],
    nll_b: Sequence[float],
    tokens: Sequence[int],
    num_resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Per-token loss of arms A and B on the same rows, and of B - A, with paired bootstrap intervals.

    `nll_a[i]` / `nll_b[i]`: the summed negative log-likelihood of row i's loss tokens under each arm; `tokens[i]`:
    how many loss tokens row i has (the same for both arms: same rows, same tokenizer). The per-token loss of a set
    of rows is sum(nll) / sum(tokens); a resample draws rows with replacement and uses the same rows for both arms.
    The half-width of the difference's interval is what this validation set can resolve.
    """
    nll_a, nll_b, tokens = (np.asarray(x, dtype=np.float64) for x in (nll_a, nll_b, tokens))
    if not (len(nll_a) == len(nll_b) == len(tokens)) or len(tokens) == 0:
        raise ValueError("Paired losses need the same, non-empty set of rows for both arms.")
    if (tokens <= 0).any():
        raise ValueError("Every row needs at least one loss token.")
    generator = np.random.default_rng(seed)
    picks = generator.integers(0, len(tokens), size=(num_resamples, len(tokens)))
    resampled_tokens = tokens[picks].sum(axis=1)
    loss_a = nll_a[picks].sum(axis=1) / resampled_tokens
    loss_b = nll_b[picks].sum(axis=1) / resampled_tokens
    point_a, point_b = nll_a.sum() / tokens.sum(), nll_b.sum() / tokens.sum()
    difference = loss_b - loss_a
    low, high = _percentile_interval(difference, confidence)
    return {
        "a": {"estimate": float(point_a), "ci": _percentile_interval(loss_a, confidence)},
        "b": {"estimate": float(point_b), "ci": _percentile_interval(loss_b, confidence)},
        "difference": {
            "estimate": float(point_b - point_a),
            "ci": (low, high),
            "half_width": (high - low) / 2,
            "standard_error": float(difference.std(ddof=1)),
        },
        "num_rows": len(tokens),
        "num_tokens": int(tokens.sum()),
        "confidence": confidence,
        "num_resamples": num_resamples,
    }


def mean_bootstrap(
    scores_a: Sequence[float],
    scores_b: Sequence[float],
    num_resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Mean per-item score of arms A and B on the same items, and of B - A, with paired bootstrap intervals."""
    scores_a, scores_b = np.asarray(scores_a, dtype=np.float64), np.asarray(scores_b, dtype=np.float64)
    if len(scores_a) != len(scores_b) or len(scores_a) == 0:
        raise ValueError("Paired scores need the same, non-empty set of items for both arms.")
    generator = np.random.default_rng(seed)
    picks = generator.integers(0, len(scores_a), size=(num_resamples, len(scores_a)))
    mean_a, mean_b = scores_a[picks].mean(axis=1), scores_b[picks].mean(axis=1)
    low, high = _percentile_interval(mean_b - mean_a, confidence)
    return {
        "a": {"estimate": float(scores_a.mean()), "ci": _percentile_interval(mean_a, confidence)},
        "b": {"estimate": float(scores_b.mean()), "ci": _percentile_interval(mean_b, confidence)},
        "difference": {
            "estimate": float(scores_b.mean() - scores_a.mean()),
            "ci": (low, high),
            "half_width": (high - low) / 2,
            "standard_error": float((mean_b - mean_a).std(ddof=1)),
        },
        "num_items": len(scores_a),
        "confidence": confidence,
        "num_resamples": num_resamples,
    }


def detectable_accuracy_difference(
    num_items: int, discordant_share: float, alpha: float = 0.05, power: float = 0.8
) -> float | None:
    """The smallest accuracy difference |p_B - p_A| that a two-sided paired test on `num_items` problems detects
    with probability `power` at level `alpha`, when the arms disagree on a share `discordant_share` of the problems.

    It solves the normal-approximation sample size of McNemar's test (Connor, 1987) for the difference d:
    n = (z_{1-alpha/2} sqrt(psi) + z_{power} sqrt(psi - d^2))^2 / d^2, with psi the discordant share. Returns None
    when psi is 0 (no disagreement observed: nothing to scale the test by). Exact tests need more: see
    `minimum_discordant_pairs`.
    """
    if num_items < 1:
        raise ValueError(f"`num_items` must be >= 1, got {num_items}.")
    if not 0 <= discordant_share <= 1:
        raise ValueError(f"`discordant_share` must be in [0, 1], got {discordant_share}.")
    if discordant_share == 0:
        return None
    z_alpha = statistics.NormalDist().inv_cdf(1 - alpha / 2)
    z_power = statistics.NormalDist().inv_cdf(power)
    psi = discordant_share

    def needed_items(d: float) -> float:
        return (z_alpha * math.sqrt(psi) + z_power * math.sqrt(max(psi - d * d, 0.0))) ** 2 / (d * d)

    # needed_items falls as d grows; the largest possible difference is psi (every discordant pair one way).
    if needed_items(psi) > num_items:
        return psi
    low, high = 1e-9, psi
    for _ in range(200):
        middle = (low + high) / 2
        if needed_items(middle) > num_items:
            low = middle
        else:
            high = middle
    return high


def minimum_discordant_pairs(alpha: float = 0.05) -> int:
    """The fewest discordant pairs with which the exact two-sided McNemar test can reach p < alpha (all one way)."""
    n = 1
    while mcnemar_exact(n, 0) >= alpha:
        n += 1
    return n


def seed_spread(values: Sequence[float]) -> dict:
    """Mean, sample standard deviation (0 for one seed) and range (max - min) of a metric over seeds."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("No values.")
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "range": max(values) - min(values),
        "values": values,
    }


def paired_over_seeds(values_a: Sequence[float], values_b: Sequence[float], seeds: Sequence[int]) -> dict:
    """B - A seed by seed (the arms of one seed share data, order and steps): `research.statistics.paired_differences`
    plus `interval_excludes_zero` (None with one seed: no spread to compare the difference with)."""
    paired = paired_differences(values_a, values_b, labels=list(seeds))
    ci = paired["ci"]
    paired["interval_excludes_zero"] = None if ci is None else bool(ci[0] > 0 or ci[1] < 0)
    return paired


def detectable_difference(standard_error: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest difference a two-sided z-test at level `alpha` detects with probability `power`, given the
    standard error of the difference: (z_{1-alpha/2} + z_power) * SE."""
    normal = statistics.NormalDist()
    return (normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)) * standard_error


def items_needed(standard_error: float, num_items: int, target: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """How many items (problems, rows) make `target` the detectable difference, when `num_items` of them gave
    `standard_error` (which falls as 1 / sqrt(items))."""
    if target <= 0:
        raise ValueError(f"`target` must be > 0, got {target}.")
    return math.ceil(num_items * (detectable_difference(standard_error, alpha, power) / target) ** 2)


__all__ = [
    "describe_paired",
    "detectable_accuracy_difference",
    "detectable_difference",
    "discordant_counts",
    "holm_adjusted",
    "items_needed",
    "mcnemar_exact",
    "mean_bootstrap",
    "minimum_discordant_pairs",
    "paired_differences",
    "paired_over_seeds",
    "regularized_incomplete_beta",
    "seed_spread",
    "sign_flip_p_value",
    "sign_test",
    "student_t_cdf",
    "student_t_quantile",
    "token_loss_bootstrap",
]
