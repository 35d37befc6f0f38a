"""`iha push`: upload an IHA folder to the Hugging Face Hub (`iha.hub.push`)."""

import argparse
from collections.abc import Sequence

from ..hub.push import (
    push_to_hub,
)
from .arguments import ArgumentParser
from .running import run_command


def make_parser(prog: str = "iha push") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        description="Upload an IHA folder (converted or fine-tuned) to the Hugging Face Hub in one commit. The "
        "uploaded model card loads the model from REPO_ID; the folder itself is not modified.",
    )
    parser.add_argument("folder", help="the IHA model folder (config.json with an IHA model_type: 'iha', ...)")
    parser.add_argument("repo_id", help="Hub repository, USER/NAME or ORG/NAME (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", help="Hub token (default: the logged-in one, `hf auth login`)")
    parser.add_argument("--revision", help="branch to upload to (default: main)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "iha push") -> int:
    """`iha push` (also `iha-convert push`)."""
    args = make_parser(prog).parse_args(argv)

    def upload() -> int:
        url = push_to_hub(
            args.folder,
            args.repo_id,
            private=args.private or None,
            token=args.token,
            revision=args.revision,
            retry_command=prog,
        )
        print(f"Uploaded {args.folder} to {url}", flush=True)
        return 0

    # One line for a failed upload (exit 1) or Ctrl-C (130); the folder is never modified either way.
    return run_command(prog, upload)
