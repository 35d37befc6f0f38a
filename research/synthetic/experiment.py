"""A whole `python -m research.synthetic` call, apart from its command line: every seed's comparison (resumed from what earlier calls
left, the cheap models of every seed first), the summary over seeds, a report of what has finished so far, and a
summary of given results files.

Each seed's comparison lives in its own folder (OUTPUT_DIR/seed-N; OUTPUT_DIR itself for a single seed): its
checkpoint `results.partial.json`, the epoch states of its unfinished runs (`.epochs/`), the weights of its finished
ones (`weights/`), and once every run has finished `results.json`, `results.md` and `accuracy.png`. Several
processes of the same call share the runs (`checkpoints.claim`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

from filelock import FileLock

from .checkpoints import config_as_saved, epoch_states, lock_path, runs_in_progress, same_config
from .config import SyntheticConfig, model_variants
from .outputs import write_outputs, write_seed_summary
from .relations import relation_tests
from .report import results_table
from .train import run_comparison


def seed_folder(output_dir: str | os.PathLike, seed: int, seeds: list[int]) -> Path:
    """Where a seed's comparison lives: OUTPUT_DIR/seed-N with several seeds, OUTPUT_DIR with one."""
    return Path(output_dir) if len(seeds) == 1 else Path(output_dir) / f"seed-{seed}"


def read_results(path: str | os.PathLike) -> dict:
    """A results.json (or results.partial.json) written by `python -m research.synthetic`; anything else is refused."""
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from None
    if not isinstance(results, dict) or not {"config", "runs"} <= set(results):
        raise ValueError(f"{path} is not a results.json written by `python -m research.synthetic`.")
    return results


def summarize_results(paths: list[str], output_dir: str | os.PathLike, device: str | None = None) -> dict[str, Path]:
    """seeds.md/.json/.png (and the per-relation tests) of the given results files; no training."""
    results_per_seed = [read_results(path) for path in paths]
    # A run's weights are named relative to its results file.
    relations = relation_tests(results_per_seed, [Path(path).parent for path in paths], device)
    return write_seed_summary(results_per_seed, output_dir, relations=relations)


def report_so_far(
    config: SyntheticConfig, seeds: list[int], output_dir: str | os.PathLike, device: str | None = None
) -> dict[str, Path]:
    """seeds.md/.json/.png and curves.png in `output_dir` from the runs of `config` finished so far over `seeds`,
    the unfinished ones named and the ones in progress as far as they got; no training."""
    results_per_seed, in_progress, seed_dirs = [], [], []
    for seed in seeds:
        seed_dir = seed_folder(output_dir, seed, seeds)
        seed_dirs.append(seed_dir)
        results_per_seed.append(finished_so_far(replace(config, seed=seed), seed_dir))
        in_progress += runs_in_progress(replace(config, seed=seed), seed_dir / "results.partial.json")
    relations = relation_tests(results_per_seed, seed_dirs, device)
    return write_seed_summary(results_per_seed, output_dir, in_progress, relations)


def run_seeds(
    config: SyntheticConfig,
    seeds: list[int],
    output_dir: str | os.PathLike,
    device: str | None = None,
    fresh: bool = False,
) -> dict[str, Path] | None:
    """Every seed's comparison (resumed unless `fresh`), then with several seeds their summary (whose paths are
    returned; None for one seed)."""
    output_dir = Path(output_dir)
    if len(seeds) > 1 and not fresh:
        train_cheap_models_first(config, seeds, output_dir, device)
    results_per_seed, seed_dirs = [], []
    for seed in seeds:
        # Several seeds: one complete comparison per seed in its own folder, then their mean and spread.
        seed_dir = seed_folder(output_dir, seed, seeds)
        seed_dirs.append(seed_dir)
        results_per_seed.append(run_and_write(replace(config, seed=seed), seed_dir, fresh, device))
    if len(seeds) == 1:
        return None
    # Every run has finished: no run is in progress, so an earlier --report's in_progress.json and curves of
    # unfinished runs are replaced, not left beside the final tables.
    relations = relation_tests(results_per_seed, seed_dirs, device)
    return write_seed_summary(results_per_seed, output_dir, in_progress=[], relations=relations)


def finished_so_far(config: SyntheticConfig, seed_dir: Path) -> dict:
    """The runs of `config` finished in `seed_dir`: its results.json, else its results.partial.json (a running or
    interrupted call), else none; a file of another configuration is refused."""

    for name in ("results.json", "results.partial.json"):
        path = seed_dir / name
        if path.is_file():
            results = read_results(path)
            if not same_config(results["config"], config):
                raise ValueError(
                    f"{path} holds runs of another configuration: give --report the preset and settings that made it."
                )
            return results
    return {"config": config_as_saved(config), "runs": []}


def work_in_cost_order(config: SyntheticConfig) -> list[set[tuple[str, str]]]:
    """The (task, model) runs of a comparison in passes, cheapest first: MHA and IHA with P <= 2 of every task;
    then per task (the smallest largest m first) IHA with P > 2 (P m^2 pseudo-tokens), then 2-simplicial (m^4 pairs
    of keys per query)."""

    cheap = {"MHA", "IHA P=1", "IHA P=2"}
    names = [name for name, _, _ in model_variants(config)]
    passes = [{(task, name) for task in config.tasks for name in names if name in cheap}]
    for task in sorted(config.tasks, key=lambda task: config.m[task][1]):
        passes += [{(task, name)} for name in names if name not in cheap and name != "2-simplicial"]
        passes += [{(task, name)} for name in names if name == "2-simplicial"]
    return passes


def train_cheap_models_first(config: SyntheticConfig, seeds: list[int], output_dir: Path, device: str | None) -> None:
    """Several seeds: train every seed's MHA and IHA P = 2 first, then the costly models (`work_in_cost_order`),
    so that an interrupted call has whole models over all seeds. Runs go to each seed's checkpoint; the outputs are
    written afterwards. A run another process is training (the same command started twice) is left to it."""

    for only in work_in_cost_order(config):
        for seed in seeds:
            seed_config = replace(config, seed=seed)
            seed_dir = output_dir / f"seed-{seed}"
            finished = seed_dir / "results.json"
            if finished.is_file():
                saved = json.loads(finished.read_text(encoding="utf-8"))
                if same_config(saved.get("config"), seed_config):
                    continue  # done; another configuration is refused by run_and_write
                return
            run_comparison(
                seed_config,
                checkpoint=seed_dir / "results.partial.json",
                device=device,
                only=only,
                wait_for_others=False,
            )


def run_and_write(config: SyntheticConfig, output_dir: Path, fresh: bool, device: str | None = None) -> dict:
    """One comparison (resuming from `output_dir`'s checkpoint unless `fresh`), its outputs written to `output_dir`.

    A finished comparison of the same configuration already in `output_dir` is reused rather than recomputed (so
    `--seeds` picks up where an interrupted call stopped); one of another configuration is never overwritten
    unless `fresh`.
    """

    checkpoint = output_dir / "results.partial.json"
    # One process at a time finishes a comparison (another one running the same command waits, then reuses it).
    lock_path(checkpoint, "finish").parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock_path(checkpoint, "finish")):
        return _finish_comparison(config, output_dir, fresh, device)


def _finish_comparison(config: SyntheticConfig, output_dir: Path, fresh: bool, device: str | None) -> dict:

    checkpoint = output_dir / "results.partial.json"
    finished = output_dir / "results.json"
    if fresh:
        checkpoint.unlink(missing_ok=True)
        for state in epoch_states(checkpoint):
            state.unlink()
    elif finished.is_file():
        saved = json.loads(finished.read_text(encoding="utf-8"))
        if same_config(saved.get("config"), config):
            print(f"{finished}: this comparison has already run; reusing it (--fresh runs it again).")
            return saved
        raise SystemExit(
            f"{finished} holds a comparison with another configuration: pass --fresh to replace it, or choose "
            "another --output-dir."
        )
    start = time.perf_counter()
    results = run_comparison(config, checkpoint=checkpoint, device=device)
    results["wall_seconds"] = time.perf_counter() - start  # this call only (resumed runs are not counted)
    results["train_seconds_total"] = sum(run["train_seconds"] for run in results["runs"])
    paths = write_outputs(results, output_dir)
    checkpoint.unlink(missing_ok=True)
    print(results_table(results))
    print(
        f"\nseed {config.seed}: training time {results['train_seconds_total'] / 60:.1f} min "
        f"(this call {results['wall_seconds'] / 60:.1f} min); wrote " + ", ".join(str(p) for p in paths.values())
    )
    return results
