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
"""`iha-sft` / `iha sft`: the command line over `train_sft`."""

import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from transformers import AutoTokenizer, HfArgumentParser

import iha  # noqa: F401  (registers IHAConfig / IHAForCausalLM with the Auto classes)

from ..atomic_folders import run_command
from ..convert import ConversionError, IHAConversionOptions
from .config import DataArguments, IHASFTConfig, ModelArguments
from .model import iha_lora_config
from .outputs import merge_lora
from .train import train_sft
from .trainer import IHASFTTrainer


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


# The flags `IHASFTConfig` adds to or changes in TRL's `SFTConfig`, shown in their own group before TRL's.
IHA_TRAINING_FLAGS = ("mixing_learning_rate", "mixing_weight_decay", "assistant_only_loss", "bf16")


def make_parser() -> HfArgumentParser:
    """`iha-sft`'s flags. `--help` lists the package's own first (model, data, IHA training), then TRL's ~200."""
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, IHASFTConfig),
        prog="iha-sft",
        usage="%(prog)s --model_name_or_path MODEL --dataset_name DATA [flags below]   or   %(prog)s CONFIG.yaml",
    )
    # HfArgumentParser puts every field into the parser's one "options" group, in dataclass order: the few IHA
    # flags would come after ~800 lines of TRL's. Regroup them (argparse prints groups in list order).
    groups = {
        "model (iha)": [f.name for f in fields(ModelArguments)],
        "data (iha)": [f.name for f in fields(DataArguments)],
        "IHA training": list(IHA_TRAINING_FLAGS),
    }
    options = parser._optionals
    options.title = "training (TRL's SFTConfig and transformers' TrainingArguments)"
    groups = [parser.add_argument_group("help")]
    groups[0]._group_actions = [action for action in options._group_actions if action.dest == "help"]
    for title, names in (("model (iha)", fields(ModelArguments)), ("data (iha)", fields(DataArguments))):
        groups.append(parser.add_argument_group(title))
        groups[-1]._group_actions = [
            action for action in options._group_actions if action.dest in {f.name for f in names}
        ]
    groups.append(parser.add_argument_group("IHA training"))
    groups[-1]._group_actions = [action for action in options._group_actions if action.dest in IHA_TRAINING_FLAGS]
    moved = {id(action) for group in groups for action in group._group_actions}
    options._group_actions = [action for action in options._group_actions if id(action) not in moved]
    parser._action_groups = [parser._positionals, *groups, options]
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[ModelArguments, DataArguments, IHASFTConfig]:
    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        return parser.parse_yaml_file(argv[0])
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    return parser.parse_args_into_dataclasses(args=argv)


def run_cli(argv: Sequence[str] | None = None) -> IHASFTTrainer:
    """What `iha-sft` runs, returning the trainer: the flags of `IHASFTConfig` (TRL's `SFTConfig` + mixing lr / wd),
    `ModelArguments` and `DataArguments`, or one .yaml / .json file holding them."""
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
    """`iha-sft` / `iha sft` / `python -m iha.sft` (run `--help` for every flag).

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
