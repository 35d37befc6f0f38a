"""Tables and seed summaries of finished comparisons (their pictures: `figures`, the files: `outputs`)."""

from __future__ import annotations

import math

from ..statistics import holm_adjusted, paired_differences
from .config import config_from_saved, describe_m
from .train import model_variants


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


def _stopping_line(runs: list[dict]) -> str:
    recorded = [run for run in runs if "stopped_by" in run]  # results written before it was recorded lack it
    if not recorded:
        return "How the runs stopped was not recorded."
    by_patience = sum(run["stopped_by"] == "patience" for run in recorded)
    return (
        f"{by_patience} of {len(recorded)} runs stopped by patience, {len(recorded) - by_patience} by the epoch budget."
    )


def results_table(results: dict) -> str:
    """Markdown: per task and model, test accuracy at each learning rate, the validation-selected one, params;
    then the validation-selected runs' accuracy per m, and how the runs stopped."""
    config = results["config"]
    learning_rates = config["learning_rates"]
    best = best_runs(results)
    models = model_names(config)
    header = ["Task", "m", "Model", "Parameters"]
    header += [f"test acc, lr {lr:g}" for lr in learning_rates]
    header += ["test acc (val-selected lr)", "exact match (val-selected)", "epochs (best / run)"]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---|---:|" + "---:|" * (len(header) - 4)]
    for task in config["tasks"]:
        baseline = results["baselines"][task]
        for model in models:
            runs = {
                run["learning_rate"]: run for run in results["runs"] if run["task"] == task and run["model"] == model
            }
            chosen = best[(task, model)]
            row = [task, describe_m(baseline["m"]), model, f"{chosen['parameters']:,}"]
            row += [f"{100 * runs[lr]['test_accuracy']:.2f}" for lr in learning_rates]
            row += [
                f"**{100 * chosen['test_accuracy']:.2f}**",
                f"{100 * chosen['test_exact_match']:.2f}",
                f"{chosen['best_epoch']} / {chosen['epochs_run']}",
            ]
            lines.append("| " + " | ".join(row) + " |")
        majority = f"{100 * baseline['majority_accuracy']:.2f}"
        row = [task, describe_m(baseline["m"]), "constant (majority label)", "0"]
        row += [majority] * len(learning_rates) + [majority, "–", "–"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Test accuracy per m (validation-selected learning rate):", ""]
    for task in config["tasks"]:
        sizes = task_sizes(config, task)
        lines.append("| " + " | ".join([f"{task}: model", *[f"m = {size}" for size in sizes]]) + " |")
        lines.append("|---|" + "---:|" * len(sizes))
        for model in models:
            by_m = best[(task, model)].get("test_accuracy_by_m", {})
            cells = [f"{100 * by_m[str(size)]:.2f}" if str(size) in by_m else "–" for size in sizes]
            lines.append("| " + " | ".join([model, *cells]) + " |")
        by_m = results["baselines"][task].get("majority_accuracy_by_m", {})
        cells = [f"{100 * by_m[str(size)]:.2f}" if str(size) in by_m else "–" for size in sizes]
        lines.append("| " + " | ".join(["majority label", *cells]) + " |")
        lines.append("")
    lines.append(_stopping_line(results["runs"]))
    return "\n".join(lines)


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def spread_cell(seeds: list[int], values: list[float], all_seeds: list[int]) -> str:
    """A table cell for one model's values over its seeds: "mean ± std", with "(k of n seeds)" when some seeds
    lack it; one seed's value is "value (seed N only)", never a mean with a spread of zero."""
    if len(values) == 1:
        return f"{values[0]:.2f} (seed {seeds[0]} only)"
    mean, std = _mean_std(values)
    cell = f"{mean:.2f} ± {std:.2f}"
    if len(values) < len(all_seeds):
        cell += f" ({len(values)} of {len(all_seeds)} seeds)"
    return cell


def paired_gap_cell(paired: dict | None) -> str:
    """The "− baseline" cell: the mean difference paired by seed over the seeds both models have, and how many (a
    model on one seed is never set against a baseline's mean over three)."""
    if paired is None:
        return "–"
    labels = paired["labels"] or []
    if paired["n"] == 1 and labels:
        return f"{paired['mean']:+.2f} (seed {labels[0]} only)"
    return f"{paired['mean']:+.2f} ({paired['n']} seeds)"


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


def _exact_match_lines(config: dict, summary: dict, seeds: list[int]) -> list[str]:
    lines = ["", "Exact match (every entry of the composed relation right), test, validation-selected lr (%):", ""]
    lines += ["| Task | Model | mean ± std | " + " | ".join(f"seed {seed}" for seed in seeds) + " |"]
    lines += ["|---|---|---:|" + "---:|" * len(seeds)]
    for entry in summary.values():
        by_seed = dict(zip(entry["seeds"], entry["test_exact_match"]))
        cells = [f"{by_seed[seed]:.2f}" if seed in by_seed else "–" for seed in seeds]
        mean = spread_cell(entry["seeds"], entry["test_exact_match"], seeds)
        lines.append(f"| {entry['task']} | {entry['model']} | {mean} | " + " | ".join(cells) + " |")
    return lines


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


def _p_cell(paired: dict, key: str) -> str:
    return "–" if paired.get(key) is None else f"{paired[key]:.3g}"


def _paired_lines(config: dict, summary: dict, baselines: list[str]) -> list[str]:
    """The paired table: model minus baseline per seed; mean, t interval, paired t and sign-flip permutation p, each
    with its Holm-adjusted value over the table's tests (`add_holm_adjustment`)."""
    rows = paired_rows(summary)
    if not rows:
        return []
    family = max((paired.get("holm_family_size", 0) for _, _, _, paired in rows), default=0)
    lines = [
        "",
        "Paired by seed (the seeds share data, order and initial weights), model − baseline in points, over the seeds "
        "both models have: mean, 95% Student-t interval, paired t-test p, exact sign-flip permutation p (with n seeds "
        "it cannot fall below 2 / 2^n: 0.25 for 3 seeds), how many seeds came out positive. Holm: the p-value "
        f"adjusted by Holm's step-down method over the {family} tests of this table that have one (one family; a "
        "comparison on one seed has no test).",
        "",
        "| Task | Model − baseline | metric | seeds | mean | 95% CI | paired t p | Holm t p | permutation p "
        "| Holm permutation p | positive |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for entry, baseline, metric, paired in rows:
        ci = "–" if paired["ci"] is None else f"[{paired['ci'][0]:+.2f}, {paired['ci'][1]:+.2f}]"
        seeds = str(paired["n"]) if paired["n"] > 1 or not paired["labels"] else f"1 (seed {paired['labels'][0]})"
        lines.append(
            f"| {entry['task']} | {entry['model']} − {baseline} | {metric.replace('_', ' ')} | {seeds} | "
            f"{paired['mean']:+.2f} | {ci} | {_p_cell(paired, 't_p_value')} | {_p_cell(paired, 't_p_value_holm')} | "
            f"{_p_cell(paired, 'permutation_p_value')} | {_p_cell(paired, 'permutation_p_value_holm')} | "
            f"{paired['positive']} of {paired['n']} |"
        )
    return lines


# Per-entry accuracy above which every model of a task counts as saturated: the metric has no room left to
# separate them (0.5% of 25 entries is one wrong entry in eight relations).
SATURATED_ACCURACY = 99.5


def saturation_lines(results_per_seed: list[dict]) -> list[str]:
    """Per task, the range of per-entry test accuracy over every finished run, and whether it is saturated (every
    run above `SATURATED_ACCURACY`): then exact match is the measure that separates the models."""
    lines = []
    for task in results_per_seed[0]["config"]["tasks"]:
        values = [
            100 * run["test_accuracy"] for results in results_per_seed for run in results["runs"] if run["task"] == task
        ]
        if not values:
            continue
        text = f"{task}: per-entry test accuracy of every finished run is {min(values):.2f}-{max(values):.2f}%"
        if min(values) >= SATURATED_ACCURACY:
            text += (
                f" (all above {SATURATED_ACCURACY}%): the per-entry metric, the one the paper reports, is saturated "
                "here and cannot separate the models; exact match (every entry of a relation right, which the paper "
                "does not report) is the measure that does."
            )
        else:
            text += "."
        lines.append(text)
    return ["", *lines] if lines else []


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def data_overlap_lines(relations: dict) -> list[str]:
    """What the test relations share with training data: per seed its own training set (the duplicate rate), and
    across seeds every split of the other seeds (`relations.cross_seed_overlap`)."""
    lines = []
    for task, overlap in relations["overlap"].items():
        own = ", ".join(f"seed {seed} {100 * share:.2f}%" for seed, share in overlap["own_train"].items())
        lines += [
            "",
            f"**Data, {task}** ({overlap['data_streams']} data streams). Test relations present verbatim in the same "
            f"seed's training set (duplicates; small m at the paper's density repeats relations by chance): {own}. "
            "Across seeds, the share of one seed's test relations present verbatim in another seed's splits (%):",
            "",
            "| test of seed | splits of seed | train | val | test |",
            "|---:|---:|---:|---:|---:|",
        ]
        for row in overlap["pairs"]:
            lines.append(
                f"| {row['test_of']} | {row['splits_of']} | {_percent(row['train'])} | {_percent(row['val'])} | "
                f"{_percent(row['test'])} |"
            )
    return lines


def relation_lines(relations: dict) -> list[str]:
    """The per-relation tables (`relations.relation_tests`): exact match per run from its saved weights, on the test
    relations absent from and present in training; McNemar within each seed for every pair of models with weights."""
    from .relations import NO_WEIGHTS

    lines = [
        "",
        "**Per relation, from the saved best weights** (the model and its test split rebuilt exactly as training made "
        "them): exact match over all test relations (rebuilt / as recorded at training), on the test relations absent "
        "from that seed's training set and on those present in it (n relations each).",
        "",
        "| Task | seed | Model | exact match, rebuilt / recorded | unseen in training (n) | seen in training (n) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for seed in relations["seeds"]:
        for task, tests in seed["tasks"].items():
            for model, run in tests["runs"].items():
                if run["weights"] is None:
                    lines.append(f"| {task} | {seed['seed']} | {model} | {NO_WEIGHTS} | – | – |")
                    continue
                lines.append(
                    f"| {task} | {seed['seed']} | {model} | {_percent(run['exact_match'])} / "
                    f"{_percent(run['recorded_exact_match'])} | {_percent(run['unseen']['exact_match'])} "
                    f"({run['unseen']['relations']}) | {_percent(run['seen']['exact_match'])} "
                    f"({run['seen']['relations']}) |"
                )
    lines += [
        "",
        "McNemar within a seed (the same test relations; exact match per relation): relations only A / only B got "
        "entirely right, the exact two-sided McNemar p, and Holm's adjustment over the "
        f"{relations['mcnemar_tests']} tests of this table.",
        "",
        "| Task | seed | A | B | only A right | only B right | McNemar p | Holm p |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for seed in relations["seeds"]:
        for task, tests in seed["tasks"].items():
            for pair in tests["pairs"]:
                model_a, model_b = pair["models"]
                row = f"| {task} | {seed['seed']} | {model_a} | {model_b} |"
                if "p_value" not in pair:
                    lines.append(f"{row} {NO_WEIGHTS}: {', '.join(pair['missing_weights'])} | – | – | – |")
                    continue
                lines.append(
                    f"{row} {pair['only_a_right']} | {pair['only_b_right']} | {pair['p_value']:.3g} | "
                    f"{pair['p_value_holm']:.3g} |"
                )
    return lines


# The epochs at which every model is compared at equal training (those a seed's runs all reached), beside the
# smallest stopping epoch of the seed's runs.
EQUAL_EPOCHS = (10, 25, 50)


def best_so_far(history: list[dict]) -> list[float]:
    """The best validation accuracy (%) of epochs 1..e, for every epoch e a run trained (its history's order)."""
    best, curve = -math.inf, []
    for point in history:
        best = max(best, 100 * point["val_accuracy"])
        curve.append(best)
    return curve


def _stop_text(run: dict) -> str:
    how = {"patience": "patience", "epoch budget": "the budget"}.get(run.get("stopped_by", ""), "?")
    return f"{run['epochs_run']} ({how})"


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


def _leader_name(sign: int, models: list[str]) -> str:
    return "level" if sign == 0 else models[0 if sign < 0 else 1]


def _stretch_text(stretch: tuple[int, int, int], models: list[str]) -> str:
    sign, first, last = stretch
    epochs = f"at epoch {first}" if first == last else f"at every epoch from {first} to {last}"
    if sign == 0:
        return f"level {epochs}"
    leader = _leader_name(sign, models)
    return f"{leader} above {models[1] if leader == models[0] else models[0]} {epochs}"


def describe_equal_epochs(comparison: dict) -> str:
    """The comparison of `equal_epoch_comparison` in words: the last two stretches of one order before the shorter
    run stopped, the gap then and at the stopping points, and whether the stopping rule decides the order."""
    models = comparison["models"]
    common = comparison["common_epochs"]
    shorter = 0 if comparison["epochs_run"][0] <= comparison["epochs_run"][1] else 1
    longer = 1 - shorter
    stretches = "; then ".join(_stretch_text(stretch, models) for stretch in comparison["stretches"][-2:])
    at_common = comparison["at_common_epoch"]
    at_stop = comparison["at_stop"]
    text = (
        f"seed {comparison['seed']}, {models[1]} against {models[0]}: best validation accuracy so far {stretches}. "
        f"{models[shorter]} stopped at {common} ({comparison['stopped_by'][shorter]}), where {models[1]} − "
        f"{models[0]} was {at_common[1] - at_common[0]:+.3f} points"
    )
    if comparison["epochs_run"][longer] > common:
        text += (
            f"; {models[longer]} ran to {comparison['epochs_run'][longer]} ({comparison['stopped_by'][longer]}), "
            f"and at the stopping points the difference is {at_stop[1] - at_stop[0]:+.3f}"
        )
    if comparison["decided_by_stopping"]:
        return (
            text
            + ": the order at the stopping points is not the order at equal epochs, so the stopping rule decides it."
        )
    return text + ": the same order at equal epochs and at the stopping points."


def equal_epoch_lines(results_per_seed: list[dict]) -> tuple[list[str], list[dict]]:
    """Every model at equal epochs: best validation accuracy so far at `EQUAL_EPOCHS` and at the smallest stopping
    epoch of the seed's runs (a table), and against each baseline at equal epochs and at the stopping points
    (in words). Returns the lines and the comparisons."""
    config = results_per_seed[0]["config"]
    models = model_names(config)
    baselines = [name for name in ("MHA", "2-simplicial") if name in models]
    lines, comparisons = [], []
    rows = []
    for task in config["tasks"]:
        for results in results_per_seed:
            seed, selected = results["config"]["seed"], best_runs(results)
            runs = [selected[(task, model)] for model in models if (task, model) in selected]
            if not runs:
                continue
            shortest = min(len(run["history"]) for run in runs)
            for run in runs:
                curve = best_so_far(run["history"])
                cells = [f"{curve[epoch - 1]:.2f}" if epoch <= len(curve) else "–" for epoch in EQUAL_EPOCHS]
                rows.append(
                    f"| {task} | {seed} | {run['model']} | " + " | ".join(cells) + f" | {shortest}: "
                    f"{curve[shortest - 1]:.2f} | {curve[-1]:.2f} | {_stop_text(run)} |"
                )
            for model in models:
                for baseline in baselines[: baselines.index(model) if model in baselines else len(baselines)]:
                    if (task, model) in selected and (task, baseline) in selected:
                        comparisons.append(
                            equal_epoch_comparison(task, seed, selected[(task, baseline)], selected[(task, model)])
                        )
    if not rows:
        return [], []
    epochs = " | ".join(f"epoch {epoch}" for epoch in EQUAL_EPOCHS)
    lines += [
        "",
        "**At equal epochs** (validation accuracy, %, the best of epochs 1..e: what early stopping would have kept "
        "had the run stopped at e): at fixed epochs, at the smallest stopping epoch of the seed's runs, and at the "
        "run's own stop (`equal_epochs.png` draws every epoch).",
        "",
        f"| Task | seed | Model | {epochs} | smallest stop of the seed: best by then | at its stop | epochs run |",
        "|---|---:|---|" + "---:|" * (len(EQUAL_EPOCHS) + 3),
        *rows,
    ]
    if comparisons:
        lines += ["", "Which comparisons the stopping rule decides (best validation accuracy so far):", ""]
        lines += [f"- {comparison['task']}, {describe_equal_epochs(comparison)}" for comparison in comparisons]
    return lines, comparisons


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


def _best_by_epoch(history: list[dict], epoch: int) -> float:
    """The best validation accuracy (%) of a run's first `epoch` epochs."""
    return 100 * max(point["val_accuracy"] for point in history if point["epoch"] <= epoch)


def _in_progress_order(config: dict, run: dict) -> tuple:
    """Tasks, models and learning rates in the comparison's own order, then seeds."""
    return (
        config["tasks"].index(run["task"]),
        model_names(config).index(run["model"]),
        config["learning_rates"].index(run["learning_rate"]),
        run["seed"],
    )


def _in_progress_lines(results_per_seed: list[dict], in_progress: list[dict]) -> list[str]:
    """Markdown for the runs still training (`train.runs_in_progress`): how far each got and, beside it, what the
    finished runs of the same seed, task and learning rate had reached by the same epoch (validation accuracy: the
    only measure an unfinished run has)."""
    if not in_progress:
        return []
    config = results_per_seed[0]["config"]
    several_rates = len(config["learning_rates"]) > 1
    finished_by_seed = {results["config"]["seed"]: results["runs"] for results in results_per_seed}
    finished_models = [
        model
        for model in model_names(config)
        if any(run["model"] == model for runs in finished_by_seed.values() for run in runs)
    ]
    header = ["Task", "Model", *(["lr"] if several_rates else []), "seed", "epochs run", "best val acc (epoch)"]
    header += ["epochs without a gain", *[f"{model} by that epoch" for model in finished_models]]
    text = (
        f"**Runs in progress** (not in the tables above): how far each got, out of at most {config['max_epochs']} "
        f"epochs with patience {config['patience']}; validation accuracy (%), the best of the epochs run so far."
    )
    if finished_models:
        text += (
            " Beside it, the best validation accuracy the finished runs of the same seed and learning rate had reached "
            "by the same epoch (a run that stopped earlier: its best, and the epoch it stopped at)."
        )
    lines = ["", text, "", "| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for run in sorted(in_progress, key=lambda run: _in_progress_order(config, run)):
        epoch = run["epochs_run"]
        row = [run["task"], run["model"], *([f"{run['learning_rate']:g}"] if several_rates else [])]
        row += [str(run["seed"]), str(epoch), f"{100 * run['val_accuracy']:.2f} ({run['best_epoch']})"]
        row.append(str(run["epochs_without_gain"]))
        for model in finished_models:
            matching = [
                finished
                for finished in finished_by_seed.get(run["seed"], [])
                if (finished["task"], finished["model"], finished["learning_rate"])
                == (run["task"], model, run["learning_rate"])
            ]
            if not matching:
                row.append("–")
                continue
            history = matching[0]["history"]
            cell = f"{_best_by_epoch(history, epoch):.2f}"
            if len(history) < epoch:
                cell += f" (stopped at {len(history)})"
            row.append(cell)
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _unfinished_text(unfinished: list[tuple[str, str, list[int]]], in_progress: list[dict]) -> str:
    """The unfinished (task, model) pairs and their seeds, in one sentence; the seeds in progress are marked."""
    training = {(run["task"], run["model"], run["seed"]) for run in in_progress}
    parts = []
    for task, model, missing in unfinished:
        text = f"{task} {model} (seed{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        running = [str(seed) for seed in missing if (task, model, seed) in training]
        if running:
            text += f"; seed{'s' if len(running) > 1 else ''} {', '.join(running)} in progress, below"
        parts.append(text + ")")
    return "; ".join(parts)


def seed_summary(
    results_per_seed: list[dict], in_progress: list[dict] | None = None, relations: dict | None = None
) -> tuple[str, dict]:
    """Test accuracy over several seeds: mean ± std per task, model and learning rate, for the validation-selected
    learning rate (with every seed's value and the gap to each baseline), and per m; a markdown table and its numbers.

    Every element of `results_per_seed` is the output of one `run_comparison` (same tasks and models, another seed);
    `in_progress` (`train.runs_in_progress`) adds a table of the unfinished runs, as far as they got; `relations`
    (`relations.relation_tests`) the data the splits share and the per-relation tests from saved weights.
    """
    if not results_per_seed:
        raise ValueError("No results to summarise.")
    seeds = [results["config"]["seed"] for results in results_per_seed]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"Each result must come from a different seed; got seeds {seeds}.")
    first = results_per_seed[0]["config"]
    models = model_names(first)
    learning_rates = first["learning_rates"]
    baselines = [name for name in ("MHA", "2-simplicial") if name in models]
    selected = [best_runs(results) for results in results_per_seed]
    summary = {}
    header = ["Task", "m", "Model", *[f"lr {lr:g}" for lr in learning_rates], "val-selected lr"]
    header += [f"seed {seed}" for seed in seeds] + [f"− {name}" for name in baselines]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---|" + "---:|" * (len(header) - 3)]
    for task in first["tasks"]:
        for model in models:
            per_rate = {}
            for lr in learning_rates:
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
                        zip(("mean", "std"), _mean_std(values)), test_accuracy=values, seeds=rate_seeds
                    )
            # Seeds that have this model (all, unless some results are a partial checkpoint of a running call).
            having = [(seed, runs[(task, model)]) for seed, runs in zip(seeds, selected) if (task, model) in runs]
            if not having:
                continue
            values = [100 * run["test_accuracy"] for _, run in having]
            mean, std = _mean_std(values)
            by_m = {}
            for size in task_sizes(first, task):
                per_seed = [run.get("test_accuracy_by_m", {}).get(str(size)) for _, run in having]
                if None not in per_seed:
                    per_seed = [100 * value for value in per_seed]
                    by_m[str(size)] = dict(zip(("mean", "std"), _mean_std(per_seed)), values=per_seed)
            exact_match = [100 * run["test_exact_match"] for _, run in having]
            summary[f"{task}/{model}"] = {
                "task": task,
                "m": first["m"][task],
                "model": model,
                "test_accuracy": values,
                "mean": mean,
                "std": std,
                "test_exact_match": exact_match,
                "exact_match_mean": _mean_std(exact_match)[0],
                "exact_match_std": _mean_std(exact_match)[1],
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
            row = [task, describe_m(first["m"][task]), model]
            for lr in learning_rates:
                rate = per_rate.get(f"{lr:g}")
                row.append("–" if rate is None else spread_cell(rate["seeds"], rate["test_accuracy"], seeds))
            by_seed = {seed: 100 * run["test_accuracy"] for seed, run in having}
            selected_cell = spread_cell(list(by_seed), list(by_seed.values()), seeds)
            row += [f"**{selected_cell}**", *[f"{by_seed[seed]:.2f}" if seed in by_seed else "–" for seed in seeds]]
            for name in baselines:
                paired = summary[f"{task}/{model}"]["paired"].get(name, {}).get("accuracy")
                row.append(paired_gap_cell(paired))
            lines.append("| " + " | ".join(row) + " |")
    add_holm_adjustment(summary)
    lines += saturation_lines(results_per_seed)
    lines += _exact_match_lines(first, summary, seeds)
    lines += _paired_lines(first, summary, baselines)
    lines += equal_epoch_lines(results_per_seed)[0]
    if relations is not None:
        lines += data_overlap_lines(relations) + relation_lines(relations)
    lines += ["", "Test accuracy per m, mean ± std over seeds (validation-selected learning rate):", ""]
    for task in first["tasks"]:
        sizes = task_sizes(first, task)
        lines.append("| " + " | ".join([f"{task}: model", *[f"m = {size}" for size in sizes]]) + " |")
        lines.append("|---|" + "---:|" * len(sizes))
        for model in models:
            if f"{task}/{model}" not in summary:
                continue
            by_m = summary[f"{task}/{model}"]["by_m"]
            entry = summary[f"{task}/{model}"]
            cells = [
                spread_cell(entry["seeds"], by_m[str(size)]["values"], seeds) if str(size) in by_m else "–"
                for size in sizes
            ]
            lines.append("| " + " | ".join([model, *cells]) + " |")
        lines.append("")
    lines.append(_stopping_line([run for results in results_per_seed for run in results["runs"]]))
    lines += _in_progress_lines(results_per_seed, in_progress or [])
    unfinished = unfinished_runs(results_per_seed)
    if unfinished:
        total = len(first["tasks"]) * len(models) * len(seeds)
        finished = total - sum(len(missing) for _, _, missing in unfinished)
        lines = [
            f"**Partial results: {finished} of {total} runs finished.** Not finished, so not in the tables: "
            f"{_unfinished_text(unfinished, in_progress or [])}.",
            "",
            *lines,
        ]
    return "\n".join(lines), summary
