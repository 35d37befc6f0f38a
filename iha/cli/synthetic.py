"""`iha synthetic`: the command line (train the preset's comparison over seeds, resume, summarize)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from filelock import FileLock

from ..experiments.synthetic.config import PRESET_SEEDS, PRESETS, SyntheticConfig
from ..experiments.synthetic.outputs import write_outputs, write_seed_summary
from ..experiments.synthetic.relations import relation_tests
from ..experiments.synthetic.report import results_table
from ..experiments.synthetic.train import (
    config_as_saved,
    epoch_states,
    lock_path,
    model_variants,
    run_comparison,
    runs_in_progress,
    same_config,
)
from .arguments import ArgumentParser, add_dataclass_arguments, add_threads_argument, dataclass_values, set_threads
from .running import run_command


def _parse_m(values: list[str] | None) -> dict[str, list[int]] | None:
    """TASK=SIZE (every example that m) or TASK=LOW-HIGH (m drawn per example) -> {task: [low, high]}."""
    if not values:
        return None
    sizes = {}
    for value in values:
        task, separator, size = value.partition("=")
        low, dash, high = size.partition("-")
        high = high if dash else low
        if not separator or not low.isdigit() or not high.isdigit():
            raise SystemExit(f"--m takes TASK=SIZE or TASK=LOW-HIGH (e.g. binary=6 or binary=6-10), got {value!r}")
        sizes[task] = [int(low), int(high)]
    return sizes


def make_parser(prog: str = "iha synthetic") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        description="Relation composition (paper appendix): MHA, 2-simplicial attention and IHA, one bidirectional "
        "attention layer trained from scratch.",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="cpu: the full comparison shrunk for 2 CPU cores (75-107 min of one thread a seed; default); "
        "paper: the paper's scale (for a GPU); paper-regime: the paper's m ranges, data, both learning rates, MHA, "
        "IHA P = 8 and 2-simplicial, at most 10 epochs: an estimated ~9 minutes a seed on one GPU, not measured yet "
        "(days on a CPU, resumable); "
        "paper-ternary: the paper's data and width for ternary at m = 5 "
        "(hours of one thread a run; start the same command twice to share the runs between two processes); "
        "fixed: every example at m = 6 / 5, MHA and IHA only; tiny: seconds",
    )
    parser.add_argument(
        "--output-dir", default="runs/synthetic", help="writes results.json/.md and accuracy.png (default: %(default)s)"
    )
    # The settings of `SyntheticConfig`, each as a flag of its field, but the matrix sizes (`--m TASK=SIZE`).
    settings = parser.add_argument_group("settings of the comparison")
    settings.add_argument(
        "--m",
        nargs="+",
        default=None,
        metavar="TASK=SIZE",
        help="matrix size per task: binary=6 (every example) or binary=6-10 (drawn per example) "
        "(default: the preset's)",
    )
    add_dataclass_arguments(settings, SyntheticConfig, from_preset=True, exclude=["m"])
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="one comparison per seed (in OUTPUT_DIR/seed-N), then seeds.md/.json/.png: mean and spread over seeds "
        "(default: the preset's seeds, 0 1 2 for cpu and paper)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda when there is one, else cpu)")
    add_threads_argument(parser)
    parser.add_argument(
        "--summarize",
        nargs="+",
        default=None,
        metavar="RESULTS_JSON",
        help="no training: write seeds.md/.json/.png (mean and spread over the seeds of these results.json files)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="no training: write seeds.md/.json/.png and curves.png in OUTPUT_DIR from the runs the same command "
        "(same preset and settings) has finished so far; the unfinished runs are named as such, and the ones in "
        "progress shown as far as they got",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="run everything again: ignore (and replace) the finished runs of an earlier call in OUTPUT_DIR "
        "(results.partial.json of an interrupted call, results.json of a finished one)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "iha synthetic") -> int:
    args = make_parser(prog).parse_args(argv)
    return run_command(
        prog,
        lambda: _run(args),
        interrupted=f"the runs finished so far are kept in {args.output_dir}: the same command resumes from them",
    )


def _read_results(path: str) -> dict:
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from None
    if not isinstance(results, dict) or not {"config", "runs"} <= set(results):
        raise ValueError(f"{path} is not a results.json written by `iha synthetic`.")
    return results


def _run(args: argparse.Namespace) -> int:

    if args.summarize:
        results_per_seed = [_read_results(path) for path in args.summarize]
        # A run's weights are named relative to its results file.
        relations = relation_tests(results_per_seed, [Path(path).parent for path in args.summarize], args.device)
        paths = write_seed_summary(results_per_seed, args.output_dir, relations=relations)
        print(paths["table"].read_text(encoding="utf-8"))
        return 0
    if args.seed is not None and args.seeds is not None:
        raise SystemExit("Give either --seed or --seeds, not both.")
    overrides = {**dataclass_values(args, SyntheticConfig, exclude=["m", "seed"]), "m": _parse_m(args.m)}
    preset = PRESETS[args.preset]
    if overrides["m"] is not None:
        overrides["m"] = {**preset.m, **overrides["m"]}
    config = replace(preset, **{key: value for key, value in overrides.items() if value is not None})
    set_threads(args.threads)
    seeds = args.seeds or ([args.seed] if args.seed is not None else PRESET_SEEDS[args.preset])
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds must be distinct, got {seeds}.")
    output_dir = Path(args.output_dir)
    if args.report:
        results_per_seed, in_progress, seed_dirs = [], [], []
        for seed in seeds:
            seed_dir = output_dir if len(seeds) == 1 else output_dir / f"seed-{seed}"
            seed_dirs.append(seed_dir)
            results_per_seed.append(_finished_so_far(replace(config, seed=seed), seed_dir))
            in_progress += runs_in_progress(replace(config, seed=seed), seed_dir / "results.partial.json")
        relations = relation_tests(results_per_seed, seed_dirs, args.device)
        paths = write_seed_summary(results_per_seed, output_dir, in_progress, relations)
        print(paths["table"].read_text(encoding="utf-8"))
        print("wrote " + ", ".join(str(path) for path in paths.values()))
        return 0
    if len(seeds) > 1 and not args.fresh:
        _train_cheap_models_first(config, seeds, output_dir, args.device)
    results_per_seed, seed_dirs = [], []
    for seed in seeds:
        # Several seeds: one complete comparison per seed in its own folder, then their mean and spread.
        seed_dir = output_dir if len(seeds) == 1 else output_dir / f"seed-{seed}"
        seed_dirs.append(seed_dir)
        results_per_seed.append(_run_and_write(replace(config, seed=seed), seed_dir, args.fresh, args.device))
    if len(seeds) > 1:
        # Every run has finished: no run is in progress, so an earlier --report's in_progress.json and curves of
        # unfinished runs are replaced, not left beside the final tables.
        relations = relation_tests(results_per_seed, seed_dirs, args.device)
        paths = write_seed_summary(results_per_seed, output_dir, in_progress=[], relations=relations)
        print("\n" + paths["table"].read_text(encoding="utf-8"))
        print("wrote " + ", ".join(str(path) for path in paths.values()))
    return 0


def _finished_so_far(config: SyntheticConfig, seed_dir: Path) -> dict:
    """The runs of `config` finished in `seed_dir`: its results.json, else its results.partial.json (a running or
    interrupted call), else none; a file of another configuration is refused."""

    for name in ("results.json", "results.partial.json"):
        path = seed_dir / name
        if path.is_file():
            results = _read_results(str(path))
            if not same_config(results["config"], config):
                raise ValueError(
                    f"{path} holds runs of another configuration: give --report the preset and settings that made it."
                )
            return results
    return {"config": config_as_saved(config), "runs": []}


def _work_in_cost_order(config: SyntheticConfig) -> list[set[tuple[str, str]]]:
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


def _train_cheap_models_first(config: SyntheticConfig, seeds: list[int], output_dir: Path, device: str | None) -> None:
    """Several seeds: train every seed's MHA and IHA P = 2 first, then the costly models (`_work_in_cost_order`),
    so that an interrupted call has whole models over all seeds. Runs go to each seed's checkpoint; the outputs are
    written afterwards. A run another process is training (the same command started twice) is left to it."""

    for only in _work_in_cost_order(config):
        for seed in seeds:
            seed_config = replace(config, seed=seed)
            seed_dir = output_dir / f"seed-{seed}"
            finished = seed_dir / "results.json"
            if finished.is_file():
                saved = json.loads(finished.read_text(encoding="utf-8"))
                if same_config(saved.get("config"), seed_config):
                    continue  # done; another configuration is refused by _run_and_write
                return
            run_comparison(
                seed_config,
                checkpoint=seed_dir / "results.partial.json",
                device=device,
                only=only,
                wait_for_others=False,
            )


def _run_and_write(config: SyntheticConfig, output_dir: Path, fresh: bool, device: str | None = None) -> dict:
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
