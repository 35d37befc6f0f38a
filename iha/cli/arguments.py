"""The one flag style of every `iha` command: `--snake_case`, also accepted as `--kebab-case`.

`iha sft` takes transformers' and TRL's arguments through TRL's parser (an `HfArgumentParser`), which names every
flag after its field (`--model_name_or_path`) and accepts the dashed spelling too (`--model-name-or-path`). The other
commands build their parsers with `ArgumentParser` below, which does the same for every option however it is
declared: both spellings parse, so scripts written with either keep working, and help lists each flag once, as `--snake_case`
(`--num_pseudo_heads NUM_PSEUDO_HEADS`). Every parser answers `--version`, and none accepts an abbreviated flag
(argparse's default takes `--max-step` for `--max-steps`, and would take it for another flag once one is added with the
same prefix: a script that ran yesterday would set something else today).

A command's settings dataclass becomes its flags in one way, `add_dataclass_arguments`, the way `HfArgumentParser`
declares them: one flag per field, named after it, typed by its annotation, with the field's metadata (`help`,
`choices`, `aliases`). Yes/no settings follow transformers' convention everywhere: `--flag` turns one on, `--flag
true|false` sets it, and a setting that is on by default (or may be, by a preset) also has `--no_flag`. A yes/no
option written by hand (`action=argparse.BooleanOptionalAction`) is `--flag` / `--no_flag`.
"""

import argparse
import copy
import dataclasses
import importlib.metadata
import math
import os
import types
import typing
from collections.abc import Collection, Mapping

from .. import __version__


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

    def __init__(self, *args, formatter_class=HelpFormatter, allow_abbrev=False, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, allow_abbrev=allow_abbrev, **kwargs)
        if self.add_help:
            self.add_argument("--version", action="version", version=version_text(), help="print the version and exit")

    def add_argument_group(self, *args, **kwargs):
        group = _ArgumentGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group


def spell_options(name_or_flags) -> list[str]:
    spelled = []
    for option in name_or_flags:
        spelled += [spelling for spelling in option_spellings(option) if spelling not in spelled]
    return spelled


# Field metadata that describes the command line but is no argument of `add_argument`: the argument group a flag is
# listed in, the help of a yes/no setting's `--no_` flag, and (`iha.conversion.options`) the `IHAConfig` field a
# setting fills.
NOT_ARGPARSE_METADATA = ("group", "config_field", "no_help")


def string_to_bool(value: str) -> bool:
    """`--flag VALUE` of a yes/no setting, read as transformers' `HfArgumentParser` reads it (`yes`, `true`, `1`, ...).
    transformers is imported when a value is read, not with the parser: `--help` and a bad flag need none of it."""
    from transformers.hf_argparser import string_to_bool as read_as_transformers_does

    return read_as_transformers_does(value)


def flag_type(annotation) -> tuple[type, bool]:
    """(what argparse converts each word to, whether the flag takes a list): `int | None` -> (int, False),
    `list[str] | None` -> (str, True); a union with str (`str | list[int]`, `int | str`) is read as str, and the
    dataclass checks what it holds."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        annotation = str if str in kinds else kinds[0]
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def add_dataclass_arguments(
    parser,
    dataclass_type,
    title: str | None = None,
    *,
    from_preset: bool | Mapping[str, object] = False,
    beside_positionals: bool = False,
    exclude: Collection[str] = (),
) -> None:
    """One flag per field of `dataclass_type`, declared as transformers' `HfArgumentParser` declares it, in the
    argument group named by the field's `group` metadata (else `title`; None: the parser's own options).

    `from_preset`: every flag defaults to None, "not given" (the command fills the field from a preset), and every
    yes/no setting has its `--no_` flag, since a preset may turn it on. Given the presets ({name: settings}), the
    help says what each sets (`(default: the preset's: greedy 1024, paper 4096)`).
    `beside_positionals`: the parser also takes positional arguments, so a yes/no flag takes no value (`--flag`;
    `--no_flag` for a setting that is on by default): `--flag [true|false]` would swallow the positional after it
    (`iha-convert --overwrite SRC DST`).
    `exclude`: fields that get no flag here (the command reads them its own way)."""
    hints = typing.get_type_hints(dataclass_type)
    presets = from_preset if isinstance(from_preset, Mapping) else {}

    def preset_values(name: str) -> str:
        if not presets:
            return ""
        return ": " + ", ".join(f"{preset} {getattr(settings, name)}" for preset, settings in presets.items())

    groups = {}
    for setting in dataclasses.fields(dataclass_type):
        if setting.name in exclude:
            continue
        kwargs = {key: value for key, value in setting.metadata.items() if key not in NOT_ARGPARSE_METADATA}
        options = spell_options([f"--{setting.name}", *kwargs.pop("aliases", ())])
        group_title = setting.metadata.get("group", title)
        if group_title is None:
            group = parser
        elif group_title in groups:
            group = groups[group_title]
        else:
            group = groups[group_title] = parser.add_argument_group(group_title)
        if setting.default is not dataclasses.MISSING:
            default = setting.default
        elif setting.default_factory is not dataclasses.MISSING:
            default = setting.default_factory()
        else:
            default = dataclasses.MISSING
        if from_preset:
            default = None
            if "default" not in kwargs.get("help", ""):  # a field whose help names its own default keeps it
                kwargs["help"] = kwargs.get("help", "") + " (default: the preset's" + preset_values(setting.name) + ")"
        kind, is_list = flag_type(hints[setting.name])
        if kind is bool:
            # `--flag` alone means yes, unless the setting may also be None ("not set": `--flag VALUE` only).
            if beside_positionals and hints[setting.name] is bool and not from_preset:
                kwargs.update(action="store_true", default=bool(default is not dataclasses.MISSING and default))
            else:
                kwargs["type"] = string_to_bool
                if hints[setting.name] is bool or setting.default not in (None, dataclasses.MISSING):
                    kwargs.update(nargs="?", const=True, default=False if default is dataclasses.MISSING else default)
                elif default is not dataclasses.MISSING:
                    kwargs["default"] = default
        else:
            kwargs["type"] = kind
            if is_list:
                kwargs["nargs"] = "+"
            if default is not dataclasses.MISSING:
                kwargs["default"] = default
            else:
                kwargs["required"] = True
        # Help of the `--no_` flag of a yes/no setting: the metadata's `no_help` where the field says what turning it
        # off does, else its `help`, as `HfArgumentParser` keeps it.
        no_help = {"help": setting.metadata.get("no_help", setting.metadata.get("help"))}
        group.add_argument(*options, **kwargs)
        if kind is bool and (setting.default is True or from_preset):
            group.add_argument(
                *spell_options([f"--no_{setting.name}"]),
                action="store_false",
                dest=setting.name,
                default=None if from_preset else False,
                **no_help,
            )


def dataclass_values(args: argparse.Namespace, dataclass_type, exclude: Collection[str] = ()) -> dict:
    """The fields of `dataclass_type` as parsed flags hold them (`dataclass_type(**dataclass_values(...))`), but
    those in `exclude`."""
    fields = [setting.name for setting in dataclasses.fields(dataclass_type) if setting.name not in exclude]
    return {name: getattr(args, name) for name in fields}


# Argument types of the numbers a command cannot run with out of range: a value outside it is a usage error naming the
# value and the range (exit 2), found when the command line is parsed, before any work starts.


def whole_number(minimum: int, maximum: int | None = None, what: str = "a whole number"):
    """An argparse `type`: a whole number from `minimum` (to `maximum`)."""
    expected = f"{what} from {minimum} to {maximum}" if maximum is not None else f"{what} of at least {minimum}"

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < minimum or (maximum is not None and number > maximum):
            raise argparse.ArgumentTypeError(f"expected {expected}, not {value!r}")
        return number

    return parse


def real_number(above: float | None = None, at_least: float | None = None, at_most: float | None = None):
    """An argparse `type`: a finite number above `above` (or at least `at_least`), and at most `at_most`."""
    bounds = [f"above {above:g}" if above is not None else f"of at least {at_least:g}"]
    if at_most is not None:
        bounds.append(f"at most {at_most:g}")
    expected = "a number " + " and ".join(bounds)

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        in_range = math.isfinite(number)
        in_range = in_range and (number > above if above is not None else number >= at_least)
        in_range = in_range and (at_most is None or number <= at_most)
        if not in_range:
            raise argparse.ArgumentTypeError(f"expected {expected}, not {value!r}")
        return number

    return parse


positive_int = whole_number(1)  # `--threads`, step and row counts
non_negative_int = whole_number(0)  # seeds (numpy takes none below 0), counts that may be 0
port_number = whole_number(1, 65535, "a port number")  # 0 would be a port the server picks, not the one it prints
positive_float = real_number(above=0)  # learning rates, timeouts
fraction = real_number(above=0, at_most=1)  # a share of memory


THREADS_HELP = (
    "CPU threads torch computes with (default: one per core that other work leaves idle when the command starts, "
    "from the load average, at least 1; torch's own, one per core, where OMP_NUM_THREADS is set or no load average "
    "is known)"
)


def add_threads_argument(parser) -> None:
    """`--threads N` of every command that computes with torch on the CPU (`set_threads` applies it)."""
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N", help=THREADS_HELP)


def idle_cores() -> int | None:
    """The cores that other work leaves idle now: the machine's cores less its 1-minute load average (the processes
    running or waiting for a core), rounded; None where the system keeps no load average (Windows)."""
    if not hasattr(os, "getloadavg"):
        return None
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    return round((os.cpu_count() or 1) - load)


def default_threads(torch_threads: int) -> int:
    """The threads a command computes with when `--threads` is not given: torch's (`torch_threads`, one per core) on
    idle cores, fewer on busy ones.

    Each of torch's parallel operations waits for its slowest thread, and a thread whose core another process holds
    waits for it: on cores other work keeps busy, a second thread makes every operation wait. Measured side by side on
    this project's 2-core machine at a load average of 10 to 19 (benchmarks/results/threads.md): with torch's two
    threads the demo's generation took 2.8x the time of one thread, a fine-tuning step 3.5x, the conversion's check 8x.
    OMP_NUM_THREADS, where set, is the caller's choice and is kept."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch_threads
    idle = idle_cores()
    if idle is None:
        return torch_threads
    return max(1, min(torch_threads, idle))


def set_threads(threads: int | None) -> int:
    """Set torch's CPU threads to `threads` (`--threads`), or when not given to `default_threads`; returns the
    number set."""
    import torch  # here, not at the top: the parser is built and `--help` answered without torch

    if threads is None:
        threads = default_threads(torch.get_num_threads())
    torch.set_num_threads(threads)
    return threads
