"""The one flag style of every `iha` command: `--snake_case`, also accepted as `--kebab-case`.

`iha sft` takes transformers' and TRL's training arguments through `HfArgumentParser`, which names every flag after
its field (`--model_name_or_path`) and accepts the dashed spelling too (`--model-name-or-path`). The other commands
build their parsers with `ArgumentParser` below, which does the same for every option however it is declared: help
shows `--num_pseudo_heads NUM_PSEUDO_HEADS, --num-pseudo-heads NUM_PSEUDO_HEADS` and both spellings parse, so
scripts written with either keep working.
"""

import argparse


def option_spellings(option: str) -> list[str]:
    """`--num-pseudo-heads` or `--num_pseudo_heads` -> ["--num_pseudo_heads", "--num-pseudo-heads"]; short options
    and one-word options unchanged."""
    if not option.startswith("--") or ("-" not in option[2:] and "_" not in option[2:]):
        return [option]
    name = option[2:]
    return [f"--{name.replace('-', '_')}", f"--{name.replace('_', '-')}"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and appends "(default: ...)" to every option with a real default."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in help_text or not action.option_strings or unset:
            return help_text
        return f"{help_text} (default: %(default)s)"


class _SpelledOptions:
    """Gives every long option added to an argparse container (parser, argument group, mutually exclusive group)
    both spellings, and makes the groups it creates do the same."""

    def add_argument(self, *name_or_flags, **kwargs):
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

    def add_argument_group(self, *args, **kwargs):
        group = _ArgumentGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group


def spell_options(name_or_flags) -> list[str]:
    spelled = []
    for option in name_or_flags:
        spelled += [spelling for spelling in option_spellings(option) if spelling not in spelled]
    return spelled
