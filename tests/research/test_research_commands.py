"""The research tasks' command lines, `python -m research.<task>`: each runs as a module from the repository's root
(research/ is not installed), under its own name, in the package's flag style (`iha.cli.arguments`: --snake_case,
--kebab-case accepted, `--threads`), and takes no abbreviated flag."""

import importlib
import os
import re
import subprocess
import sys

import pytest
from testing_utils import REPO_ROOT


# task -> flags its help lists, in that order (the options of no group first, then each group's)
TASKS = {
    "synthetic": ["--preset", "--output_dir", "--seeds", "--threads", "--m", "--tasks", "--pseudo_heads"],
    "polynomial_filter": ["--output_dir", "--runs_from", "--report_only", "--threads", "--order", "--steps"],
    "ab": ["--preset", "--output_dir", "--fresh", "--threads", "--model", "--learning_rate", "--temperature"],
}


def make_parser(task: str):
    return importlib.import_module(f"research.{task}.cli").make_parser()


@pytest.mark.slow  # three interpreters, each importing torch
@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_task_runs_as_a_module_from_the_repository_root(task):
    # As a user runs it: in the checkout, with nothing on PYTHONPATH (`python -m` puts the current folder first).
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-m", f"research.{task}", "--help"],
        cwd=REPO_ROOT,
        env={**environment, "COLUMNS": "120", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    page = result.stdout
    assert page.startswith(f"usage: python -m research.{task} "), page[:200]
    body = page[page.index("\n\n") :]
    positions = [re.search(rf"\n +{re.escape(flag)}\b", body).start() for flag in TASKS[task]]
    assert positions == sorted(positions), f"the flags are not listed in this order: {TASKS[task]}"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_help_lists_each_flag_once_in_snake_case_with_its_default_once(task, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    page = make_parser(task).format_help()
    assert not re.search(r"(\n  |\[|, )--[a-z0-9]+-[a-z]", page), "a --kebab-case spelling in help"
    assert not re.search(r"\(default:[^)]*\)\s*\(default:", page), "a default said twice"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_task_takes_the_one_threads_flag_and_both_spellings(task, capsys):
    parser = make_parser(task)
    assert parser.parse_args(["--threads", "1"]).threads == 1
    assert parser.parse_args([]).threads is None
    assert parser.parse_args(["--output-dir", "a"]).output_dir == parser.parse_args(["--output_dir", "a"]).output_dir
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--threads", "0"])
    assert exit_info.value.code == 2
    assert "argument --threads: expected a whole number of at least 1, not '0'" in capsys.readouterr().err


@pytest.mark.parametrize("task", sorted(TASKS))
def test_an_abbreviated_flag_is_refused(task, capsys):
    # `--output` would otherwise be read as --output_dir: a flag added later could silently change what it means.
    with pytest.raises(SystemExit) as exit_info:
        make_parser(task).parse_args(["--output", "somewhere"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --output somewhere" in capsys.readouterr().err
