"""Every shell command and Python snippet of README.md, checked the way a user meets them, so that the README cannot
rot: the commands run as written in README order in one scratch folder, the snippets each in a fresh process
(docs_commands.py says how, with every substitution it makes). The docs pages' commands and snippets are checked the
same way by their own test files beside this one; this file also holds the checks that span every page."""

import re
import shlex
from pathlib import Path

import pytest
from docs_commands import (
    NOT_RUN,
    RUN_ELSEWHERE,
    check_page_command,
    check_written_files_are_ignored,
    command_ids,
    page_fixtures,
    research_parser,
    research_task,
    run_snippet,
    snippet_ids,
    snippets_to_run,
)
from testing_utils import DOC_PAGES, REPO_ROOT, TESTS_DIR, page_commands, page_snippets


PAGE = "README.md"
COMMANDS = page_commands(PAGE)
SNIPPETS = snippets_to_run(PAGE)
# The README's commands start from nothing: its own `iha-convert` writes `smollm2-iha`.
scratch, servers, snippet_scratch, snippet_server = page_fixtures(PAGE, converted=False)


def page_test_file(page: str):
    name = "readme" if page == "README.md" else page.removeprefix("docs/").removesuffix(".md").replace("-", "_")
    return TESTS_DIR / "docs" / (f"test_{name}_commands.py" if page == "README.md" else f"test_{name}_page_commands.py")


def test_every_page_with_commands_or_snippets_has_its_test_file():
    pages = [page for page in DOC_PAGES if page_commands(page) or page_snippets(page)]
    assert "README.md" in pages and len(pages) >= 5
    missing = [str(page_test_file(page).relative_to(REPO_ROOT)) for page in pages if not page_test_file(page).is_file()]
    assert not missing, missing
    for page in pages:
        assert f'PAGE = "{page}"' in page_test_file(page).read_text(encoding="utf-8"), page


def test_every_marked_command_is_listed_with_its_reason_and_every_reason_is_used():
    commands = [command for page in DOC_PAGES for command in page_commands(page)]
    for command in commands:
        if command.marker:
            assert sum(key in command.text for key in NOT_RUN) == 1, command.text
    for key in [*NOT_RUN, *RUN_ELSEWHERE]:
        assert any(key in command.text for command in commands), f"no page has a command with {key!r}"


def test_the_readme_has_the_four_starts():
    programs = [command.argv[0].rsplit("/", 1)[-1] for command in COMMANDS]
    assert {"iha-convert", "iha", "vllm", "mlx_lm.generate"} <= set(programs)
    assert any(command.engine == "vllm" for command in COMMANDS)
    assert SNIPPETS and all("import" in snippet for snippet in SNIPPETS)


# Every `python -m research.<task>` command the pages show, in a code block (```bash or plain, `\` continuations
# joined) or in running text (`...`): what a user copies must parse with the task's own parser. Those of the pages'
# shell blocks also run (above, or in their page's test); the long presets are the same code with other settings.
RESEARCH_PAGES = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "CONTRIBUTING.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
    *sorted((REPO_ROOT / "benchmarks").glob("*/README.md")),
]
RESEARCH_COMMAND = re.compile(r"python -m research\.[a-z_]+(?: [^`\n]*)?")


def research_commands(page: Path) -> list[str]:
    """The page's `python -m research.TASK ...` commands, as one line each (a pattern with `...` left out)."""
    text = page.read_text(encoding="utf-8")
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
    lines = [line for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    spans = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).replace("\n", " "))
    found = [match.group(0).strip() for piece in [*lines, *spans] for match in RESEARCH_COMMAND.finditer(piece)]
    return [command for command in found if "..." not in command]


RESEARCH_COMMANDS = sorted(
    {(str(page.relative_to(REPO_ROOT)), command) for page in RESEARCH_PAGES for command in research_commands(page)}
)


def test_the_pages_show_every_research_task():
    tasks = {command.split()[2] for _, command in RESEARCH_COMMANDS}
    assert tasks == {"research.synthetic", "research.polynomial_filter", "research.ab"}, tasks


@pytest.mark.parametrize("page, command", RESEARCH_COMMANDS, ids=[f"{p}: {c[:50]}" for p, c in RESEARCH_COMMANDS])
def test_every_research_command_the_pages_show_parses(page, command, capsys):
    words = shlex.split(command, comments=True)
    if words[-1] == "&":  # run in the background, beside the next command
        words = words[:-1]
    words = ["1" if word == "N" else word for word in words]  # `--seed N`: a placeholder for a seed
    program, *arguments = words
    task = research_task(program, arguments)
    assert task is not None, command
    if arguments[2:] == ["--help"]:
        with pytest.raises(SystemExit) as exit_info:
            research_parser(task).parse_args(arguments[2:])
        assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(f"usage: python -m research.{task}")
        return
    research_parser(task).parse_args(arguments[2:])


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=command_ids(COMMANDS))
def test_readme_command(command, scratch, servers):
    check_page_command(command, scratch, servers)


@pytest.mark.slow  # it reads what the (slow) commands above wrote
def test_everything_the_commands_wrote_is_ignored_by_git(scratch):
    check_written_files_are_ignored(scratch)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=snippet_ids(SNIPPETS))
def test_readme_snippet_runs_as_written(snippet, snippet_scratch, snippet_server):
    run_snippet(snippet, snippet_scratch, snippet_server)
