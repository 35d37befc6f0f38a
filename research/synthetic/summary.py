"""The numbers of finished comparisons, apart from how they are written (`report`) or drawn (`figures`): the
validation-selected run of each model, the mean and spread over seeds, the paired differences to each baseline with
Holm's adjustment, the runs at equal epochs, and what has not finished."""

from __future__ import annotations

import math

from ..statistics import holm_adjusted, paired_differences
from .config import config_from_saved, model_variants


# What the per-relation tables say of a run finished before runs saved their weights (`relations`).
NO_WEIGHTS = "no saved weights (finished before weights were saved)"


def best_runs(results: dict) -> dict[tuple[str, str], dict]:
    """Per (task, model): the learning rate with the best validation accuracy (ties: the first listed)."""
    best = {}
    for run in results["runs"]:
        key = (run["task"], run["model"])
        if key not in best or run["val_accuracy"] > best[key]["val_accuracy"]:
            best[key] = run
    return best


def model_names(config: dict) -> list[str]:
    return [name for name, _, _ in model_variants(config_from_saved(config))]


def task_sizes(config: dict, task: str) -> list[int]:
    low, high = config_from_saved(config).m[task]
    return list(range(low, high + 1))


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def _paired_with_baselines(
    task: str, model: str, baselines: list[str], seeds: list[int], selected: list[dict]
) -> dict[str, dict]:
    """Per baseline listed before `model` (MHA, then 2-simplicial): test accuracy and exact match of `model` minus
    the baseline's, paired by seed (the seeds both have: same data, order and shared initial weights), in points."""
    paired = {}
    for baseline in baselines[: baselines.index(model) if model in baselines else len(baselines)]:
        both = [
            (seed, runs) for seed, runs in zip(seeds, selected) if (task, model) in runs and (task, baseline) in runs
        ]
        if not both:
            continue
        paired[baseline] = {
            metric: paired_differences(
                [100 * runs[(task, baseline)][key] for _, runs in both],
                [100 * runs[(task, model)][key] for _, runs in both],
                labels=[seed for seed, _ in both],
            )
            for metric, key in (("accuracy", "test_accuracy"), ("exact_match", "test_exact_match"))
        }
    return paired


def paired_rows(summary: dict) -> list[tuple[dict, str, str, dict]]:
    """(entry, baseline, metric, paired) of every paired comparison in the summary, in the table's order."""
    return [
        (entry, baseline, metric, paired)
        for entry in summary.values()
        for baseline, metrics in entry["paired"].items()
        for metric, paired in metrics.items()
    ]


def add_holm_adjustment(summary: dict) -> None:
    """Holm-adjust the paired table's tests as one family (`statistics.holm_adjusted`), each kind of p-value on its
    own: every paired result with a p-value gains `t_p_value_holm` / `permutation_p_value_holm` and the family's
    size. One table is one family: a reader who picks its smallest p among several picks from all of them."""
    rows = [paired for _, _, _, paired in paired_rows(summary)]
    for key in ("t_p_value", "permutation_p_value"):
        tested = [paired for paired in rows if paired[key] is not None]
        for paired, adjusted in zip(tested, holm_adjusted([paired[key] for paired in tested])):
            paired[f"{key}_holm"] = adjusted
            paired["holm_family_size"] = len(tested)


def best_so_far(history: list[dict]) -> list[float]:
    """The best validation accuracy (%) of epochs 1..e, for every epoch e a run trained (its history's order)."""
    best, curve = -math.inf, []
    for point in history:
        best = max(best, 100 * point["val_accuracy"])
        curve.append(best)
    return curve


def leading_stretches(curve_a: list[float], curve_b: list[float]) -> list[tuple[int, int, int]]:
    """(sign, first, last) of every stretch of equal epochs in which the order of two best-so-far curves stayed the
    same (sign 1: b above, -1: a above, 0: level), epochs counted from 1, over the epochs both ran."""
    stretches = []
    for epoch, (a, b) in enumerate(zip(curve_a, curve_b), start=1):
        sign = (b > a) - (b < a)
        if stretches and stretches[-1][0] == sign:
            stretches[-1] = (sign, stretches[-1][1], epoch)
        else:
            stretches.append((sign, epoch, epoch))
    return stretches


def equal_epoch_comparison(task: str, seed: int, run_a: dict, run_b: dict) -> dict:
    """Run a (a baseline) against run b of one seed at equal epochs and at their stopping points: whether the
    stopping rule decides the comparison (the leader at the last epoch both ran is not the leader at the end)."""
    curve_a, curve_b = best_so_far(run_a["history"]), best_so_far(run_b["history"])
    common = min(len(curve_a), len(curve_b))
    stretches = leading_stretches(curve_a[:common], curve_b[:common])
    final_sign = (curve_b[-1] > curve_a[-1]) - (curve_b[-1] < curve_a[-1])
    return {
        "task": task,
        "seed": seed,
        "models": [run_a["model"], run_b["model"]],
        "epochs_run": [run_a["epochs_run"], run_b["epochs_run"]],
        "stopped_by": [run_a.get("stopped_by"), run_b.get("stopped_by")],
        "common_epochs": common,
        "at_common_epoch": [curve_a[common - 1], curve_b[common - 1]],
        "at_stop": [curve_a[-1], curve_b[-1]],
        "stretches": stretches,
        "leader_at_common_epoch": stretches[-1][0],
        "leader_at_stop": final_sign,
        "decided_by_stopping": stretches[-1][0] != final_sign,
    }


def unfinished_runs(results_per_seed: list[dict]) -> list[tuple[str, str, list[int]]]:
    """(task, model, seeds) for every (task, model) of the comparison that some seeds have not finished."""
    config = results_per_seed[0]["config"]
    unfinished = []
    for task in config["tasks"]:
        for model in model_names(config):
            missing = [
                results["config"]["seed"]
                for results in results_per_seed
                if not any(run["task"] == task and run["model"] == model for run in results["runs"])
            ]
            if missing:
                unfinished.append((task, model, missing))
    return unfinished


def best_by_epoch(history: list[dict], epoch: int) -> float:
    """The best validation accuracy (%) of a run's first `epoch` epochs."""
    return 100 * max(point["val_accuracy"] for point in history if point["epoch"] <= epoch)


def equal_epoch_comparisons(results_per_seed: list[dict]) -> list[dict]:
    """Every model against each baseline listed before it (MHA, then 2-simplicial), per task and seed, at equal
    epochs and at the stopping points (`equal_epoch_comparison`), on the validation-selected runs."""
    config = results_per_seed[0]["config"]
    models = model_names(config)
    baselines = [name for name in ("MHA", "2-simplicial") if name in models]
    comparisons = []
    for task in config["tasks"]:
        for results in results_per_seed:
            seed, selected = results["config"]["seed"], best_runs(results)
            for model in models:
                for baseline in baselines[: baselines.index(model) if model in baselines else len(baselines)]:
                    if (task, model) in selected and (task, baseline) in selected:
                        comparisons.append(
                            equal_epoch_comparison(task, seed, selected[(task, baseline)], selected[(task, model)])
                        )
    return comparisons


def summarize_seeds(results_per_seed: list[dict]) -> dict:
    """Test accuracy and exact match over several seeds, per task and model (validation-selected learning rate):
    every seed's value, mean ± std, per learning rate and per m, the paired differences to each baseline
    (Holm-adjusted as one family, `add_holm_adjustment`) and how the runs stopped; keyed "task/model", in the
    comparison's order. Every element of `results_per_seed` is the output of one `run_comparison` (same tasks and
    models, another seed); a (task, model) no seed has finished is left out."""
    if not results_per_seed:
        raise ValueError("No results to summarise.")
    seeds = [results["config"]["seed"] for results in results_per_seed]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"Each result must come from a different seed; got seeds {seeds}.")
    first = results_per_seed[0]["config"]
    models = model_names(first)
    baselines = [name for name in ("MHA", "2-simplicial") if name in models]
    selected = [best_runs(results) for results in results_per_seed]
    summary = {}
    for task in first["tasks"]:
        for model in models:
            per_rate = {}
            for lr in first["learning_rates"]:
                values, rate_seeds = [], []
                for seed, results in zip(seeds, results_per_seed):
                    matching = [
                        run["test_accuracy"]
                        for run in results["runs"]
                        if run["task"] == task and run["model"] == model and run["learning_rate"] == lr
                    ]
                    values += [100 * accuracy for accuracy in matching[:1]]
                    rate_seeds += [seed] * len(matching[:1])
                if values:  # a seed may have run fewer learning rates (then the table says over how many seeds)
                    per_rate[f"{lr:g}"] = dict(
                        zip(("mean", "std"), mean_std(values)), test_accuracy=values, seeds=rate_seeds
                    )
            # Seeds that have this model (all, unless some results are a partial checkpoint of a running call).
            having = [(seed, runs[(task, model)]) for seed, runs in zip(seeds, selected) if (task, model) in runs]
            if not having:
                continue
            values = [100 * run["test_accuracy"] for _, run in having]
            mean, std = mean_std(values)
            by_m = {}
            for size in task_sizes(first, task):
                per_seed = [run.get("test_accuracy_by_m", {}).get(str(size)) for _, run in having]
                if None not in per_seed:
                    per_seed = [100 * value for value in per_seed]
                    by_m[str(size)] = dict(zip(("mean", "std"), mean_std(per_seed)), values=per_seed)
            exact_match = [100 * run["test_exact_match"] for _, run in having]
            summary[f"{task}/{model}"] = {
                "task": task,
                "m": first["m"][task],
                "model": model,
                "test_accuracy": values,
                "mean": mean,
                "std": std,
                "test_exact_match": exact_match,
                "exact_match_mean": mean_std(exact_match)[0],
                "exact_match_std": mean_std(exact_match)[1],
                "seeds": [seed for seed, _ in having],
                "unfinished_seeds": [seed for seed, runs in zip(seeds, selected) if (task, model) not in runs],
                "paired": _paired_with_baselines(task, model, baselines, seeds, selected),
                "learning_rates": [run["learning_rate"] for _, run in having],
                "by_learning_rate": per_rate,
                "by_m": by_m,
                "stopped_by_patience": sum(
                    run.get("stopped_by") == "patience"
                    for results in results_per_seed
                    for run in results["runs"]
                    if run["task"] == task and run["model"] == model
                ),
                "runs": sum(
                    run["task"] == task and run["model"] == model
                    for results in results_per_seed
                    for run in results["runs"]
                ),
            }
    add_holm_adjustment(summary)
    return summary
