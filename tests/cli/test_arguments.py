"""Every long option of an `iha` parser parses as --snake_case and as --kebab-case, wherever it was declared."""

import argparse
import importlib

import pytest
import torch

from iha.cli.arguments import ArgumentParser


def make_parser(prog: str = "tool") -> ArgumentParser:
    parser = ArgumentParser(prog=prog)
    parser.add_argument("--num-pseudo-heads", type=int)
    group = parser.add_argument_group("group")
    group.add_argument("--max_shard_size")
    exclusive = parser.add_mutually_exclusive_group()
    exclusive.add_argument("--fast-path", action="store_true")
    exclusive.add_argument("--slow_path", action="store_true")
    group.add_mutually_exclusive_group().add_argument("--in-group", action="store_true")
    parser.add_subparsers(dest="command").add_parser("run").add_argument("--sub-option")
    return parser


@pytest.mark.parametrize("style", ["snake", "kebab"])
def test_both_spellings_parse_in_the_parser_its_groups_and_its_subparsers(style):
    def flag(name):
        return "--" + (name if style == "snake" else name.replace("_", "-"))

    argv = [flag("num_pseudo_heads"), "2", flag("max_shard_size"), "5GB", flag("fast_path"), flag("in_group")]
    args = make_parser().parse_args([*argv, "run", flag("sub_option"), "x"])
    assert (args.num_pseudo_heads, args.max_shard_size, args.fast_path, args.slow_path) == (2, "5GB", True, False)
    assert (args.in_group, args.command, args.sub_option) == (True, "run", "x")


def test_help_lists_each_flag_once_in_snake_case_and_exclusion_names_both(capsys):
    parser = make_parser()
    help_text = parser.format_help()
    assert "--num_pseudo_heads NUM_PSEUDO_HEADS\n" in help_text and "--num-pseudo-heads" not in help_text
    assert "--max_shard_size MAX_SHARD_SIZE\n" in help_text and "--max-shard-size" not in help_text
    assert "--in_group\n" in help_text and "--in-group" not in help_text
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--fast-path", "--slow_path"])
    assert exit_info.value.code == 2
    assert (
        "argument --slow_path/--slow-path: not allowed with argument --fast_path/--fast-path" in capsys.readouterr().err
    )


def test_yes_no_flags_are_flag_and_no_flag_in_both_spellings_and_listed_once():
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--keep-system-prompt", action=argparse.BooleanOptionalAction, default=None, help="keep it")
    values = {
        tuple(argv): parser.parse_args(argv).keep_system_prompt
        for argv in (
            [],
            ["--keep_system_prompt"],
            ["--keep-system-prompt"],
            ["--no_keep_system_prompt"],
            ["--no-keep-system-prompt"],
        )
    }
    assert list(values.values()) == [None, True, True, False, False]
    help_text = parser.format_help()
    assert "[--keep_system_prompt | --no_keep_system_prompt]" in help_text
    assert "--keep_system_prompt, --no_keep_system_prompt\n" in help_text
    assert "-keep-system-prompt" not in help_text


def test_every_parser_and_subparser_answers_version_under_the_prog_it_was_given(capsys):
    from iha import __version__

    parser = make_parser("iha tool")  # `iha convert` rather than the script's name `iha-convert`
    for argv, prog in ((["--version"], "iha tool"), (["run", "--version"], "iha tool run")):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.startswith(f"{prog} {__version__} (transformers ")
    assert parser.format_usage().startswith("usage: iha tool ")


# The research tasks take it too (tests/research/test_research_commands.py).
THREADED_COMMANDS = [
    ["demo"],
    ["serve", "folder"],
    ["eval", "math", "--model", "m", "--dataset", "gsm8k"],
    ["eval", "needle", "--model", "m"],
]


@pytest.mark.parametrize("argv", THREADED_COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_every_command_computing_with_torch_takes_the_one_threads_flag(argv, capsys):
    from iha.cli.main import command_module

    parser = importlib.import_module(command_module(argv[0])).make_parser()
    assert parser.parse_args([*argv[1:], "--threads", "1"]).threads == 1
    assert parser.parse_args(argv[1:]).threads is None
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*argv[1:], "--threads", "0"])
    assert exit_info.value.code == 2
    assert "argument --threads: expected a whole number of at least 1, not '0'" in capsys.readouterr().err


def test_threads_reach_torch_before_the_work(tmp_path, capsys):
    # The demo and eval set the threads before they read their input: a bad input still leaves torch at --threads.
    from iha.cli.main import main as iha_main

    before = torch.get_num_threads()
    try:
        for argv in (
            ["demo", "--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "demo")],
            ["eval", "math", "--model", "m", "--dataset", f"gsm8k={tmp_path / 'missing.jsonl'}"],
        ):
            torch.set_num_threads(2)
            assert iha_main([*argv, "--threads", "1"]) == 2
            assert torch.get_num_threads() == 1, argv
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()
