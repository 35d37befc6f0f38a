"""`iha` command line: one entry point for every job of the package.

iha demo        convert SmolLM2-135M-Instruct, verify, fine-tune briefly, evaluate, save (offline)
iha convert     convert a Llama / Qwen / SmolLM / Mistral / Gemma 3 checkpoint to IHA   (same as `iha-convert`)
iha sft         reasoning SFT with TRL, full or LoRA                     (same as `iha-sft`)
iha eval        GSM8K / MATH-500 / needle-in-a-haystack evaluation       (same as `iha-eval`)
iha card        the IHA model card of a folder `trl sft` trained
iha push        upload an IHA folder to the Hub                          (same as `iha-convert push`)
iha data        SFT data: GSM8K to OpenThoughts rows, any schema to `messages` rows
iha chat-template  a chat template with {% generation %} markers
iha export      `llama`: a P = 1 folder folded into a stock Llama / Mistral / Qwen2; `mlx`: mlx-lm's model file
iha serve       an OpenAI-compatible server for an IHA model (local and small-scale; continuous batching)

Every command takes its flags as `--snake_case` (transformers' and TRL's style), each also as `--kebab-case`
(`iha.cli.arguments`). The console scripts `iha`, `iha-convert`, `iha-sft` and `iha-eval` are `main`, `convert`, `sft`
and `evaluate` below (`python -m iha.cli` is `iha`). Each command is a module of `iha.cli` with `make_parser(prog)`
and `main(argv, prog)`, whose work runs in `iha.cli.running.run_command`: one exit-status protocol for all.

The research tasks are not commands of the package: they run from a checkout of the repository as
`python -m research.synthetic`, `python -m research.polynomial_filter` and `python -m research.ab` (research/, which
the wheel does not contain). `iha synthetic`, `iha polynomial-filter` and `iha ab` say so (`MOVED`).
"""

import importlib
import sys
from collections.abc import Sequence

from ..conversion.architectures import SUPPORTED_FAMILIES
from ..utils.optional_packages import quiet_bitsandbytes_kernels_notice
from .arguments import version_text
from .running import report_error


# name -> one-line summary. Command NAME is the module `iha.cli.NAME` (dashes as underscores), with
# `make_parser(prog)` and `main(argv, prog)`; it imports what its work needs when it runs.
COMMANDS = {
    "demo": "convert, verify, fine-tune, evaluate and save SmolLM2-135M-Instruct as IHA (offline)",
    "convert": f"convert a {SUPPORTED_FAMILIES} checkpoint to IHA",
    "sft": "supervised fine-tuning (OpenThoughts-style reasoning) with TRL",
    "eval": "math (GSM8K, MATH-500) and long-context retrieval evaluation",
    "card": "write the IHA model card of a folder `trl sft` trained (base, how to load)",
    "push": "upload an IHA folder (converted or fine-tuned) to the Hugging Face Hub",
    "data": "SFT data: GSM8K rows to OpenThoughts format, any row schema to `messages` rows",
    "chat-template": "write a chat template with {% generation %} markers (.jinja)",
    "export": "a P = 1 IHA folder as a stock Llama/Mistral/Qwen2 folder; the MLX model file for mlx-lm",
    "serve": "an OpenAI-compatible server for an IHA model (local and small-scale; continuous batching)",
}

# Former commands -> the module that runs them now, with the same flags (from a checkout of the repository).
MOVED = {
    "ab": "research.ab",
    "synthetic": "research.synthetic",
    "polynomial-filter": "research.polynomial_filter",
}


def moved_text(command: str) -> str:
    """The one line `iha COMMAND` answers for a command that left the package."""
    return (
        f"iha: `iha {command}` moved out of the package: run `python -m {MOVED[command]}` with the same flags, from "
        "the root of a checkout of the iha repository (research/)"
    )


def command_module(command: str) -> str:
    return f"iha.cli.{command.replace('-', '_')}"


def usage() -> str:
    lines = ["usage: iha COMMAND [options]   (iha COMMAND --help for a command's options)", "", "commands:"]
    lines += [f"  {name:<17} {summary}" for name, summary in COMMANDS.items()]
    lines += ["", "Flags are written --snake_case; --kebab-case works too. iha --version: the installed release."]
    return "\n".join(lines)


def run(command: str, argv: Sequence[str], prog: str | None = None) -> int:
    """Run one command: its `main` parses the command line once, under the command's name (`--help` and bad flags
    end there), then does the work.

    `prog` is what usage lines call the command (`iha convert` when run through `iha`; the console script's own
    name, `iha-convert`, otherwise). Its work runs in `iha.cli.running.run_command`, which decides the exit status of
    every failure; a package missing when the command's module is imported ends it the same way (one line naming the
    pip command, exit 2)."""
    argv, prog_kwargs = list(argv), {} if prog is None else {"prog": prog}
    quiet_bitsandbytes_kernels_notice()
    if command == "convert" and argv[:1] == ["push"]:  # `iha-convert push` is `iha push`, with the other Hub code
        command, argv = "push", argv[1:]
        prog_kwargs = {"prog": f"{prog or 'iha-convert'} push"}
    try:
        result = importlib.import_module(command_module(command)).main(argv, **prog_kwargs)
    except ModuleNotFoundError as error:
        status = report_error(prog or f"iha-{command}", error)
        if status is None:
            raise
        return status
    # Commands return an exit status; a few return the object they built (a trainer) on success.
    return result if isinstance(result, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(version_text() % {"prog": "iha"})
        return 0
    command, rest = argv[0], argv[1:]
    if command in MOVED:
        print(moved_text(command), file=sys.stderr)
        return 2
    if command not in COMMANDS:
        print(f"iha: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return run(command, rest, prog=f"iha {command}")


def convert() -> int:
    """`iha-convert` (the same as `iha convert`)."""
    return run("convert", sys.argv[1:])


def sft() -> int:
    """`iha-sft` (the same as `iha sft`)."""
    return run("sft", sys.argv[1:])


def evaluate() -> int:
    """`iha-eval` (the same as `iha eval`)."""
    return run("eval", sys.argv[1:])
