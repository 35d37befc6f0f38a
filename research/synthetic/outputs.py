"""The files of a comparison: results.json / .md and accuracy.png of one seed, seeds.md / .json / .png over seeds
(and curves.png for a report of runs in progress)."""

from __future__ import annotations

import os
from pathlib import Path

from iha.utils.atomic_files import write_json_atomic, write_text_atomic

from .figures import plot_equal_epochs, plot_learning_curves, plot_results, plot_seed_summary
from .report import results_table, seed_summary


def write_seed_summary(
    results_per_seed: list[dict],
    output_dir: str | os.PathLike,
    in_progress: list[dict] | None = None,
    relations: dict | None = None,
) -> dict[str, Path]:
    """seeds.md (the table), seeds.json, seeds.png and equal_epochs.png (best validation so far by epoch) in
    `output_dir`. With `in_progress` (`checkpoints.runs_in_progress`,
    what `python -m research.synthetic --report` passes), the runs still training as far as they got, in seeds.md and
    in_progress.json (with their per-epoch history), and curves.png: validation error per epoch of every run,
    finished or not. With `relations` (`relations.relation_tests`), their tables in seeds.md and relations.json."""
    output_dir = Path(output_dir)
    table, summary = seed_summary(results_per_seed, in_progress, relations)
    paths = {"table": output_dir / "seeds.md", "json": output_dir / "seeds.json", "plot": output_dir / "seeds.png"}
    write_text_atomic(table + "\n", paths["table"])
    write_json_atomic(summary, paths["json"])
    if relations is not None:
        paths["relations"] = write_json_atomic(relations, output_dir / "relations.json")
    # Nothing to draw: no picture, and none left from an earlier call that would disagree with the table.
    equal_epochs = output_dir / "equal_epochs.png"
    if summary:
        plot_seed_summary(summary, paths["plot"])
        paths["equal_epochs"] = plot_equal_epochs(results_per_seed, equal_epochs)
    else:
        paths["plot"].unlink(missing_ok=True)
        del paths["plot"]
        equal_epochs.unlink(missing_ok=True)
    if in_progress is not None:
        # A run that finished since the last report is in seeds.json now: no stale in_progress.json beside it.
        progress_path = output_dir / "in_progress.json"
        if in_progress:
            paths["in_progress"] = write_json_atomic(in_progress, progress_path)
        else:
            progress_path.unlink(missing_ok=True)
        curves = output_dir / "curves.png"
        if in_progress or any(results["runs"] for results in results_per_seed):
            paths["curves"] = plot_learning_curves(results_per_seed, in_progress, curves)
        else:
            curves.unlink(missing_ok=True)
    return paths


def write_outputs(results: dict, output_dir: str | os.PathLike) -> dict[str, Path]:
    """results.json, results.md (the table) and accuracy.png in `output_dir`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, table_path, plot_path = (
        output_dir / "results.json",
        output_dir / "results.md",
        output_dir / "accuracy.png",
    )
    write_json_atomic(results, json_path)
    write_text_atomic(results_table(results) + "\n", table_path)
    plot_results(results, plot_path)
    return {"json": json_path, "table": table_path, "plot": plot_path}
