"""The pictures of comparisons: accuracy per model and m, the spread over seeds, and the learning curves of every
run (finished or in progress)."""

from __future__ import annotations

import os
from pathlib import Path

from iha.utils.atomic_files import saved_figure

from .config import describe_m
from .summary import best_runs, best_so_far, model_names, task_sizes


def plot_results(results: dict, path: str | os.PathLike) -> Path:
    """Per task (one column): test accuracy per model (validation-selected learning rate), validation curves, and
    test accuracy against m."""
    config = results["config"]
    tasks = config["tasks"]
    models = model_names(config)
    best = best_runs(results)
    colors = [f"C{index}" for index in range(10)]  # matplotlib's default color cycle
    grid = dict(nrows=3, ncols=len(tasks), squeeze=False)  # one column per task
    with saved_figure(path, dpi=110, figsize=(5.5 * len(tasks), 12), **grid) as (_, axes):
        for column, task in enumerate(tasks):
            baseline = results["baselines"][task]
            accuracies = [100 * best[(task, model)]["test_accuracy"] for model in models]
            bar_axis = axes[0][column]
            bars = bar_axis.bar(models, accuracies, color=colors[: len(models)])
            for bar, accuracy, model in zip(bars, accuracies, models):
                label = f"{accuracy:.2f}\nlr {best[(task, model)]['learning_rate']:g}"
                bar_axis.text(
                    bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom", fontsize=8
                )
            bar_axis.axhline(100 * baseline["majority_accuracy"], color="gray", linestyle="--", label="majority label")
            low = min(accuracies + [100 * baseline["majority_accuracy"]])
            bar_axis.set_ylim(max(0, low - 5), max(accuracies) + 8)  # room for the labels above the bars
            bar_axis.set_title(f"{task} composition, m = {describe_m(baseline['m'])}: test accuracy")
            bar_axis.set_ylabel("per-position accuracy (%)")
            bar_axis.tick_params(axis="x", labelsize=8)
            bar_axis.legend(loc="lower right", fontsize=8)
            curve_axis = axes[1][column]
            for index, model in enumerate(models):
                for run in results["runs"]:
                    if run["task"] != task or run["model"] != model:
                        continue
                    epochs = [point["epoch"] for point in run["history"]]
                    values = [100 * point["val_accuracy"] for point in run["history"]]
                    style = "-" if run["learning_rate"] == max(config["learning_rates"]) else ":"
                    curve_axis.plot(
                        epochs, values, style, color=colors[index], label=f"{model}, lr {run['learning_rate']:g}"
                    )
            curve_axis.set_xlabel("epoch")
            curve_axis.set_ylabel("validation accuracy (%)")
            curve_axis.set_title(f"{task}: validation accuracy per epoch")
            curve_axis.legend(fontsize=7)
            size_axis = axes[2][column]
            sizes = task_sizes(config, task)
            for index, model in enumerate(models):
                by_m = best[(task, model)].get("test_accuracy_by_m", {})
                shown = [size for size in sizes if str(size) in by_m]
                size_axis.plot(shown, [100 * by_m[str(size)] for size in shown], "o-", color=colors[index], label=model)
            majority = baseline.get("majority_accuracy_by_m", {})
            shown = [size for size in sizes if str(size) in majority]
            size_axis.plot(shown, [100 * majority[str(s)] for s in shown], "--", color="gray", label="majority label")
            size_axis.set_xticks(sizes)
            size_axis.set_xlabel("m (relation size)")
            size_axis.set_ylabel("test accuracy (%)")
            size_axis.set_title(f"{task}: test accuracy against m")
            size_axis.legend(fontsize=7)
    return Path(path)


def seeds_note(entry: dict, all_seeds: list[int]) -> str:
    """Nothing for a model every seed has finished; else which seeds it stands on ("seed 0 only", "2 of 3 seeds"), so
    that a picture never shows one seed's value as a mean with no spread."""
    seeds = entry["seeds"]
    if len(seeds) == len(all_seeds):
        return ""
    return f"seed {seeds[0]} only" if len(seeds) == 1 else f"{len(seeds)} of {len(all_seeds)} seeds"


def accuracy_label(entry: dict, all_seeds: list[int]) -> str:
    """The text over a model's bar: mean ± std over its seeds, or its one seed's value and which seed."""
    note = seeds_note(entry, all_seeds)
    if len(entry["seeds"]) == 1 and note:
        return f"{entry['mean']:.2f}\n({note})"
    return f"{entry['mean']:.2f} ± {entry['std']:.2f}" + (f"\n({note})" if note else "")


def plot_seed_summary(summary: dict, path: str | os.PathLike) -> Path:
    """Per task (one column): mean test accuracy per model over seeds (bars, +-1 std, every seed a dot), and mean
    test accuracy against m (+-1 std)."""
    tasks = list(dict.fromkeys(entry["task"] for entry in summary.values()))
    colors = [f"C{index}" for index in range(10)]  # matplotlib's default color cycle
    grid = dict(nrows=2, ncols=len(tasks), squeeze=False)  # one column per task
    with saved_figure(path, dpi=110, figsize=(5.5 * len(tasks), 8.4), **grid) as (_, axes):
        for column, task in enumerate(tasks):
            axis = axes[0][column]
            entries = [entry for entry in summary.values() if entry["task"] == task]
            positions = range(len(entries))
            means = [entry["mean"] for entry in entries]
            axis.bar(
                positions,
                means,
                yerr=[entry["std"] for entry in entries],
                capsize=4,
                color=colors[: len(entries)],
                alpha=0.75,
            )
            # Labels sit above both the error bar and the highest seed, so that neither hides them.
            tops = [max(entry["mean"] + entry["std"], *entry["test_accuracy"]) for entry in entries]
            bottoms = [min(entry["mean"] - entry["std"], *entry["test_accuracy"]) for entry in entries]
            span = max(max(tops) - min(bottoms), 1.0)
            all_seeds = sorted({seed for entry in entries for seed in entry["seeds"]})
            for position, entry, top in zip(positions, entries, tops):
                values = entry["test_accuracy"]
                axis.scatter([position] * len(values), values, color="black", s=12, zorder=3)
                label = accuracy_label(entry, all_seeds)
                axis.text(position, top + 0.03 * span, label, ha="center", va="bottom", fontsize=8)
            axis.set_ylim(min(bottoms) - 0.3 * span, max(tops) + 0.15 * span)
            axis.set_xticks(list(positions), [entry["model"] for entry in entries], fontsize=8)
            seeds = ", ".join(str(seed) for seed in all_seeds)
            m = describe_m(entries[0]["m"])
            axis.set_title(f"{task} composition, m = {m}: test accuracy, seeds {seeds}", fontsize=10)
            axis.set_ylabel("per-position accuracy (%)")
            axis.grid(axis="y", alpha=0.3)
            size_axis = axes[1][column]
            for index, entry in enumerate(entries):
                sizes = sorted(int(size) for size in entry.get("by_m", {}))
                if not sizes:
                    continue
                size_axis.errorbar(
                    sizes,
                    [entry["by_m"][str(size)]["mean"] for size in sizes],
                    yerr=[entry["by_m"][str(size)]["std"] for size in sizes],
                    fmt="o-",
                    capsize=3,
                    color=colors[index],
                    label=entry["model"] + (f" ({note})" if (note := seeds_note(entry, all_seeds)) else ""),
                )
                size_axis.set_xticks(sizes)
            size_axis.set_xlabel("m (relation size)")
            size_axis.set_ylabel("test accuracy (%), mean ± std over seeds")
            size_axis.set_title(f"{task}: test accuracy against m", fontsize=10)
            size_axis.legend(fontsize=7)
            size_axis.grid(alpha=0.3)
    return Path(path)


# Validation error drawn for an epoch with none, on the log axis of `plot_learning_curves` (it has no 0).
ZERO_ERROR_DRAWN_AT = 1e-3


def _error_curve(history: list[dict]) -> tuple[list[int], list[float]]:
    """Epochs and validation error (%) of a run's history, a perfect epoch drawn at `ZERO_ERROR_DRAWN_AT`."""
    epochs = [point["epoch"] for point in history]
    return epochs, [max(100 * (1 - point["val_accuracy"]), ZERO_ERROR_DRAWN_AT) for point in history]


def plot_learning_curves(results_per_seed: list[dict], in_progress: list[dict], path: str | os.PathLike) -> Path:
    """Validation error per epoch (log scale), one panel per task and seed: every model's validation-selected run
    (solid) and every run still training (dashed, its last epoch marked), so an unfinished run reads against the
    finished ones at equal epochs."""
    from matplotlib.ticker import MaxNLocator

    config = results_per_seed[0]["config"]
    tasks, models = config["tasks"], model_names(config)
    several_rates = len(config["learning_rates"]) > 1
    colors = {model: f"C{index}" for index, model in enumerate(models)}  # matplotlib's default color cycle
    grid = dict(nrows=len(tasks), ncols=len(results_per_seed), squeeze=False, sharey="row")
    size = (4.5 * len(results_per_seed), 3.6 * len(tasks))
    with saved_figure(path, dpi=110, figsize=size, **grid) as (_, axes):
        for row, task in enumerate(tasks):
            for column, results in enumerate(results_per_seed):
                axis, seed = axes[row][column], results["config"]["seed"]
                for (run_task, model), run in best_runs(results).items():
                    if run_task == task:
                        label = f"{model}, lr {run['learning_rate']:g}" if several_rates else model
                        axis.plot(*_error_curve(run["history"]), "-", color=colors[model], label=label)
                for run in in_progress:
                    if run["task"] == task and run["seed"] == seed:
                        epochs, errors = _error_curve(run["history"])
                        label = run["model"] + (f", lr {run['learning_rate']:g}" if several_rates else "")
                        axis.plot(epochs, errors, "--", color=colors[run["model"]], label=f"{label} (in progress)")
                        axis.plot(epochs[-1:], errors[-1:], "o", color=colors[run["model"]])
                axis.set_title(f"{task}, m = {describe_m(config['m'][task])}, seed {seed}", fontsize=10)
                axis.set_xlabel("epoch")
                axis.xaxis.set_major_locator(MaxNLocator(integer=True))
                if column == 0:  # the panels of a row share their y axis
                    axis.set_ylabel(f"validation error (%, log; none drawn at {ZERO_ERROR_DRAWN_AT:g})")
                if not axis.get_legend_handles_labels()[0]:
                    axis.text(0.5, 0.5, "no epoch run yet", ha="center", va="center", transform=axis.transAxes)
                    continue
                axis.set_yscale("log")
                axis.grid(alpha=0.3, which="both")
                axis.legend(fontsize=7)
    return Path(path)


def plot_equal_epochs(results_per_seed: list[dict], path: str | os.PathLike) -> Path:
    """Best validation accuracy so far by epoch (as error, log scale), one panel per task: every model's
    validation-selected run of every seed as a thin line ending at its stop (marked: x by patience, o by the epoch
    budget), and the mean over seeds, thick, over the epochs every seed ran; so models read at equal epochs as well
    as at their stopping points."""
    from matplotlib.ticker import MaxNLocator

    config = results_per_seed[0]["config"]
    tasks, models = config["tasks"], model_names(config)
    colors = {model: f"C{index}" for index, model in enumerate(models)}  # matplotlib's default color cycle
    grid = dict(nrows=1, ncols=len(tasks), squeeze=False)
    with saved_figure(path, dpi=110, figsize=(7 * len(tasks), 5), **grid) as (_, axes):
        for column, task in enumerate(tasks):
            axis = axes[0][column]
            for model in models:
                runs = [best_runs(results).get((task, model)) for results in results_per_seed]
                curves = [best_so_far(run["history"]) for run in runs if run is not None]
                seeds = [results["config"]["seed"] for results, run in zip(results_per_seed, runs) if run]
                for curve, run in zip(curves, [run for run in runs if run is not None]):
                    errors = [max(100 - value, ZERO_ERROR_DRAWN_AT) for value in curve]
                    epochs = list(range(1, len(errors) + 1))
                    axis.plot(epochs, errors, "-", color=colors[model], linewidth=0.7, alpha=0.6)
                    marker = "x" if run.get("stopped_by") == "patience" else "o"
                    axis.plot(epochs[-1:], errors[-1:], marker, color=colors[model], markersize=5)
                if not curves:
                    continue
                shared = min(len(curve) for curve in curves)
                mean = [sum(curve[epoch] for curve in curves) / len(curves) for epoch in range(shared)]
                label = f"{model} (mean of seeds {', '.join(map(str, seeds))} to epoch {shared})"
                if len(curves) == 1:
                    label = f"{model} (seed {seeds[0]} only)"
                errors = [max(100 - value, ZERO_ERROR_DRAWN_AT) for value in mean]
                axis.plot(range(1, shared + 1), errors, "-", color=colors[model], linewidth=2.2, label=label)
            axis.set_yscale("log")
            axis.set_title(
                f"{task}, m = {describe_m(config['m'][task])}: best validation error so far\n"
                "(thin: each seed; x: stopped by patience, o: by the epoch budget)",
                fontsize=9,
            )
            axis.set_xlabel("epoch")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
            axis.set_ylabel(f"100 − best validation accuracy so far (%, log; none drawn at {ZERO_ERROR_DRAWN_AT:g})")
            axis.grid(alpha=0.3, which="both")
            axis.legend(fontsize=7)
    return Path(path)
