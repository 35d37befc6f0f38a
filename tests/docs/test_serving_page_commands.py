"""docs/serving.md's shell commands and Python snippets, run as written in page order (docs_commands.py says how, with
every substitution it makes). The page is read after the README: its scratch folder starts with the `smollm2-iha` the
README's `iha-convert` writes."""

import pytest
from docs_commands import (
    check_page_command,
    check_written_files_are_ignored,
    command_ids,
    page_fixtures,
    run_snippet,
    snippet_ids,
    snippets_to_run,
)
from testing_utils import page_commands


PAGE = "docs/serving.md"
COMMANDS = page_commands(PAGE)
SNIPPETS = snippets_to_run(PAGE)
scratch, servers, snippet_scratch, snippet_server = page_fixtures(PAGE, converted=True)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=command_ids(COMMANDS))
def test_command(command, scratch, servers):
    check_page_command(command, scratch, servers)


@pytest.mark.slow  # it reads what the (slow) commands above wrote
def test_everything_the_commands_wrote_is_ignored_by_git(scratch):
    check_written_files_are_ignored(scratch)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=snippet_ids(SNIPPETS))
def test_snippet_runs_as_written(snippet, snippet_scratch, snippet_server):
    run_snippet(snippet, snippet_scratch, snippet_server)
