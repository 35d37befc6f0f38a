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
"""`iha data`: write GSM8K rows as OpenThoughts rows, or rows of any supported schema as `messages` rows."""

import sys

from .arguments import ArgumentParser
from .data import OPENTHOUGHTS_SYSTEM_PROMPT, DataFormatError, load_sft_dataset, write_jsonl
from .gsm8k import gsm8k_file_to_openthoughts


def make_parser(prog: str = "iha data") -> ArgumentParser:
    """`iha data`: write GSM8K rows as OpenThoughts rows, or any supported schema as
    `messages` rows (the form in which TRL's own `trl sft` keeps the system prompt)."""
    parser = ArgumentParser(prog=prog, description=make_parser.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gsm8k = commands.add_parser("gsm8k-to-openthoughts", help="GSM8K (Hub id or .jsonl) -> OpenThoughts-114k .jsonl")
    gsm8k.add_argument("source", help="a Hub dataset id (openai/gsm8k) or your own GSM8K .jsonl file")
    gsm8k.add_argument("output", help="the .jsonl file to write")
    gsm8k.add_argument("--split", default="train", help="Hub split (default: train)")
    gsm8k.add_argument("--limit", type=int, help="convert the first N rows only")
    messages = commands.add_parser("to-messages", help="any supported schema (Hub id or file) -> messages .jsonl")
    messages.add_argument("source", help="Hub dataset id, or .json / .jsonl / .parquet file or folder")
    messages.add_argument("output")
    messages.add_argument("--split", default="train")
    messages.add_argument("--config_name")
    messages.add_argument("--max_rows", type=int)
    messages.add_argument(
        "--default_system_prompt", help="system prompt for rows without one; 'openthoughts' = the OpenThoughts one"
    )
    return parser


def main(argv=None, prog: str = "iha data"):
    """`iha data` (see `make_parser`)."""
    args = make_parser(prog).parse_args(argv)
    if args.command == "gsm8k-to-openthoughts":
        try:
            rows = gsm8k_file_to_openthoughts(args.source, limit=args.limit, split=args.split)
        except DataFormatError as error:
            print(f"iha data gsm8k-to-openthoughts: error: {error}", file=sys.stderr)
            return 2
    else:
        system = (
            OPENTHOUGHTS_SYSTEM_PROMPT if args.default_system_prompt == "openthoughts" else args.default_system_prompt
        )
        dataset = load_sft_dataset(args.source, args.split, args.config_name, system, args.max_rows)
        rows = ({"messages": row["messages"]} for row in dataset)
    path = write_jsonl(rows, args.output)
    print(f"Wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["main", "make_parser"]
