"""`python -m research.ab`: does converting to IHA pay off? SFT of a Llama-style model as it is (arm A) against SFT of
its exact IHA conversion (arm B), same data, order, steps, optimizer and seeds. Headline: the per-token loss of the
GSM8K test problems' reference solutions, teacher-forced and paired per problem; then validation loss, test accuracy
with paired tests, the power of the run, the drift of the mixing from identity.

    python -m research.ab --preset cpu --output_dir runs/ab-cpu     # SmolLM2-135M-Instruct, 2 seeds per arm, CPU
    python -m research.ab --preset gpu --output_dir runs/ab-gpu     # all of GSM8K, 3 seeds, one CUDA device
    python -m research.ab --preset cpu --train_data gsm8k_train.jsonl --test_data gsm8k_test.jsonl --output_dir runs/ab-cpu

Every field of the preset can be changed with its flag. Calling the same command again reuses the finished runs in
OUTPUT_DIR and resumes an interrupted training from its last checkpoint; other settings are refused (--fresh starts
over, or choose a new --output_dir).
"""

import argparse
import os
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
from iha.evaluation.settings import SamplingConfig
from iha.utils.model_source import check_model_source

from .config import NESTED, PRESETS, ABConfig, ABTraining, preset_config


def make_parser(prog: str = "python -m research.ab") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__, allow_abbrev=False)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="starting settings (default: cpu)")
    parser.add_argument("--output-dir", default=None, help="where runs and report go (default: ab-PRESET)")
    parser.add_argument("--fresh", action="store_true", help="remove an earlier A/B run in OUTPUT_DIR and start over")
    add_threads_argument(parser)
    # The A/B's settings, then those it holds of two other kinds: TRL's SFT fields and the evaluation's sampling.
    add_dataclass_arguments(parser, ABConfig, from_preset=True, exclude=NESTED)
    add_dataclass_arguments(parser, ABTraining, "training (TRL's SFTConfig fields, both arms)", from_preset=True)
    add_dataclass_arguments(
        parser, SamplingConfig, "sampling (a sampled pass when --num_samples > 1)", from_preset=True
    )
    return parser


def config_from_args(args: argparse.Namespace) -> ABConfig:
    settings = dataclass_values(args, ABConfig, exclude=NESTED)
    for kind in NESTED.values():
        settings.update(dataclass_values(args, kind))
    config = preset_config(args.preset, **settings)
    if config.model is not None:
        check_model_source(config.model)
    if args.preset == "tiny" and config.model is None:
        raise ValueError("the tiny preset is sized for a tiny model: pass one as --model (a Llama-style folder)")
    return config


def main(argv: Sequence[str] | None = None, prog: str = "python -m research.ab") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser(prog).parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    output_dir = args.output_dir or f"ab-{args.preset}"

    def ab() -> int:
        # Imported here: the experiment loads TRL, peft and datasets, which `python -m research.ab --help` does not need.
        from .experiment import run_ab

        set_threads(args.threads)
        config = config_from_args(args)
        run_ab(config, output_dir, fresh=args.fresh, command=shlex.join([*prog.split(), *argv]))
        return 0

    return run_command(
        prog,
        ab,
        interrupted=f"finished runs stay in {output_dir}; the same command resumes",
    )
