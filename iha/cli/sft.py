"""`iha-sft` / `iha sft`: the command line over `train_sft`.

One parser, TRL's (`TrlParser`), over TRL's own dataclasses and the package's beside them: TRL's `ModelConfig` (the
model, `--dtype`, the LoRA and quantization flags) and `IHAModelArguments`, TRL's `ScriptArguments` (`--dataset_name`,
the splits) and `IHADataArguments`, and `IHASFTConfig` (TRL's `SFTConfig`, transformers' `TrainingArguments` among
them, with the mixing's learning rate and weight decay). Every flag means what it means to `trl sft`; `--config
FILE.yaml` (or `iha-sft FILE.yaml`) reads flags from a file, as in TRL. `--help` lists them all (it loads TRL).
"""

import logging
import sys
import typing
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from transformers import AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_quantization_config

from ..conversion import IHAConversionOptions
from ..training.arguments import IHADataArguments, IHAModelArguments
from ..training.config import IHASFTConfig
from ..training.model import iha_peft_config
from ..training.outputs import merge_lora
from ..training.train import train_sft
from ..utils.model_source import check_model_source
from .arguments import HelpFormatter, version_text
from .running import run_command


if typing.TYPE_CHECKING:
    from ..training.trainer import IHASFTTrainer


USAGE = "%(prog)s --model_name_or_path MODEL --dataset_name DATA [flags below]   or   %(prog)s CONFIG.yaml"
DESCRIPTION = (
    "Reasoning SFT with TRL of an IHA model, or of a Llama-style one converted on the fly: full fine-tuning, LoRA or "
    "QLoRA. TRL's flags mean what they mean to `trl sft`; the package's own are --mixing_learning_rate, "
    "--mixing_weight_decay and the groups marked (iha) at the end."
)


class SFTArguments(typing.NamedTuple):
    """A run's arguments, one per dataclass of the parser, in the order `--help` lists them."""

    model: ModelConfig
    iha_model: IHAModelArguments
    script: ScriptArguments
    data: IHADataArguments
    training: IHASFTConfig


# The parser's dataclasses: SFTArguments' field types, so the two cannot disagree on the order.
ARGUMENT_DATACLASSES = tuple(typing.get_type_hints(SFTArguments).values())


def is_config_file(argv: Sequence[str]) -> bool:
    """`iha-sft CONFIG.yaml` (or .json): every flag is read from the file (TRL's `--config CONFIG.yaml`)."""
    return len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json"))


def make_parser(prog: str = "iha-sft") -> TrlParser:
    """Every flag of a run: TRL's `TrlParser` over `ARGUMENT_DATACLASSES`."""
    # HelpFormatter: each flag in its --snake_case spelling only, as every `iha` command lists them.
    parser = TrlParser(
        ARGUMENT_DATACLASSES, prog=prog, usage=USAGE, description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=version_text(), help="print the version and exit")
    return parser


def check_arguments(arguments: SFTArguments) -> None:
    """What TRL's dataclasses leave optional or accept but a run of `iha-sft` cannot do: one clear error each."""
    model, script = arguments.model, arguments.script
    if model.model_name_or_path is None:
        raise ValueError(
            "--model_name_or_path is required: the IHA folder to fine-tune, or a Llama-style checkpoint to convert "
            "on the fly (on the command line or in the config file)."
        )
    if script.dataset_name is None:
        raise ValueError(
            "--dataset_name is required: a Hub dataset id, or a local .json / .jsonl / .parquet file or folder (on "
            "the command line or in the config file)."
        )
    if (model.load_in_4bit or model.load_in_8bit) and not model.use_peft:
        raise ValueError(
            "--load_in_4bit / --load_in_8bit freeze the base in a quantized form: train LoRA adapters on it "
            "with --use_peft (the IHA mixing is trained in full beside them)."
        )
    if script.dataset_streaming:
        raise ValueError(
            "--dataset_streaming is not supported: iha-sft reads the rows first to check their schema and drop "
            "those longer than --max_length; use --max_train_rows N to train on the first N rows."
        )
    if script.ignore_bias_buffers:
        raise ValueError("--ignore_bias_buffers has no effect in iha-sft (TRL reads it in its DDP preference scripts).")


def parse_args(argv: Sequence[str] | None = None, prog: str = "iha-sft") -> SFTArguments:
    """The command line of a run (every flag, TRL's included), or one .yaml / .json file holding its flags,
    checked (`check_arguments`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if is_config_file(argv):
        argv = ["--config", argv[0]]
    arguments = SFTArguments(*make_parser(prog).parse_args_and_config(argv))
    check_arguments(arguments)
    return arguments


def run_cli(argv: Sequence[str] | None = None, prog: str = "iha-sft") -> "IHASFTTrainer":
    """What `iha-sft` runs, returning the trainer: the flags of `ARGUMENT_DATACLASSES`, or one .yaml / .json file
    holding them. It reads as TRL's `scripts/sft.py`: the configs parsed, the model's loading settings from
    `ModelConfig`, the LoRA config from TRL's `get_peft_config` (`iha_peft_config`), then `train_sft`."""

    model, iha_model, script, data, training = parse_args(argv, prog)
    iha_options = asdict(IHAConversionOptions.from_json(iha_model.iha_options)) if iha_model.iha_options else None
    check_model_source(model.model_name_or_path)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    # As in TRL's script: the model flags, with the training config's own `model_init_kwargs` over them.
    training.model_init_kwargs = {
        "dtype": model.dtype,
        "attn_implementation": model.attn_implementation,
        "revision": model.model_revision,
        **(training.model_init_kwargs or {}),
    }
    tokenizer = None
    if iha_model.tokenizer_name_or_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(
            check_model_source(iha_model.tokenizer_name_or_path), trust_remote_code=training.trust_remote_code
        )
    trainer = train_sft(
        model.model_name_or_path,
        script.dataset_name,
        training,
        processing_class=tokenizer,
        eval_dataset=data.eval_dataset_name if training.eval_strategy != "no" else None,
        peft_config=iha_peft_config(model),
        quantization_config=get_quantization_config(model),
        convert_to_iha=iha_model.convert_to_iha,
        iha_options=iha_options,
        dataset_config_name=script.dataset_config,
        dataset_train_split=script.dataset_train_split,
        dataset_test_split=script.dataset_test_split,
        default_system_prompt=data.default_system_prompt,
        max_train_rows=data.max_train_rows,
        filter_long_rows=data.filter_long_rows,
        resume_from_checkpoint=training.resume_from_checkpoint,
    )
    trainer.accelerator.print(f"Saved to {training.output_dir}.")
    if model.use_peft and iha_model.merge_adapter:
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            merged_dir = merge_lora(training.output_dir, Path(training.output_dir) / "merged")
            trainer.accelerator.print(f"Merged model saved to {merged_dir}.")
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # finish the trackers, destroy the process group
    return trainer


def main(argv: Sequence[str] | None = None, prog: str = "iha-sft") -> int:
    """`iha-sft` / `iha sft`: parses the command line once (`parse_args`) and trains.

    Bad input prints one line (exit 2); Ctrl-C / SIGTERM exit 130 / 143, keeping the checkpoints already saved in
    OUTPUT_DIR (`--resume_from_checkpoint true` continues from the last one).
    """

    def sft() -> int:
        run_cli(argv, prog)
        return 0

    return run_command(
        prog,
        sft,
        interrupted="the checkpoints saved so far stay in the output folder; the final model was not saved",
    )
