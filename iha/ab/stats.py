# Copyright 2026 The iha authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The statistics of an A/B comparison on shared items (validation rows, test problems): pure functions.

- `token_loss_bootstrap`: per-token loss of each arm over the same rows, and of the difference B - A, with paired
  bootstrap percentile intervals (rows resampled together for both arms);
- `mean_bootstrap`: the same for per-item scores (a problem's correctness, its fraction of correct samples);
- `mcnemar_exact`: the exact two-sided McNemar test on paired correctness (a binomial test on the discordant pairs);
- `detectable_accuracy_difference`: the smallest accuracy difference the paired design detects at a given level and
  power, given the number of problems and the share of them on which the arms disagree;
- `seed_spread`: mean, standard deviation and range of a metric over seeds;
- `paired_over_seeds`: B - A seed by seed, with the paired t-test and the exact sign-flip permutation test;
- `detectable_difference`, `items_needed`: the power of a paired difference with a known standard error.
"""

import math
import statistics
from collections.abc import Sequence

import numpy as np

from ..paired_stats import paired_differences, sign_test


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for `b` pairs where only A is right and `c` where only B is right.

    Under the null hypothesis each discordant pair goes either way with probability 1/2, so min(b, c) is binomial
    (b + c, 1/2): the sign test of the discordant pairs (`iha.paired_stats.sign_test`). No discordant pair gives
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
    """B - A seed by seed (the arms of one seed share data, order and steps): `iha.paired_stats.paired_differences`
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
    "detectable_accuracy_difference",
    "detectable_difference",
    "discordant_counts",
    "items_needed",
    "mcnemar_exact",
    "mean_bootstrap",
    "minimum_discordant_pairs",
    "paired_over_seeds",
    "seed_spread",
    "token_loss_bootstrap",
]
