"""The A/B's figures (report.json): per-arm metrics over seeds, the paired tests (bootstrap over rows or problems,
exact McNemar, seed by seed) and the power of the run, from the runs' result files (`summarize`)."""

import statistics

from .. import statistics as stats
from .config import ARM_A, ARM_B


ALPHA = 0.05
POWER = 0.8
TARGET_DIFFERENCE = 0.0005  # nats per token: what the cpu preset is sized to detect on the reference loss
MIXING_NAMES = ("alpha_q", "alpha_k", "alpha_v", "collapse")


def same_data(trace_a: list[dict], trace_b: list[dict]) -> bool:
    """Whether two runs trained on the same tokens in the same order (equal step traces)."""
    return bool(trace_a) and trace_a == trace_b


def _mean_over_seeds(per_seed: list[list[float]]) -> list[float]:
    return [statistics.fmean(values) for values in zip(*per_seed)]


def compare_per_problem(evals_a: list[dict], evals_b: list[dict], config) -> dict:
    """The paired comparison of one benchmark's answers (one eval per seed and arm, seeds paired in order)."""
    num_problems = evals_a[0]["num_problems"]
    num_samples = evals_a[0]["sampling"]["num_samples"]
    result = {"num_problems": num_problems, "num_samples": num_samples, "metrics": {}}
    metric_names = ["pass@1", f"maj@{num_samples}"] if num_samples > 1 else ["pass@1"]
    for metric in [*metric_names, "finish_rate", "no_answer_rate"]:
        values_a, values_b = [e["metrics"][metric] for e in evals_a], [e["metrics"][metric] for e in evals_b]
        result["metrics"][metric] = {
            "a": stats.seed_spread(values_a),
            "b": stats.seed_spread(values_b),
            "paired_over_seeds": stats.paired_over_seeds(values_a, values_b, config.seeds[: len(values_a)]),
        }
    # Binary per-problem outcomes: greedy correctness (pass@1 with one sample) or the majority vote's correctness.
    binary_metric = "pass@1" if num_samples == 1 else f"maj@{num_samples}"
    key = "correct_fraction" if num_samples == 1 else "majority_correct"
    per_seed_tests = []
    for eval_a, eval_b in zip(evals_a, evals_b):
        correct_a = [bool(p[key]) for p in eval_a["problems"]]
        correct_b = [bool(p[key]) for p in eval_b["problems"]]
        b, c = stats.discordant_counts(correct_a, correct_b)
        per_seed_tests.append({"only_a": b, "only_b": c, "p_value": stats.mcnemar_exact(b, c)})
    discordant_share = statistics.fmean((t["only_a"] + t["only_b"]) / num_problems for t in per_seed_tests)
    detectable = stats.detectable_accuracy_difference(num_problems, discordant_share, ALPHA, POWER)
    minimum_pairs = stats.minimum_discordant_pairs(ALPHA)
    result["mcnemar"] = {"metric": binary_metric, "per_seed": per_seed_tests}
    result["power"] = {
        "alpha": ALPHA,
        "power": POWER,
        "mean_discordant_share": discordant_share,
        "detectable_difference": detectable,
        "exact_test_floor": minimum_pairs / num_problems,
        "minimum_discordant_pairs": minimum_pairs,
    }
    # Per-problem scores averaged over seeds, compared with a paired bootstrap over problems.
    for metric, field in (("pass@1", "correct_fraction"), (f"maj@{num_samples}", "majority_correct")):
        if metric not in metric_names:
            continue
        scores_a = _mean_over_seeds([[float(p[field]) for p in e["problems"]] for e in evals_a])
        scores_b = _mean_over_seeds([[float(p[field]) for p in e["problems"]] for e in evals_b])
        result["metrics"][metric]["bootstrap"] = stats.mean_bootstrap(
            scores_a, scores_b, num_resamples=config.num_bootstrap
        )
    return result


def paired_token_loss(config, losses_a: list[dict], losses_b: list[dict]) -> dict:
    """Per-token loss of both arms on the same rows (each element: one seed's per-row `nll`, `tokens` and `loss`,
    seeds in the same order in both arms): mean ± std over seeds per arm; B - A paired seed by seed; B - A per
    token with a paired bootstrap over rows (per-row losses averaged over seeds), the difference it detects at
    `ALPHA` with `POWER`, and the rows it would take to detect `TARGET_DIFFERENCE`."""
    values_a, values_b = [entry["loss"] for entry in losses_a], [entry["loss"] for entry in losses_b]
    paired = stats.token_loss_bootstrap(
        _mean_over_seeds([entry["nll"] for entry in losses_a]),
        _mean_over_seeds([entry["nll"] for entry in losses_b]),
        losses_a[0]["tokens"],
        num_resamples=config.num_bootstrap,
    )
    standard_error = paired["difference"]["standard_error"]
    paired["detectable_difference"] = stats.detectable_difference(standard_error, ALPHA, POWER)
    paired["target_difference"] = TARGET_DIFFERENCE
    paired["rows_for_target"] = (
        stats.items_needed(standard_error, paired["num_rows"], TARGET_DIFFERENCE, ALPHA, POWER)
        if standard_error > 0
        else None
    )
    return {
        "a": stats.seed_spread(values_a),
        "b": stats.seed_spread(values_b),
        "paired_over_seeds": stats.paired_over_seeds(values_a, values_b, config.seeds[: len(values_a)]),
        "paired": paired,
    }


def summarize(
    config,
    runs_a: list[dict],
    runs_b: list[dict],
    candidates: list[dict],
    evaluations: dict,
    extra: dict,
    references: tuple[list[dict], list[dict]] | None = None,
):
    """report.json: `runs_a` / `runs_b` are the train.json of each arm's seeds (same order), `candidates` arm B's
    seed-0 runs of every mixing learning rate, `evaluations` {benchmark[-sampled]: (evals of A, evals of B)},
    `references` (A's, B's) reference-solution scores per seed (`runs.score_reference`)."""
    validation = paired_token_loss(config, [run["validation"] for run in runs_a], [run["validation"] for run in runs_b])
    reference = None if references is None else paired_token_loss(config, *references)
    per_seed_same_data = [
        {
            "seed": run_a["seed"],
            "same_data": same_data(run_a["step_trace"], run_b["step_trace"]),
            "steps": [run_a["steps"], run_b["steps"]],
            "tokens": [sum(s["tokens"] for s in run_a["step_trace"]), sum(s["tokens"] for s in run_b["step_trace"])],
        }
        for run_a, run_b in zip(runs_a, runs_b)
    ]
    drift = [
        {
            "layer": layer_entries[0]["layer"],
            **{name: statistics.fmean(entry[name] for entry in layer_entries) for name in MIXING_NAMES},
            **{
                f"{name}_relative": statistics.fmean(entry[f"{name}_relative"] for entry in layer_entries)
                for name in MIXING_NAMES
            },
        }
        for layer_entries in zip(*[run["mixing_drift"] for run in runs_b])
    ]
    return {
        "config": config.to_dict(),
        **extra,
        "arms": {
            "a": {"name": ARM_A, "runs": [run["run"] for run in runs_a]},
            "b": {"name": ARM_B, "runs": [run["run"] for run in runs_b]},
        },
        "mixing_learning_rate_selection": [
            {"mixing_learning_rate": run["mixing_learning_rate"], "validation_loss": run["validation"]["loss"]}
            for run in candidates
        ],
        "chosen_mixing_learning_rate": runs_b[0]["mixing_learning_rate"],
        "same_data": per_seed_same_data,
        # The split the mixing learning rate was chosen on (B's first seed is the candidate that did best on it).
        "validation_loss": validation,
        # The headline: held-out test problems, never used for any choice.
        "reference_loss": reference,
        "benchmarks": {
            name: compare_per_problem(evals_a, evals_b, config) for name, (evals_a, evals_b) in evaluations.items()
        },
        "mixing_drift": drift,
        "curves": {
            run["run"]: [(entry["step"], entry["loss"]) for entry in run["log_history"] if "loss" in entry]
            for run in [*runs_a, *runs_b, *candidates]
        },
        "seconds": {
            run["run"]: run["seconds"] for run in {r["run"]: r for r in [*runs_a, *runs_b, *candidates]}.values()
        },
    }


__all__ = ["compare_per_problem", "paired_token_loss", "same_data", "summarize"]
