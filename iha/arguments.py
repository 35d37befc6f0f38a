"""The one flag style of every `iha` command: `--snake_case`, also accepted as `--kebab-case`.

`iha sft` takes transformers' and TRL's training arguments through `HfArgumentParser`, which names every flag after
its field (`--model_name_or_path`) and accepts the dashed spelling too (`--model-name-or-path`). The other commands
build their parsers with `ArgumentParser` below, which does the same for every option however it is declared: both
spellings parse, so scripts written with either keep working, and help lists each flag once, as `--snake_case`
(`--num_pseudo_heads NUM_PSEUDO_HEADS`). A yes/no option is `--flag` / `--no_flag`, as in `HfArgumentParser`.
Every parser answers `--version`.
"""

import argparse
import copy
import importlib.metadata


def option_spellings(option: str) -> list[str]:
    """`--num-pseudo-heads` or `--num_pseudo_heads` -> ["--num_pseudo_heads", "--num-pseudo-heads"]; short options
    and one-word options unchanged."""
    if not option.startswith("--") or ("-" not in option[2:] and "_" not in option[2:]):
        return [option]
    name = option[2:]
    return [f"--{name.replace('-', '_')}", f"--{name.replace('_', '-')}"]


def is_canonical(option: str) -> bool:
    """Whether `option` is the spelling help shows (`--snake_case`; the `--kebab-case` alias is not listed)."""
    return option == option_spellings(option)[0]


def version_text() -> str:
    """`--version`: the package's release and the torch and transformers it runs with (read without importing them)."""
    from . import __version__

    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"%(prog)s {__version__} (transformers {installed('transformers')}, torch {installed('torch')})"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout, lists each option in its canonical spelling only, and appends
    "(default: ...)" to every option with a real default whose help does not already name one."""

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = copy.copy(action)
        shown.option_strings = [option for option in action.option_strings if is_canonical(option)]
        return super()._format_action_invocation(shown)

    def _get_help_string(self, action):
        help_text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in help_text or not action.option_strings or unset:
            return help_text
        return f"{help_text} (default: %(default)s)"


class BooleanFlag(argparse.Action):
    """`--flag` sets True, `--no_flag` False (each also dashed): argparse's `BooleanOptionalAction` in the one flag
    style (argparse would make `--no-flag_name` of `--flag_name`)."""

    def __init__(self, option_strings, dest, default=None, required=False, help=None):
        negatives = spell_options([f"--no_{option[2:]}" for option in option_strings if option.startswith("--")])
        self.negative_options = set(negatives)
        super().__init__([*option_strings, *negatives], dest, nargs=0, default=default, required=required, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negative_options)

    def format_usage(self) -> str:
        return " | ".join(option for option in self.option_strings if is_canonical(option))


class _SpelledOptions:
    """Gives every long option added to an argparse container (parser, argument group, mutually exclusive group)
    both spellings, and makes the groups it creates do the same."""

    def add_argument(self, *name_or_flags, **kwargs):
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            kwargs["action"] = BooleanFlag
        return super().add_argument(*spell_options(name_or_flags), **kwargs)

    def add_mutually_exclusive_group(self, **kwargs):
        group = _MutuallyExclusiveGroup(self, **kwargs)
        self._mutually_exclusive_groups.append(group)
        return group


class _ArgumentGroup(_SpelledOptions, argparse._ArgumentGroup):
    pass


class _MutuallyExclusiveGroup(_SpelledOptions, argparse._MutuallyExclusiveGroup):
    pass


class ArgumentParser(_SpelledOptions, argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose long options have one canonical spelling (`--snake_case`) and a dashed alias,
    also in its argument groups and mutually exclusive groups.

    Subparsers (`add_subparsers().add_parser`) are of this class too, and use `HelpFormatter` unless told otherwise.
    """

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
        if self.add_help:
            self.add_argument("--version", action="version", version=version_text(), help="print the version and exit")

    def add_argument_group(self, *args, **kwargs):
        group = _ArgumentGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group


def rename_prog(parser: argparse.ArgumentParser, prog: str) -> None:
    """Call `parser` (and the usage lines of its subcommands) `prog`: `iha convert` rather than `iha-convert`."""
    previous, parser.prog = parser.prog, prog
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                rename_prog(subparser, subparser.prog.replace(previous, prog, 1))


def spell_options(name_or_flags) -> list[str]:
    spelled = []
    for option in name_or_flags:
        spelled += [spelling for spelling in option_spellings(option) if spelling not in spelled]
    return spelled
