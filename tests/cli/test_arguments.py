"""Every long option of an `iha` parser parses as --snake_case and as --kebab-case, wherever it was declared."""

import argparse
import importlib
import os
import re

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


def every_parser(parser: argparse.ArgumentParser):
    """`parser` and its subparsers, at every depth."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                yield from every_parser(subparser)


@pytest.mark.parametrize(
    "argv, abbreviation",
    [
        # `--max-steps`: it ran, and replaced an earlier demo's output. The model folders below do not exist, so that a
        # parser taking the abbreviation stops at once.
        (["demo", "--model", "./missing", "--output-dir", "./missing-out", "--max-step", "5"], "--max-step"),
        (["sft", "--model_name_or_path", "m", "--dataset_name", "d", "--max_step", "5"], "--max_step"),
        (["serve", "./missing", "--por", "8001"], "--por"),
        (["eval", "needle", "--model", "m", "--num-example", "5"], "--num-example"),
    ],
)
def test_an_abbreviated_flag_is_refused_not_taken_for_the_flag_it_begins(
    argv, abbreviation, tmp_path, capsys, monkeypatch
):
    from iha.cli.main import main as iha_main

    monkeypatch.chdir(tmp_path)
    try:
        status = iha_main(argv)
    except SystemExit as exit_info:  # argparse's usage error
        status = exit_info.code
    error = capsys.readouterr().err
    assert status == 2
    # argparse says "unrecognized arguments"; TRL's parser (`iha sft`) "arguments are not used".
    assert re.search(
        rf"(unrecognized arguments: |arguments are not used by the HfArgumentParser: \[')"
        rf"{abbreviation}",
        error,
    ), error


@pytest.mark.parametrize("spelling", ["--window_unit", "--window-unit"])
def test_the_retired_token_window_flag_is_an_unrecognized_argument(spelling, tmp_path, capsys):
    # The token-unit window is retired (one window: W * P virtual tokens), so its flag is gone, not ignored: convert
    # stops at argparse, before it reads the source or writes the output folder.
    from iha.cli.main import main as iha_main

    output = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        iha_main(["convert", str(tmp_path / "missing-source"), str(output), spelling, "token"])
    assert exit_info.value.code == 2
    assert f"iha convert: error: unrecognized arguments: {spelling} token" in capsys.readouterr().err
    assert not output.exists()


def test_no_parser_of_a_command_accepts_abbreviations():
    from iha.cli.main import COMMANDS, command_module

    for command in COMMANDS:
        for parser in every_parser(importlib.import_module(command_module(command)).make_parser()):
            assert parser.allow_abbrev is False, f"{parser.prog} accepts abbreviated flags"


def test_every_parser_of_the_repository_is_built_without_abbreviations():
    # Scripts and benchmarks build theirs with the factory above, or with argparse's class and allow_abbrev=False.
    import ast

    from testing_utils import REPO_ROOT

    for path in sorted(REPO_ROOT.glob("*/**/*.py")):
        if path.parts[len(REPO_ROOT.parts)].startswith(".") or "site-packages" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "ArgumentParser"
            ):
                keywords = {keyword.arg: keyword.value for keyword in node.keywords}
                value = keywords.get("allow_abbrev")
                assert isinstance(value, ast.Constant) and value.value is False, (
                    f"{path.relative_to(REPO_ROOT)}:{node.lineno} builds a parser that accepts abbreviated flags"
                )


@pytest.mark.parametrize(
    "cores, load, torch_threads, expected",
    [
        (2, 6.7, 2, 1),  # the project's busy 2-core machine: one thread, never none
        (2, 1.0, 2, 1),  # one other job holds a core
        (2, 0.2, 2, 2),  # idle: torch's own count
        (8, 3.4, 8, 5),  # 4.6 cores idle, rounded
        (64, 0.0, 8, 8),  # never more than torch's own count
    ],
)
def test_without_threads_a_command_takes_the_cores_other_work_leaves_idle(
    cores, load, torch_threads, expected, monkeypatch
):
    from iha.cli.arguments import default_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert default_threads(torch_threads) == expected
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch_threads))  # the caller's choice: torch's count is kept
    assert default_threads(torch_threads) == torch_threads
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delattr(os, "getloadavg")  # Windows keeps no load average
    assert default_threads(torch_threads) == torch_threads


def test_the_demo_says_how_many_threads_it_computes_with(tmp_path, capsys, monkeypatch):
    from iha.cli.main import main as iha_main

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 8.0, 8.0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert iha_main(["demo", "--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "out")]) == 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "[iha demo] computing with 1 CPU thread (the cores idle now; --threads N to choose)" in out
