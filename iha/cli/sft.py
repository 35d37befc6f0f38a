"""`iha-sft` / `iha sft`: the command line over `train_sft`, shaped like TRL's `scripts/sft.py`.

One parser, TRL's (`TrlParser`), over the three configs `train_sft` takes, each TRL's own with the package's settings
added (`iha.training.config`): `IHAModelConfig` (TRL's `ModelConfig`: the model, `--dtype`, the LoRA and quantization
flags; with `--convert_to_iha`, `--iha_options`), `IHAScriptArguments` (TRL's `ScriptArguments`: `--dataset_name`,
the splits; with `--default_system_prompt`, `--max_train_rows`, ...) and `IHASFTConfig` (TRL's `SFTConfig`,
transformers' `TrainingArguments` among them, with the mixing's learning rate and weight decay). Every flag means what
it means to `trl sft`; `--config FILE.yaml` (or `iha-sft FILE.yaml`) reads flags from a file, as in TRL. `--help`
lists them all (it loads TRL), the package's own marked "(iha)".
"""

import logging
import sys
import typing
from collections.abc import Sequence

from trl import TrlParser

from ..training.config import IHAModelConfig, IHAScriptArguments, IHASFTConfig
from ..training.process_exit import exit_after_deepspeed_run
from ..training.train import train_sft
from .arguments import HelpFormatter, version_text
from .running import run_command


if typing.TYPE_CHECKING:
    from ..training.trainer import IHASFTTrainer


USAGE = "%(prog)s --model_name_or_path MODEL --dataset_name DATA [flags below]   or   %(prog)s CONFIG.yaml"
DESCRIPTION = (
    "Reasoning SFT with TRL of an IHA model, or of a Llama-style one converted on the fly: full fine-tuning, LoRA or "
    "QLoRA. TRL's flags mean what they mean to `trl sft`; the package's own say (iha) first."
)


class SFTArguments(typing.NamedTuple):
    """A run's parsed configs, one per dataclass of the parser, in the order `--help` lists them."""

    model: IHAModelConfig
    script: IHAScriptArguments
    training: IHASFTConfig


# The parser's dataclasses: SFTArguments' field types, so the two cannot disagree on the order.
ARGUMENT_DATACLASSES = tuple(typing.get_type_hints(SFTArguments).values())


def is_config_file(argv: Sequence[str]) -> bool:
    """`iha-sft CONFIG.yaml` (or .json): every flag is read from the file (TRL's `--config CONFIG.yaml`)."""
    return len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json"))


def make_parser(prog: str = "iha-sft") -> TrlParser:
    """Every flag of a run: TRL's `TrlParser` over `ARGUMENT_DATACLASSES`."""
    # HelpFormatter: each flag in its --snake_case spelling only, as every `iha` command lists them. No abbreviated
    # flags, as in every `iha` parser (`iha.cli.arguments`).
    parser = TrlParser(
        ARGUMENT_DATACLASSES,
        prog=prog,
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=version_text(), help="print the version and exit")
    return parser


def check_arguments(arguments: SFTArguments) -> None:
    """What the configs leave optional but a run of `iha-sft` needs: one clear error each (what no run can do, the
    configs refuse themselves)."""
    if arguments.model.model_name_or_path is None:
        raise ValueError(
            "--model_name_or_path is required: the IHA folder to fine-tune, or a Llama-style checkpoint to convert "
            "on the fly (on the command line or in the config file)."
        )
    if arguments.script.dataset_name is None:
        raise ValueError(
            "--dataset_name is required: a Hub dataset id, or a local .json / .jsonl / .parquet file or folder (on "
            "the command line or in the config file)."
        )


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
    """What `iha-sft` runs, returning the trainer: TRL's script's main, the configs parsed and handed to
    `train_sft`."""
    model_args, script_args, training_args = parse_args(argv, prog)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    trainer = train_sft(script_args, training_args, model_args)
    trainer.accelerator.print(f"Saved to {training_args.output_dir}.")
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # finish the trackers, destroy the process group
    return trainer


def main(argv: Sequence[str] | None = None, prog: str = "iha-sft") -> int:
    """`iha-sft` / `iha sft`: parses the command line once (`parse_args`) and trains.

    Bad input prints one line (exit 2); Ctrl-C / SIGTERM exit 130 / 143, keeping the checkpoints already saved in
    OUTPUT_DIR (`--resume_from_checkpoint true` continues from the last one). A DeepSpeed run does not return: its
    process exits through `exit_after_deepspeed_run` (iha/training/process_exit.py says why), so call `main` as a
    process's entry point, not from a notebook.
    """
    ran_deepspeed = False

    def sft() -> int:
        nonlocal ran_deepspeed
        trainer = run_cli(argv, prog)
        ran_deepspeed = trainer.is_deepspeed_enabled
        return 0

    status = run_command(
        prog,
        sft,
        interrupted="the checkpoints saved so far stay in the output folder; the final model was not saved",
    )
    if ran_deepspeed:
        # Everything is saved and the process group is gone; outside run_command, so a signal during the exit
        # handlers ends the process as at any exit.
        exit_after_deepspeed_run(status)
    return status
