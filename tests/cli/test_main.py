"""The `iha` dispatcher reaches every command."""

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from iha.cli import main as cli


def test_usage_lists_every_command(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"  {name} " in out


def test_unknown_command_is_an_error(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.MOVED))
def test_a_command_that_moved_to_research_says_where_in_one_line(command, capsys):
    # `iha ab`, `iha synthetic`, `iha polynomial-filter` left the package for research/ (`python -m research.<task>`).
    assert command not in cli.COMMANDS
    for argv in ([command], [command, "--help"], [command, "--preset", "tiny"]):
        assert cli.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert f"`python -m {cli.MOVED[command]}`" in captured.err and "unknown command" not in captured.err
    # The module it names is the one that runs it.
    assert importlib.util.find_spec(f"{cli.MOVED[command]}.__main__") is not None
    assert (Path(__file__).resolve().parents[2] / cli.MOVED[command].replace(".", "/") / "__main__.py").is_file()


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_help_under_its_own_name_with_each_flag_and_default_once(command, capsys, monkeypatch):
    # In this process (`iha COMMAND --help` is cli.main's argv; the console scripts' own --help is checked below).
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit:
        cli.main([command, "--help"])
    page = capsys.readouterr().out
    assert exit.value.code == 0
    assert page.startswith(f"usage: iha {command} "), page[:200]  # not `usage: iha-convert`
    # Flags are listed (in usage and at the start of their entry) in one spelling: --snake_case. TRL's help texts may
    # name other programs' flags (`pip install --no-build-isolation`).
    listed_kebab = re.search(r"(\n  |\[|, )--[a-z0-9]+-[a-z]", page)
    assert not listed_kebab, "a --kebab-case spelling in help (listed: --snake_case)"
    assert not re.search(r"\(default:[^)]*\)\s*\(default:", page), "a default said twice"


CONSOLE_SCRIPTS = {"iha": cli.main, "iha-convert": cli.convert, "iha-sft": cli.sft, "iha-eval": cli.evaluate}


@pytest.mark.parametrize("script", sorted(CONSOLE_SCRIPTS))
def test_every_console_script_answers_version_and_help(script, capsys, monkeypatch):
    from iha import __version__

    # The installed entry point is the function below (pip's wrapper calls it with sys.argv; it is run in its own
    # process once, in the next test: each such process spends seconds importing torch, transformers and TRL).
    (entry_point,) = [
        point for point in importlib.metadata.entry_points(group="console_scripts") if point.name == script
    ]
    assert entry_point.load() is CONSOLE_SCRIPTS[script]
    for flag, expected in (("--version", f"{script} {__version__} (transformers "), ("--help", f"usage: {script} ")):
        monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).parent / script), flag])
        try:
            status = CONSOLE_SCRIPTS[script]()
        except SystemExit as exit:
            status = exit.code
        out = capsys.readouterr().out
        assert status == 0
        assert out.startswith("usage: iha COMMAND" if script == "iha" and flag == "--help" else expected), out[:200]


def test_a_console_script_runs_in_its_own_process():
    from iha import __version__

    executable = Path(sys.executable).parent / "iha-convert"
    result = subprocess.run([str(executable), "--version"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"iha-convert {__version__} (transformers "), result.stdout


def test_push_refuses_a_folder_that_is_not_iha(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert cli.main(["push", str(tmp_path), "someone/model"]) != 0
    assert "not an IHA checkpoint folder" in capsys.readouterr().err


def test_eval_compare_names_a_bad_result_file_in_one_line(tmp_path, capsys):
    (tmp_path / "notes.json").write_text('{"model": "base"}')
    (tmp_path / "broken.json").write_text("{")
    for name, problem in (("notes.json", "is not a result file of `iha-eval math`"), ("broken.json", "cannot read")):
        assert cli.main(["eval", "compare", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        # The command names itself as it was called (`iha eval` here, `iha-eval` as the console script).
        assert err.startswith("iha eval compare: error: ") and problem in err and len(err.splitlines()) == 1
