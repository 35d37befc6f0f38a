"""`iha polynomial-filter`: the trained polynomial-filter comparison (`iha.experiments.synthetic.polynomial`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from ..experiments.synthetic.polynomial import (
    PolynomialConfig,
    render_markdown,
    run_experiment,
)
from .arguments import ArgumentParser, add_dataclass_arguments, dataclass_values
from .running import run_command


def make_parser(prog: str = "iha polynomial-filter") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        description="Train MHA (2 and 4 heads) and IHA (2 heads, P = 2) on the order-4 polynomial filter "
        "[X, AX, A^2 X, A^3 X], linear and softmax attention; report.md/.json and error.png in OUTPUT_DIR.",
    )
    parser.add_argument("--output-dir", default="runs/polynomial-filter", help="writes report.md/.json, error.png")
    add_dataclass_arguments(parser, PolynomialConfig, "settings")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "iha polynomial-filter") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser(prog).parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def run() -> int:
        config = PolynomialConfig(**dataclass_values(args, PolynomialConfig))
        report = run_experiment(config, args.output_dir, command=" ".join([prog, *argv]))
        print(render_markdown(config, report["summary"], report["runs"], report["command"]))
        return 0

    return run_command(
        prog,
        run,
        errors=(ValueError,),
        interrupted=f"the report in {args.output_dir} is written only when all runs end",
    )
