"""`iha card`: write the IHA model card of a folder `trl sft` trained (`iha.training.card`)."""

from collections.abc import Sequence
from pathlib import Path

from ..utils.model_source import check_model_source
from .arguments import ArgumentParser
from .running import run_command


def make_parser(prog: str = "iha card") -> ArgumentParser:
    """`iha card FOLDER --base-model BASE`."""
    parser = ArgumentParser(
        prog=prog,
        description="Rewrite the model card a trainer wrote into FOLDER (e.g. `trl sft`, whose card names no local "
        "base and loads without trust_remote_code) as an IHA card; the trainer's other sections are kept.",
    )
    parser.add_argument("folder", help="the training output folder (its README.md is rewritten in place)")
    parser.add_argument("--base-model", required=True, help="the IHA model it was trained from: folder or Hub id")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "iha card") -> int:
    """`iha card FOLDER --base-model BASE`: the IHA card for a folder `trl sft` (or another trainer) wrote."""
    args = make_parser(prog).parse_args(argv)

    def write_card() -> int:
        # Imported here: the training wing loads TRL and peft, which `--help` and a bad flag do not need.
        from ..training.card import rewrite_trainer_card

        check_model_source(args.folder, hub=False)
        check_model_source(args.base_model)
        folder = Path(args.folder)
        if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
            raise ValueError(f"{args.folder} holds no model (no config.json or adapter_config.json).")
        print(f"Wrote {rewrite_trainer_card(args.folder, args.base_model)}")
        return 0

    return run_command(prog, write_card)
