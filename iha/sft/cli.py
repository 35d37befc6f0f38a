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
"""`iha-sft` / `iha sft`: the command line over `train_sft`.

Two parsers of the same dataclasses. `make_parser()` holds the flags of `iha.sft.arguments` (model, data, IHA
training), made by `iha.arguments.add_dataclass_arguments` as transformers' `HfArgumentParser` declares them, and is
built without TRL: `--help` lists them without loading TRL, and the `iha` dispatcher checks a command line with it
before the run. `make_trl_parser()` is the `HfArgumentParser` over them and TRL's `SFTConfig` (~200 flags more:
`--learning_rate`, `--max_length`, `--packing`, ...); the run parses its command line with it, and `--help_trl`
prints the package's flags, then the training ones.
"""

import argparse
import logging
import sys
import typing
from collections.abc import Sequence
from dataclasses import asdict

from ..arguments import ArgumentParser, add_dataclass_arguments
from ..command_line import run_command
from ..convert import ConversionError, IHAConversionOptions
from .arguments import DataArguments, IHATrainingArguments, ModelArguments


if typing.TYPE_CHECKING:
    from .config import IHASFTConfig
    from .trainer import IHASFTTrainer


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


# The flags `IHASFTConfig` adds to or changes in TRL's `SFTConfig`, shown in their own group before TRL's.
ARGUMENT_GROUPS = {"model (iha)": ModelArguments, "data (iha)": DataArguments, "IHA training": IHATrainingArguments}
USAGE = "%(prog)s --model_name_or_path MODEL --dataset_name DATA [flags below]   or   %(prog)s CONFIG.yaml"
DESCRIPTION = (
    "Reasoning SFT with TRL of an IHA model, or of a Llama-style one converted on the fly: full fine-tuning or LoRA."
)
TRL_FLAGS = """Every flag of TRL's SFTConfig is accepted too, transformers' TrainingArguments among them (--output_dir,
--learning_rate, --num_train_epochs, --per_device_train_batch_size, --max_length, --packing, --use_cpu, ...):
`iha-sft --help_trl` lists them all (it loads TRL, which takes a few seconds)."""
TRAINING_FLAGS = """training: TRL's SFTConfig, transformers' TrainingArguments among them, with the IHA training flags above
(the same flags, listed again with TRL's):"""


def is_config_file(argv: Sequence[str]) -> bool:
    """`iha-sft CONFIG.yaml` (or .json): every flag is read from the file."""
    return len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json"))


class SFTArgumentParser(ArgumentParser):
    """`make_parser()`: checks the flags it declares and leaves the others (TRL's) to the run's `HfArgumentParser`."""

    def parse_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if is_config_file(args):
            return argparse.Namespace(config_file=args[0])
        return self.parse_known_args(args, namespace)[0]


class PrintTRLHelp(argparse.Action):
    """Every flag of a run: the package's own (`make_parser()`'s help), then the training ones (`IHASFTConfig`)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from transformers import HfArgumentParser

        from .config import IHASFTConfig

        training = HfArgumentParser(IHASFTConfig, usage=argparse.SUPPRESS, add_help=False)
        print(make_parser().format_help())
        print(f"{TRAINING_FLAGS}\n\n{training.format_help()}", end="")
        parser.exit()


def make_parser() -> SFTArgumentParser:
    """`iha-sft`'s own flags (model, data, IHA training), built without TRL: what `--help` shows."""
    # TRL's flags are not declared here: an abbreviation must not be taken for one of the flags that are.
    parser = SFTArgumentParser(
        prog="iha-sft", usage=USAGE, description=DESCRIPTION, epilog=TRL_FLAGS, allow_abbrev=False
    )
    parser.add_argument("--help_trl", action=PrintTRLHelp, help="show every flag, TRL's SFTConfig ones included")
    for title, dataclass_type in ARGUMENT_GROUPS.items():
        add_dataclass_arguments(parser, dataclass_type, title)
    return parser


def make_trl_parser():
    """Every flag of a run: `HfArgumentParser` over `ModelArguments`, `DataArguments` and `IHASFTConfig` (TRL's
    `SFTConfig` + the IHA training flags). Its `--help` (and `--help_trl`) lists the package's own first, then TRL's
    ~200."""
    from transformers import HfArgumentParser

    from .config import IHASFTConfig

    parser = HfArgumentParser(
        (ModelArguments, DataArguments, IHASFTConfig), prog="iha-sft", usage=USAGE, add_help=False
    )
    parser.add_argument("-h", "--help", "--help_trl", "--help-trl", action=PrintTRLHelp, help="show every flag")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> "tuple[ModelArguments, DataArguments, IHASFTConfig]":
    """The command line of a run (every flag, TRL's included), or the one .yaml / .json file holding its flags."""
    parser = make_trl_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not is_config_file(argv):
        return parser.parse_args_into_dataclasses(args=argv)
    read = parser.parse_yaml_file if argv[0].endswith((".yaml", ".yml")) else parser.parse_json_file
    try:
        return read(argv[0])
    except TypeError as error:  # the dataclasses' own message: "... missing 1 required positional argument: 'x'"
        raise ValueError(f"{argv[0]}: {error}; add the missing setting to the file.") from None


def run_cli(argv: Sequence[str] | None = None) -> "IHASFTTrainer":
    """What `iha-sft` runs, returning the trainer: the flags of `IHASFTConfig` (TRL's `SFTConfig` + mixing lr / wd),
    `ModelArguments` and `DataArguments`, or one .yaml / .json file holding them."""
    from pathlib import Path

    from transformers import AutoTokenizer
    from trl import get_quantization_config

    from .model import iha_lora_config
    from .outputs import merge_lora
    from .train import train_sft

    model_args, data_args, training_args = parse_args(argv)
    iha_options = asdict(IHAConversionOptions.from_json(model_args.iha_options)) if model_args.iha_options else None
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    training_args.model_init_kwargs = {
        **(training_args.model_init_kwargs or {}),
        "dtype": model_args.dtype,
        "attn_implementation": model_args.attn_implementation,
        "revision": model_args.model_revision,
    }
    tokenizer = None
    if model_args.tokenizer_name_or_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.tokenizer_name_or_path, trust_remote_code=training_args.trust_remote_code
        )
    peft_config = None
    if model_args.use_peft:
        peft_config = iha_lora_config(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=model_args.lora_target_modules,
            modules_to_save=model_args.lora_modules_to_save,
        )
    trainer = train_sft(
        model_args.model_name_or_path,
        data_args.dataset_name,
        training_args,
        processing_class=tokenizer,
        eval_dataset=data_args.eval_dataset_name if training_args.eval_strategy != "no" else None,
        peft_config=peft_config,
        quantization_config=get_quantization_config(model_args),
        convert_to_iha=model_args.convert_to_iha,
        iha_options=iha_options,
        dataset_config_name=data_args.dataset_config,
        dataset_train_split=data_args.dataset_train_split,
        dataset_test_split=data_args.dataset_test_split,
        default_system_prompt=data_args.default_system_prompt,
        max_train_rows=data_args.max_train_rows,
        filter_long_rows=data_args.filter_long_rows,
        resume_from_checkpoint=training_args.resume_from_checkpoint,
    )
    trainer.accelerator.print(f"Saved to {training_args.output_dir}.")
    if model_args.use_peft and model_args.merge_adapter:
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            merged_dir = merge_lora(training_args.output_dir, Path(training_args.output_dir) / "merged")
            trainer.accelerator.print(f"Merged model saved to {merged_dir}.")
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # finish the trackers, destroy the process group
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    """`iha-sft` / `iha sft` / `python -m iha.sft` (`--help_trl` for every flag; `iha-sft --help`, answered by the
    `iha` dispatcher, for the package's own).

    The run's parser (`make_trl_parser`) reads the command line; under `iha-sft` / `iha sft` the dispatcher has
    checked the package's own flags first (`iha.cli.run`), so `python -m iha.sft --help` lists TRL's flags too.

    Bad input prints one line (exit 2); Ctrl-C / SIGTERM exit 130 / 143, keeping the checkpoints already saved in
    OUTPUT_DIR (`--resume_from_checkpoint true` continues from the last one).
    """

    def sft() -> int:
        run_cli(argv)
        return 0

    return run_command(
        "iha-sft",
        sft,
        errors=(ValueError, ConversionError),
        interrupted="the checkpoints saved so far stay in the output folder; the final model was not saved",
    )
