"""The `iha` dispatcher reaches every command."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from iha import cli


def test_usage_lists_every_command(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"  {name} " in out


def test_unknown_command_is_an_error(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_help_under_its_own_name_with_each_flag_and_default_once(command, capsys, monkeypatch):
    # In this process (`iha COMMAND --help` is cli.main's argv; the console scripts themselves are run below).
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


@pytest.mark.parametrize("script", ["iha", "iha-convert", "iha-sft", "iha-eval"])
def test_every_console_script_answers_version(script):
    from iha import __version__

    executable = Path(sys.executable).parent / script
    result = subprocess.run([str(executable), "--version"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"{script} {__version__} (transformers "), result.stdout
    help_text = subprocess.run([str(executable), "--help"], capture_output=True, text=True, timeout=300).stdout
    assert help_text.startswith("usage: iha COMMAND" if script == "iha" else f"usage: {script} "), help_text[:200]


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
        assert err.startswith("iha-eval compare: error: ") and problem in err and len(err.splitlines()) == 1
