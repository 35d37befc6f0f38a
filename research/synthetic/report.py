"""Markdown of finished comparisons: one seed's results table and the summary over seeds (their numbers:
`summary`; their pictures: `figures`; the files: `outputs`)."""

from __future__ import annotations

from .config import describe_m
from .progress import in_progress_lines, unfinished_text
from .summary import (
    NO_WEIGHTS,
    best_runs,
    best_so_far,
    equal_epoch_comparisons,
    mean_std,
    model_names,
    paired_rows,
    summarize_seeds,
    task_sizes,
    unfinished_runs,
)


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


def spread_cell(seeds: list[int], values: list[float], all_seeds: list[int]) -> str:
    """A table cell for one model's values over its seeds: "mean ± std", with "(k of n seeds)" when some seeds
    lack it; one seed's value is "value (seed N only)", never a mean with a spread of zero."""
    if len(values) == 1:
        return f"{values[0]:.2f} (seed {seeds[0]} only)"
    mean, std = mean_std(values)
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


def _stop_text(run: dict) -> str:
    how = {"patience": "patience", "epoch budget": "the budget"}.get(run.get("stopped_by", ""), "?")
    return f"{run['epochs_run']} ({how})"


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


def equal_epoch_lines(results_per_seed: list[dict]) -> list[str]:
    """Every model at equal epochs: best validation accuracy so far at `EQUAL_EPOCHS` and at the smallest stopping
    epoch of the seed's runs (a table), and against each baseline at equal epochs and at the stopping points
    (in words, `summary.equal_epoch_comparisons`)."""
    config = results_per_seed[0]["config"]
    models = model_names(config)
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
    if not rows:
        return []
    epochs = " | ".join(f"epoch {epoch}" for epoch in EQUAL_EPOCHS)
    lines = [
        "",
        "**At equal epochs** (validation accuracy, %, the best of epochs 1..e: what early stopping would have kept "
        "had the run stopped at e): at fixed epochs, at the smallest stopping epoch of the seed's runs, and at the "
        "run's own stop (`equal_epochs.png` draws every epoch).",
        "",
        f"| Task | seed | Model | {epochs} | smallest stop of the seed: best by then | at its stop | epochs run |",
        "|---|---:|---|" + "---:|" * (len(EQUAL_EPOCHS) + 3),
        *rows,
    ]
    comparisons = equal_epoch_comparisons(results_per_seed)
    if comparisons:
        lines += ["", "Which comparisons the stopping rule decides (best validation accuracy so far):", ""]
        lines += [f"- {comparison['task']}, {describe_equal_epochs(comparison)}" for comparison in comparisons]
    return lines


def seed_summary(
    results_per_seed: list[dict], in_progress: list[dict] | None = None, relations: dict | None = None
) -> tuple[str, dict]:
    """Test accuracy over several seeds (`summary.summarize_seeds`) as markdown: mean ± std per task, model and
    learning rate, for the validation-selected learning rate (with every seed's value and the gap to each
    baseline), exact match, the paired tests, the runs at equal epochs, and per m; returns the markdown and the
    numbers.

    Every element of `results_per_seed` is the output of one `run_comparison` (same tasks and models, another seed);
    `in_progress` (`checkpoints.runs_in_progress`) adds a table of the unfinished runs, as far as they got; `relations`
    (`relations.relation_tests`) the data the splits share and the per-relation tests from saved weights.
    """
    summary = summarize_seeds(results_per_seed)
    seeds = [results["config"]["seed"] for results in results_per_seed]
    first = results_per_seed[0]["config"]
    models = model_names(first)
    learning_rates = first["learning_rates"]
    baselines = [name for name in ("MHA", "2-simplicial") if name in models]
    header = ["Task", "m", "Model", *[f"lr {lr:g}" for lr in learning_rates], "val-selected lr"]
    header += [f"seed {seed}" for seed in seeds] + [f"− {name}" for name in baselines]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---|" + "---:|" * (len(header) - 3)]
    for entry in summary.values():
        row = [entry["task"], describe_m(entry["m"]), entry["model"]]
        for lr in learning_rates:
            rate = entry["by_learning_rate"].get(f"{lr:g}")
            row.append("–" if rate is None else spread_cell(rate["seeds"], rate["test_accuracy"], seeds))
        by_seed = dict(zip(entry["seeds"], entry["test_accuracy"]))
        selected_cell = spread_cell(list(by_seed), list(by_seed.values()), seeds)
        row += [f"**{selected_cell}**", *[f"{by_seed[seed]:.2f}" if seed in by_seed else "–" for seed in seeds]]
        for name in baselines:
            row.append(paired_gap_cell(entry["paired"].get(name, {}).get("accuracy")))
        lines.append("| " + " | ".join(row) + " |")
    lines += saturation_lines(results_per_seed)
    lines += _exact_match_lines(first, summary, seeds)
    lines += _paired_lines(first, summary, baselines)
    lines += equal_epoch_lines(results_per_seed)
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
    lines += in_progress_lines(results_per_seed, in_progress or [])
    unfinished = unfinished_runs(results_per_seed)
    if unfinished:
        total = len(first["tasks"]) * len(models) * len(seeds)
        finished = total - sum(len(missing) for _, _, missing in unfinished)
        lines = [
            f"**Partial results: {finished} of {total} runs finished.** Not finished, so not in the tables: "
            f"{unfinished_text(unfinished, in_progress or [])}.",
            "",
            *lines,
        ]
    return "\n".join(lines), summary
