"""`exit_after_deepspeed_run` (iha/training/process_exit.py): a process that calls it runs its exit handlers, flushes
what it printed and logged, exits with the status given, and skips the interpreter's teardown (where gloo's threads
can abort a finished DeepSpeed process); `iha sft` calls it after a DeepSpeed run and only then."""

import os
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
    import os
    import sys
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from iha.training import exit_after_deepspeed_run

    folder = Path(sys.argv[1])


    class TornDownAtTeardown:
        def __del__(self, write=os.write):
            write(1, b"torn down\\n")  # the interpreter's teardown collects module globals; os.write outlives sys


    kept = TornDownAtTeardown()
    atexit.register(lambda: sys.stdout.write("exit handler ran\\n"))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    logging.getLogger("run").info("logged before the exit")


    def write_late(name):
        time.sleep(1.0)
        (folder / name).write_text("written")


    # Work still going on when the run ends (an upload, a checkpoint writer): a normal exit waits for it.
    threading.Thread(target=write_late, args=("thread.txt",)).start()
    ThreadPoolExecutor(1).submit(write_late, "future.txt")
    sys.stdout.write("printed without a newline")
    exit_after_deepspeed_run(3)
    sys.stdout.write("never reached\\n")
    """
)


def test_exit_waits_for_work_runs_the_handlers_flushes_and_skips_the_teardown(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    # Buffered output, as in a terminal-less process: the flush is what brings the last line out.
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    completed = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120, env=environment
    )
    assert completed.returncode == 3, completed.stderr
    assert completed.stdout == "printed without a newlineexit handler ran\n"
    assert completed.stderr.strip().endswith("logged before the exit")
    assert (tmp_path / "thread.txt").read_text() == "written"
    assert (tmp_path / "future.txt").read_text() == "written"


@pytest.mark.parametrize("deepspeed", [True, False])
def test_iha_sft_exits_that_way_after_a_deepspeed_run_only(monkeypatch, deepspeed):
    exits = []
    trainer = SimpleNamespace(is_deepspeed_enabled=deepspeed)
    monkeypatch.setattr(sft_command, "run_cli", lambda argv, prog: trainer)
    monkeypatch.setattr(sft_command, "exit_after_deepspeed_run", exits.append)
    assert sft_command.main(["--model_name_or_path", "unused"]) == 0
    assert exits == ([0] if deepspeed else [])
