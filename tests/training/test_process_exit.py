"""`exit_after_deepspeed_run` (iha/training/process_exit.py): a process that calls it runs its exit handlers, flushes
what it printed and logged, exits with the status given, and skips the interpreter's teardown (where gloo's threads
can abort a finished DeepSpeed process); `iha sft` calls it after a DeepSpeed run and only then."""

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

import iha.cli.sft as sft_command


SCRIPT = textwrap.dedent(
    """
    import atexit
    import logging
    import sys

    from iha.training import exit_after_deepspeed_run

    class TornDownAtTeardown:
        def __del__(self):
            sys.stdout.write("torn down\\n")  # the interpreter's teardown collects module globals

    kept = TornDownAtTeardown()
    atexit.register(lambda: sys.stdout.write("exit handler ran\\n"))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    logging.getLogger("run").info("logged before the exit")
    sys.stdout.write("printed without a newline")
    exit_after_deepspeed_run(3)
    sys.stdout.write("never reached\\n")
    """
)


def test_exit_runs_the_handlers_flushes_and_skips_the_teardown(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 3
    assert completed.stdout == "printed without a newlineexit handler ran\n"
    assert "torn down" not in completed.stdout and "never reached" not in completed.stdout
    assert completed.stderr.strip().endswith("logged before the exit")


@pytest.mark.parametrize("deepspeed", [True, False])
def test_iha_sft_exits_that_way_after_a_deepspeed_run_only(monkeypatch, deepspeed):
    exits = []
    trainer = SimpleNamespace(is_deepspeed_enabled=deepspeed)
    monkeypatch.setattr(sft_command, "run_cli", lambda argv, prog: trainer)
    monkeypatch.setattr(sft_command, "exit_after_deepspeed_run", exits.append)
    assert sft_command.main(["--model_name_or_path", "unused"]) == 0
    assert exits == ([0] if deepspeed else [])
