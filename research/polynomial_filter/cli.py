"""`python -m research.polynomial_filter`: the trained polynomial-filter comparison (`research.polynomial_filter`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from iha.cli.arguments import (
    ArgumentParser,
    add_dataclass_arguments,
    add_threads_argument,
    dataclass_values,
    set_threads,
)
from iha.cli.running import run_command

from .config import PolynomialConfig
from .experiment import run_experiment
from .report import render_markdown


# Flags that say where runs come from or whether to train, not what a run is: the command a report records as the
# one that reproduces it leaves them out (its runs are the same without them).
SOURCE_FLAGS = {"--runs-from": 1, "--report-only": 0}


def make_parser(prog: str = "python -m research.polynomial_filter") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description="Train MHA (ceil(sqrt(k)) and k heads) and IHA (ceil(sqrt(k)) heads, P = the same) on the "
        "polynomial filter [X, AX, ..., A^(k-1) X] (k = 4 by default: MHA 2 and 4 heads, IHA 2 heads at P = 2; "
        "--order 9: MHA 3 and 9, IHA 3 at P = 3), linear and softmax attention; report.md/.json and error.png in "
        "OUTPUT_DIR. Resumes after every finished run; a finished report with the same settings is re-rendered, "
        "not retrained.",
    )
    parser.add_argument("--output-dir", default="runs/polynomial-filter", help="writes report.md/.json, error.png")
    add_dataclass_arguments(parser, PolynomialConfig, "settings")
    parser.add_argument(
        "--runs-from",
        action="append",
        default=[],
        metavar="DIR",
        help="also reuse the runs saved in DIR (runs.partial.json, report.json) with the same settings, e.g. the "
        "folder of a process that ran one --attentions kind (repeatable)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: report the saved runs (the report says which runs are missing)",
    )
    add_threads_argument(parser)
    return parser


def reproducing_command(prog: str, argv: Sequence[str]) -> str:
    """The command line without the flags of `SOURCE_FLAGS` (with their values): the one that makes these runs."""
    kept, skip = [], 0
    for argument in argv:
        if skip:
            skip -= 1
            continue
        name = argument.split("=", 1)[0]
        if name in SOURCE_FLAGS:
            skip = SOURCE_FLAGS[name] if "=" not in argument else 0
            continue
        kept.append(argument)
    return " ".join([prog, *map(shlex.quote, kept)])  # quoted as a shell reads it back ("IHA H=3 P=3")


def main(argv: Sequence[str] | None = None, prog: str = "python -m research.polynomial_filter") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser(prog).parse_args(argv)
    set_threads(args.threads)

    def run() -> int:
        config = PolynomialConfig(**dataclass_values(args, PolynomialConfig))
        report = run_experiment(
            config,
            args.output_dir,
            command=reproducing_command(prog, argv),
            runs_from=args.runs_from,
            train=not args.report_only,
        )
        print(render_markdown(config, report["summary"], report["runs"], report["command"]))
        return 0

    return run_command(
        prog,
        run,
        interrupted=f"the finished runs are in {args.output_dir}/runs.partial.json; the same command continues them",
    )
