"""Run an `iha` command in a real subprocess that stops at a known point, so a test can signal it mid-work."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


# argv: READY TARGET NTH COMMAND ARGS...; TARGET is "module:attribute.path". Before the NTH call of TARGET the
# process writes READY and sleeps, so the test knows exactly where it is when it sends a signal.
PAUSING_COMMAND = """
import functools, importlib, signal, sys, time
from pathlib import Path

# As in an interactive shell, even when the tests run as a background job (which starts with Ctrl-C ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
ready, target, nth = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
module_name, _, attribute_path = target.partition(":")
owner = importlib.import_module(module_name)
*owners, name = attribute_path.split(".")
for part in owners:
    owner = getattr(owner, part)
real, calls = getattr(owner, name), []

@functools.wraps(real)
def pause_before_nth_call(*args, **kwargs):
    calls.append(1)
    if len(calls) == nth:
        ready.write_text("paused")
        time.sleep(600)
    return real(*args, **kwargs)

setattr(owner, name, pause_before_nth_call)
from iha.cli import main
sys.exit(main(sys.argv[4:]))
"""
# Generous: the subprocess imports torch and transformers on a shared machine. Only a hang reaches it.
LIMIT_S = 300


def subprocess_env() -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_process(ready: Path, target: str, nth: int, argv: list[str], cwd: Path | None = None) -> subprocess.Popen:
    """`iha ARGV` in a subprocess that has stopped before the `nth` call of `target` (fails the test if it never
    gets there)."""
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSING_COMMAND, str(ready), target, str(nth), *argv],
        env=subprocess_env(),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + LIMIT_S
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            out, err = process.communicate()
            pytest.fail(f"`iha {' '.join(argv)}` never reached {target}:\n{out}\n{err}")
        time.sleep(0.05)
    return process


def finish(process: subprocess.Popen) -> tuple[str, str]:
    return process.communicate(timeout=LIMIT_S)
