"""`iha chat-template`: write a chat template with {% generation %} markers (`iha.training.chat_template`)."""

from collections.abc import Sequence

from ..utils.model_source import check_model_source
from .arguments import ArgumentParser
from .running import run_command


def make_parser(prog: str = "iha chat-template") -> ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        description="Write a chat template with {% generation %} markers (for assistant_only_loss) as a .jinja file.",
    )
    parser.add_argument("output", help="where to write the template (.jinja)")
    parser.add_argument(
        "--tokenizer", help="model or tokenizer folder whose template to patch (default: SmolLM2's ChatML template)"
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "iha chat-template") -> int:
    """`iha chat-template OUTPUT [--tokenizer FOLDER]`: a template that cannot be marked ends with one line, exit 2."""
    args = make_parser(prog).parse_args(argv)

    def write() -> int:
        # Imported here: the training wing loads TRL and peft, which `--help` and a bad flag do not need.
        from transformers import AutoTokenizer

        from ..training.chat_template import SMOLLM2_TRAINING_CHAT_TEMPLATE, training_chat_template, write_chat_template

        if args.tokenizer is None:
            template = SMOLLM2_TRAINING_CHAT_TEMPLATE
        else:
            template = training_chat_template(AutoTokenizer.from_pretrained(check_model_source(args.tokenizer)))
        print(f"Wrote {write_chat_template(template, args.output)}")
        return 0

    return run_command(prog, write)
