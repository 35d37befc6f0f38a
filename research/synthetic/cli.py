"""`python -m research.synthetic`: the command line of the relation-composition comparison; what a call does is
`research.synthetic.experiment` (train the preset's comparison over seeds, resume, report, summarize)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from iha.cli.arguments import (
    ArgumentParser,
    add_dataclass_arguments,
    add_threads_argument,
    dataclass_values,
    set_threads,
)
from iha.cli.running import run_command

from .config import PRESET_SEEDS, PRESETS, SyntheticConfig
from .experiment import report_so_far, run_seeds, summarize_results


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


def make_parser(prog: str = "python -m research.synthetic") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description="Relation composition (paper appendix): MHA, 2-simplicial attention and IHA, one bidirectional "
        "attention layer trained from scratch.",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="cpu: the full comparison shrunk for 2 CPU cores (75-107 min of one thread a seed; default); "
        "paper: the paper's scale (for a GPU); paper-regime: the paper's m ranges, data, both learning rates, MHA, "
        "IHA P = 8 and 2-simplicial, at most 10 epochs (so patience 10 never acts): an estimated 4-11 minutes a seed "
        "on one GPU, not measured yet "
        "(days on a CPU, resumable); "
        "paper-ternary: the paper's data and width for ternary at m = 5 "
        "(hours of one thread a run; start the same command twice to share the runs between two processes); "
        "paper-ternary-mha: paper-ternary's MHA for 100 epochs without early stopping (IHA P = 8's budget); "
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


def main(argv: list[str] | None = None, prog: str = "python -m research.synthetic") -> int:
    args = make_parser(prog).parse_args(argv)
    return run_command(
        prog,
        lambda: _run(args),
        interrupted=f"the runs finished so far are kept in {args.output_dir}: the same command resumes from them",
    )


def _run(args: argparse.Namespace) -> int:

    if args.summarize:
        paths = summarize_results(args.summarize, args.output_dir, args.device)
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
    if args.report:
        paths = report_so_far(config, seeds, args.output_dir, args.device)
        print(paths["table"].read_text(encoding="utf-8"))
        print("wrote " + ", ".join(str(path) for path in paths.values()))
        return 0
    paths = run_seeds(config, seeds, args.output_dir, args.device, args.fresh)
    if paths is not None:
        print("\n" + paths["table"].read_text(encoding="utf-8"))
        print("wrote " + ", ".join(str(path) for path in paths.values()))
    return 0
