"""What has not finished, for `python -m research.synthetic --report`: the runs in progress as far as they got, beside what the
finished runs of the same seed had reached by the same epoch, and the unfinished runs in one sentence."""

from __future__ import annotations

from .summary import best_by_epoch, model_names


def _in_progress_order(config: dict, run: dict) -> tuple:
    """Tasks, models and learning rates in the comparison's own order, then seeds."""
    return (
        config["tasks"].index(run["task"]),
        model_names(config).index(run["model"]),
        config["learning_rates"].index(run["learning_rate"]),
        run["seed"],
    )


def in_progress_lines(results_per_seed: list[dict], in_progress: list[dict]) -> list[str]:
    """Markdown for the runs still training (`checkpoints.runs_in_progress`): how far each got and, beside it, what the
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
            cell = f"{best_by_epoch(history, epoch):.2f}"
            if len(history) < epoch:
                cell += f" (stopped at {len(history)})"
            row.append(cell)
        lines.append("| " + " | ".join(row) + " |")
    return lines


def unfinished_text(unfinished: list[tuple[str, str, list[int]]], in_progress: list[dict]) -> str:
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
