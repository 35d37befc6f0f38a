"""What CONTRIBUTING.md and CHANGELOG.md promise stays true: the pre-commit hooks run the ruff the dev extra pins, CI
lints before it tests, every command CONTRIBUTING.md times is a Makefile target, and the changelog has a section for
the version setup.py names and one for what is not released."""

import re

from testing_utils import REPO_ROOT


def setup_text() -> str:
    return (REPO_ROOT / "setup.py").read_text(encoding="utf-8")


def test_pre_commit_runs_the_ruff_the_dev_extra_pins():
    pinned = re.search(r'^RUFF = "ruff==([0-9.]+)"$', setup_text(), re.M)
    assert pinned, "setup.py pins ruff in RUFF"
    config = (REPO_ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8")
    assert re.search(
        r"repo: https://github.com/astral-sh/ruff-pre-commit\n\s+rev: v" + re.escape(pinned[1]) + "\n", config
    )
    assert "- id: ruff-check" in config and "- id: ruff-format" in config
    assert "RUFF," in setup_text()  # in the dev extra


def test_ci_lints_before_it_tests():
    commands = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands.index("make lint") < commands.index("make test")
    lint = "lint: install\n\t$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .\n"
    assert lint in (REPO_ROOT / "Makefile").read_text()


def test_every_command_contributing_times_is_a_make_target():
    contributing = (REPO_ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    timed = re.findall(r"^\| `make ([a-z-]+)` \|", contributing, re.M)
    assert {"lint", "test-fast", "test", "matrix", "vllm-test"} <= set(timed)
    targets = set(re.findall(r"^([a-z-]+):", (REPO_ROOT / "Makefile").read_text(), re.M))
    assert set(timed) <= targets, set(timed) - targets


def test_the_changelog_has_the_version_and_an_unreleased_section():
    version = re.search(r'^__version__ = "([^"]+)"$', (REPO_ROOT / "iha" / "__init__.py").read_text(), re.M)[1]
    headings = re.findall(r"^## \[([^\]]+)\]", (REPO_ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert headings[0] == "Unreleased" and version in headings
