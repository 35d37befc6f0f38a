"""`iha-convert SRC DST [options]` (also `iha convert`), and `iha-convert push FOLDER REPO_ID` (the same as `iha push`).

The IHA, output, source and verification flags are generated from the fields of `IHAConversionOptions` and
`CheckpointOptions` by `iha.cli.arguments.add_dataclass_arguments` (`num_pseudo_heads` -> `--num_pseudo_heads`, also
spelled `--num-pseudo-heads` as every `iha` flag; a setting that is on by default, like `verify`, also gets a
`--no_...` flag); only what belongs to the command line itself (`--push_to_hub`, `--private`, `--quiet`) is written
here. `make_parser(prog)` builds the parser (`prog`: `iha convert` under the dispatcher); `main(argv, prog)` runs it.
`iha-convert push` is routed to `iha push` by the dispatcher (`iha.cli.main.run`).
"""

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from .. import conversion
from ..conversion.architectures import SUPPORTED_DESCRIPTION
from ..conversion.checkpoint import convert_checkpoint
from ..conversion.options import CheckpointOptions, IHAConversionOptions
from ..conversion.plan import describe_layers
from ..hub.push import push_to_hub
from ..utils import atomic_folders
from .arguments import ArgumentParser, add_dataclass_arguments, dataclass_values
from .running import run_command


DESCRIPTION = (
    f"Convert a pretrained checkpoint to Interleaved Head Attention. Supported: {SUPPORTED_DESCRIPTION}. The "
    "defaults are exact: the converted model computes what the source computed. To upload an existing converted "
    "folder: iha-convert push FOLDER REPO_ID."
)


def make_parser(prog: str = "iha-convert") -> argparse.ArgumentParser:
    """The `iha-convert` parser."""
    parser = ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("source", help="local checkpoint folder or Hub model id (org/name)")
    parser.add_argument("output_dir", help="folder to write; must not exist or be empty unless --overwrite")
    add_dataclass_arguments(parser, IHAConversionOptions, "IHA settings", beside_positionals=True)
    add_dataclass_arguments(parser, CheckpointOptions, beside_positionals=True)
    hub_group = parser.add_argument_group("Hub")
    hub_group.add_argument("--push_to_hub", metavar="REPO_ID", help="upload the converted folder to this Hub repo")
    hub_group.add_argument("--private", action="store_true", help="create the Hub repo as private")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bars or progress messages")
    return parser


def print_report(report, write: Callable[[str], None]) -> None:
    write(f"Converted {report.source} ({report.architecture}) -> {report.output_dir}")
    write(
        f"  P={report.num_pseudo_heads}, IHA layers {describe_layers(report.iha_layers) or 'none'} of "
        f"{len(report.attention_types)}, mask {report.options.mask_mode}, positions {report.options.position_mode}, "
        f"collapse {report.options.collapse_mode}/{report.options.collapse_init}, dtype {report.dtype}, files {', '.join(report.weight_files)}"
    )
    if report.verification is not None:
        write(f"  verification: {report.verification.message}")
    else:
        write("  verification: skipped (--no_verify)")


def run_conversion(args: argparse.Namespace, prog: str) -> int:
    """What `iha-convert SRC DST` does once its arguments are parsed; failures propagate to `run_command`, which
    gives them their exit status (a failed verification or upload: 1)."""
    options = IHAConversionOptions(**dataclass_values(args, IHAConversionOptions))
    checkpoint_options = CheckpointOptions(**dataclass_values(args, CheckpointOptions))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    # The conversion's own messages (every module of iha.conversion logs under it) and the atomic folder's.
    loggers = [logging.getLogger(conversion.__name__), atomic_folders.logger]
    previous_levels = [each.level for each in loggers]
    for each in loggers:
        each.addHandler(handler)
        each.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        report = convert_checkpoint(
            args.source, args.output_dir, options, checkpoint_options, show_progress=not args.quiet
        )
    finally:
        for each, level in zip(loggers, previous_levels):
            each.removeHandler(handler)
            each.setLevel(level)
    print_report(report, lambda message: print(message, flush=True))
    if args.push_to_hub:
        url = push_to_hub(
            report.output_dir,
            args.push_to_hub,
            private=args.private or None,
            token=checkpoint_options.token,
            retry_command=f"{prog} push",
        )
        print(f"Uploaded to {url}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "iha-convert") -> int:
    """`iha-convert SRC DST [options]`: the exit status, 0 on success.

    Bad input prints one line and exits 2, a failed verification or upload 1 (`iha.cli.running`); Ctrl-C, SIGTERM
    and SIGHUP remove everything the run wrote and exit with 128 + the signal number (130 for Ctrl-C).
    """
    args = make_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_command(
        prog,
        lambda: run_conversion(args, prog),
        interrupted=f"nothing was written to {args.output_dir}",
    )
