"""`iha data`: write GSM8K rows as OpenThoughts rows, or rows of any supported schema as `messages` rows."""

from collections.abc import Sequence

from ..data.gsm8k import gsm8k_file_to_openthoughts
from ..data.messages import load_sft_dataset, without_system_prompt, write_jsonl
from .arguments import ArgumentParser, positive_int
from .running import run_command


def make_parser(prog: str = "iha data") -> ArgumentParser:
    """`iha data`: write GSM8K rows as OpenThoughts rows, or any supported schema as
    `messages` rows (the form in which TRL's own `trl sft` keeps the system prompt)."""
    parser = ArgumentParser(prog=prog, description=make_parser.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gsm8k = commands.add_parser("gsm8k-to-openthoughts", help="GSM8K (Hub id or .jsonl) -> OpenThoughts-114k .jsonl")
    gsm8k.add_argument("source", help="a Hub dataset id (openai/gsm8k) or your own GSM8K .jsonl file")
    gsm8k.add_argument("output", help="the .jsonl file to write")
    gsm8k.add_argument("--split", default="train", help="Hub split (default: train)")
    gsm8k.add_argument("--limit", type=positive_int, help="convert the first N rows only")
    gsm8k.add_argument(
        "--without_system_prompt",
        action="store_true",
        help="leave out OpenThoughts' system prompt (the chat template's own default, if any, takes its place)",
    )
    messages = commands.add_parser("to-messages", help="any supported schema (Hub id or file) -> messages .jsonl")
    messages.add_argument("source", help="Hub dataset id, or .json / .jsonl / .parquet file or folder")
    messages.add_argument("output")
    messages.add_argument("--split", default="train")
    messages.add_argument("--config_name")
    messages.add_argument("--max_rows", type=positive_int)
    messages.add_argument(
        "--default_system_prompt", help="system prompt for rows without one; 'openthoughts' = the OpenThoughts one"
    )
    return parser


def write_rows(args) -> int:
    """What `iha data COMMAND` does once its arguments are parsed; a bad row raises `DataFormatError`."""
    if args.command == "gsm8k-to-openthoughts":
        rows = gsm8k_file_to_openthoughts(args.source, limit=args.limit, split=args.split)
        if args.without_system_prompt:
            rows = [without_system_prompt(row) for row in rows]
    else:
        dataset = load_sft_dataset(args.source, args.split, args.config_name, args.default_system_prompt, args.max_rows)
        rows = ({"messages": row["messages"]} for row in dataset)
    print(f"Wrote {write_jsonl(rows, args.output)}")
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "iha data") -> int:
    """`iha data` (see `make_parser`): bad rows end with one line and exit 2."""
    args = make_parser(prog).parse_args(argv)
    return run_command(f"{prog} {args.command}", lambda: write_rows(args))


__all__ = ["main", "make_parser"]
