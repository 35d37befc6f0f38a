# Copyright 2026 The iha authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""`iha ab`: does converting to IHA pay off? SFT of a Llama-style model as it is (arm A) against SFT of its exact IHA
conversion (arm B), same data, order, steps, optimizer and seeds. Headline: the per-token loss of the GSM8K test
problems' reference solutions, teacher-forced and paired per problem; then validation loss, test accuracy with
paired tests, the power of the run, the drift of the mixing from identity.

    iha ab --preset cpu --output_dir runs/ab-cpu                    # SmolLM2-135M-Instruct, 2 seeds per arm, CPU
    iha ab --preset gpu --output_dir runs/ab-gpu                    # all of GSM8K, 3 seeds, one CUDA device
    iha ab --preset cpu --train_data gsm8k_train.jsonl --test_data gsm8k_test.jsonl --output_dir runs/ab-cpu

Every field of the preset can be changed with its flag. Calling the same command again reuses the finished runs in
OUTPUT_DIR and resumes an interrupted training from its last checkpoint; other settings are refused (--fresh starts
over, or choose a new --output_dir).
"""

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from ..arguments import ArgumentParser, add_dataclass_arguments, dataclass_values
from ..command_line import run_command
from ..convert import ConversionError
from .config import PRESETS, ABConfig, preset_config


def make_parser(prog: str = "iha ab") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="starting settings (default: cpu)")
    parser.add_argument("--output-dir", default=None, help="where runs and report go (default: ab-PRESET)")
    parser.add_argument("--fresh", action="store_true", help="remove an earlier A/B run in OUTPUT_DIR and start over")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads of torch (default: torch's; 1 on cores other jobs share)"
    )
    add_dataclass_arguments(parser, ABConfig, from_preset=True)
    return parser


def config_from_args(args: argparse.Namespace) -> ABConfig:
    config = preset_config(args.preset, **dataclass_values(args, ABConfig))
    if args.preset == "tiny" and config.model is None:
        raise ValueError("the tiny preset is sized for a tiny model: pass one as --model (a Llama-style folder)")
    return config


def main(argv: Sequence[str] | None = None, prog: str = "iha ab") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    output_dir = args.output_dir or f"ab-{args.preset}"

    def ab() -> int:
        from .experiment import run_ab

        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)

        config = config_from_args(args)
        run_ab(config, output_dir, fresh=args.fresh, command=shlex.join(["iha", "ab", *argv]))
        return 0

    return run_command(
        prog,
        ab,
        errors=(ValueError, ConversionError),
        interrupted=f"finished runs stay in {output_dir}; the same command resumes",
    )


if __name__ == "__main__":
    sys.exit(main())
